"""The all-heads stage (``norm_scope='all_heads'``, OLMo 2/3's q/k norm over every head of a token)
alone: our forward and backward stage kernels at each launch setting, against torch.compile
(Inductor) of HF OLMo 3's own stage code (norm over ``[B, S, H*D]``, weight, cast, view, RoPE
in fp32, cast) on the same projection output. Each provider is captured as a CUDA graph and the
graphs are timed interleaved (rotating order, L2 flushed before each call).

    PYTHONPATH=src python3 benchmarks/all_heads_sweep.py --out $OUT/ahs

Prints a table last; writes --out/all_heads_sweep.json. ``--smoke``: a tiny shape, few reps, to
prove the script (the GPU still needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fusedqkv.bench import timing
from fusedqkv.ops import config
from fusedqkv.ops.gqa_forward import rope_qk_norm_forward
from fusedqkv.ops.rope_qk_norm import rope_qk_norm_backward
from fusedqkv.ops.variant import Variant, heads_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_families as BF  # noqa: E402

ALL_HEADS = Variant(all_heads=True)
FWD_WARPS = (1, 2, 4)
# (warps, persistent programs per SM, pipeline stages of the token loop)
BWD_SETTINGS = ((8, 1, 3), (8, 1, 4), (8, 1, 5), (4, 2, 3), (4, 2, 4), (16, 1, 4), (8, 2, 3))


def hf_stage(qkv, wq, wk, cos, sin, h, d, eps):
    """HF OLMo 3's attention input stage after the projection (Olmo3RMSNorm on the whole q / k
    row in fp32, times the weight, cast; the head view; RoPE in fp32, cast back)."""
    B, S, _ = qkv.shape
    q, k, v = qkv.split([h * d, h * d, h * d], dim=-1)

    def norm(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (w * xf).to(x.dtype)

    def rope(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        xf = x.float()
        rot = torch.cat((-x2, x1), dim=-1).float()
        return (xf * cos.unsqueeze(1) + rot * sin.unsqueeze(1)).to(x.dtype)

    q = norm(q, wq).view(B, S, h, d).transpose(1, 2)
    k = norm(k, wk).view(B, S, h, d).transpose(1, 2)
    return rope(q), rope(k), v.view(B, S, h, d).transpose(1, 2)


def graph_of(fn):
    """``fn`` captured in a CUDA graph (``bench_families.capture_graph``); returns its replay."""
    return BF.capture_graph(fn)[0].replay


def run_shape(B, S, h, d, reps, eps=1e-6):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n = h * d
    qkv = torch.randn(B, S, 3 * n, device=dev, dtype=torch.bfloat16, generator=gen)
    wq = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
    wk = (1 + 0.1 * torch.randn(n, device=dev, generator=gen)).to(torch.bfloat16)
    ang = torch.rand(B, S, d // 2, device=dev, generator=gen) * 6.28
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    M = B * S

    def tm(*shape):  # token-major [B, H, S, D]
        return torch.randn(B, S, h, d, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)

    gq, gk, gv = tm(), tm(), tm()
    xq, xk, _, _ = heads_of(qkv, h, h, d, False)
    dqkv = torch.empty(M, 3 * n, device=dev, dtype=torch.bfloat16)
    gwq, gwk = torch.empty_like(wq), torch.empty_like(wk)

    fns, errors = {}, {}

    def add(name, fn, **changes):
        try:
            with config.override(**changes):
                fns[name] = graph_of(fn)
        except Exception as e:  # noqa: BLE001 - a setting past the GPU's limits: recorded, not timed
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()

    for w in FWD_WARPS:
        add(f"fwd w{w}", lambda: rope_qk_norm_forward(qkv, wq, wk, cos, sin, h, h, eps, False, ALL_HEADS),
            forward_tile=(1, 1, w))
    for st in BWD_SETTINGS:
        add(f"bwd w{st[0]} p{st[1]} s{st[2]}", lambda: rope_qk_norm_backward(
            gq, gk, gv, xq, xk, None, None, wq, wk, cos, sin, dqkv=dqkv, grad_q_norm_weight=gwq,
            grad_k_norm_weight=gwk, exact=False, norm_after_rope=False, saved_rotated=False, eps=eps,
            variant=ALL_HEADS), all_heads_stage=st)
    # Inductor: the forward, and forward + backward (autograd.grad of q, k, v)
    comp = torch.compile(lambda a, b, c: hf_stage(a, b, c, cos, sin, h, d, eps))
    fns["inductor fwd"] = graph_of(lambda: comp(qkv, wq, wk))
    leaf = qkv.detach().requires_grad_()
    lwq, lwk = wq.detach().requires_grad_(), wk.detach().requires_grad_()

    def inductor_fwd_bwd():
        outs = comp(leaf, lwq, lwk)
        torch.autograd.grad(outs, (leaf, lwq, lwk), (gq, gk, gv))

    fns["inductor fwd+bwd"] = graph_of(inductor_fwd_bwd)
    times = timing.time_cuda_events_interleaved(fns, reps=reps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}  # us
    # bytes at the memory floor: forward reads and writes q, k (bf16); backward reads g q/k/v and
    # x q/k, writes dQKV
    fwd_bytes = 4 * M * n * 2
    bwd_bytes = (5 * M * n + 3 * M * n) * 2
    return dict(tokens=M, us=med, errors=errors, fwd_floor_us=fwd_bytes / 4.8e6, bwd_floor_us=bwd_bytes / 4.8e6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="all_heads_sweep_out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    shapes = [(1, 64, 4, 64)] if a.smoke else [(1, 2048, 32, 128), (4, 2048, 32, 128)]
    rows = [run_shape(B, S, h, d, 3 if a.smoke else a.reps) for B, S, h, d in shapes]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "all_heads_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    names = list(dict.fromkeys(n for r in rows for n in list(r["us"]) + list(r["errors"])))
    for r in rows:
        for nm, e in r["errors"].items():
            print(f"{r['tokens']} tokens, {nm}: {e}")
    print("| provider | " + " | ".join(f"{r['tokens']} tok us" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for nm in names:
        print(f"| {nm} | " + " | ".join(f"{r['us'][nm]:.1f}" if nm in r["us"] else "error" for r in rows) + " |")
    print("| floor fwd / bwd (4.8 TB/s) | " + " | ".join(f"{r['fwd_floor_us']:.1f} / {r['bwd_floor_us']:.1f}"
                                                          for r in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
