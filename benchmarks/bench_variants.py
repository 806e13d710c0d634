"""GPU benchmark of the training block's variants (issue 25) against the plain block.

For each variant and token count: the fused block's forward, and its forward + backward
(``torch.autograd.grad`` w.r.t. hidden_states, qkv_weight and the norm weights), cold L2,
median of --reps CUDA-event timings with every variant interleaved call by call
(``timing.time_cuda_events_interleaved``), and each time relative to the plain block's.
The block is 091's (hidden 4096, 32 query heads, 8 KV heads, head_dim 128, bf16; the gated
variants have 32 more query-sized gate heads in the projection).

    PYTHONPATH=src python3 benchmarks/bench_variants.py --out $OUT/variants

``--smoke``: the script itself on tiny CPU shapes (the torch backend; no timing value).
Writes --out/bench_variants.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_module import time_cpu_interleaved  # noqa: E402

import fusedqkv  # noqa: E402

# name -> (API options, rotary fraction of head_dim, weighted norms)
VARIANTS = {
    "plain": (dict(), 1, True),
    "unweighted": (dict(), 1, False),
    "partial_0.25": (dict(), 4, True),
    "interleaved": (dict(rope_style="interleaved"), 1, True),
    "gate_partial_0.25": (dict(q_gate=True), 4, True),  # Qwen3-Next
    "v_norm": (dict(v_norm=True), 1, True),  # Gemma 3n (with its weighted q/k norms)
    "all_heads": (dict(norm_scope="all_heads"), 1, True),  # OLMo 2
    "llama4": (dict(rope_style="interleaved"), 1, False),
}


def make_inputs(name, tokens, hidden, hq, hkv, d, dtype, device, seed=0):
    opts, rot_div, weighted = VARIANTS[name]
    g = torch.Generator(device=device).manual_seed(seed)
    nq = 2 * hq if opts.get("q_gate") else hq
    x = torch.randn(1, tokens, hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    w = (torch.randn((nq + 2 * hkv) * d, hidden, generator=g, device=device, dtype=dtype) / hidden ** 0.5)
    w.requires_grad_()
    all_heads = opts.get("norm_scope") == "all_heads"
    ws = [None, None]
    if weighted:
        ws = [(1 + 0.1 * torch.randn(n, generator=g, device=device, dtype=dtype)).requires_grad_()
              for n in ((hq * d, hkv * d) if all_heads else (d, d))]
    rot = d // rot_div
    ang = torch.randn(1, tokens, rot, generator=g, device=device, dtype=torch.float32)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return (x, w, *ws, cos, sin), opts


def block_calls(args, opts, hq, hkv, backend):
    """(forward, forward + backward) of the block on ``args``."""
    leaves = [t for t in args[:4] if t is not None]

    def fwd():
        return fusedqkv.gqa_qkv_rope_qk_norm(*args, num_heads=hq, num_kv_heads=hkv, backend=backend, **opts)

    def fwd_bwd():
        out = fwd()
        return torch.autograd.grad(out, leaves, [torch.ones_like(o) for o in out])

    return fwd, fwd_bwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_variants_out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes, the torch backend (no timing value)")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if a.smoke:
        device, dtype, backend = torch.device("cpu"), torch.float32, "torch"
        hidden, hq, hkv, d, token_list = 32, 4, 2, 16, [8]
    else:
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, None
        hidden, hq, hkv, d, token_list = 4096, 32, 8, 128, [int(t) for t in a.tokens.split(",")]
    rows = []
    for tokens in token_list:
        fwds, fwd_bwds = {}, {}
        for name in names:
            args, opts = make_inputs(name, tokens, hidden, hq, hkv, d, dtype, device)
            fwds[name], fwd_bwds[name] = block_calls(args, opts, hq, hkv, backend)
        if a.smoke:  # the calls run, in the same order; the wall clock is no GPU timing
            f_ms = time_cpu_interleaved(fwds, 1)
            fb_ms = time_cpu_interleaved(fwd_bwds, 1)
        else:
            from fusedqkv.bench import timing

            flusher = timing.L2Flusher(device)
            with torch.no_grad():
                f_ms = timing.time_cuda_events_interleaved(fwds, a.reps, flusher=flusher)
            fb_ms = timing.time_cuda_events_interleaved(fwd_bwds, a.reps, flusher=flusher)
        times = {n: (f_ms[n], fb_ms[n]) for n in names}
        base_f, base_fb = (statistics.median(t) for t in times[names[0]])
        for name in names:
            f, fb = (statistics.median(t) for t in times[name])
            rows.append(dict(tokens=tokens, variant=name, fwd_ms=f, fwd_bwd_ms=fb, fwd_rel=f / base_f,
                             fwd_bwd_rel=fb / base_fb))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_variants.json").write_text(json.dumps(dict(smoke=a.smoke, rows=rows), indent=1))
    print(f"{'tokens':>7} {'variant':20s} {'fwd ms':>8} {'rel':>6} {'fwd+bwd ms':>11} {'rel':>6}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['variant']:20s} {r['fwd_ms']:8.3f} {r['fwd_rel']:6.2f} {r['fwd_bwd_ms']:11.3f} "
              f"{r['fwd_bwd_rel']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
