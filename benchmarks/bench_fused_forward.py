"""GPU sweep of the fused forward GEMM (RoPE + RMSNorm in the projection's epilogue, issue 24)
against the cuBLAS GEMM floor and today's cuBLAS + forward stage.

For each row (the 9 rows of bench_module.py, a long-context row and a Qwen3-Next-shaped row)
and each tile config: the Triton GEMM alone (no epilogue) and the fused forward, beside
``floor`` (``torch.mm`` into qkv: the one GEMM of the forward) and ``stage`` (the training
forward's plan with the fused GEMM off: cuBLASLt + the forward stage). Every provider is a
captured CUDA graph (inputs and outputs kept alive), replayed call by call in a rotating
order, L2 flushed before each (``timing.time_cuda_events_interleaved``); median of --reps.
Before timing, each fused config's outputs are checked against the torch stage run on its own
qkv (q/k within one bf16 rounding, rstd within fp32 noise) and its qkv against cuBLAS's; a
config that fails or does not compile is reported and not timed.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_fused_forward.py --out $OUT/fused_fwd

Writes --out/bench_fused_forward.json; prints a table last (ms, and each over the floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from fusedqkv.ops import config
from fusedqkv.ops.gqa_forward import forward_outputs, forward_torch
from fusedqkv.ops.launch import Table
from fusedqkv.ops.qkv_projection import fused_gemm_supported, plan_fused_forward
from fusedqkv.ops.training_forward import forward_plan, run_forward
from fusedqkv.ops.variant import Variant

# name -> (hidden, hq, hkv, D, norm_after_rope, rotary fraction divisor, q_gate)
SHAPES = {
    "hunyuan3": (4096, 32, 8, 128, True, 1, False),
    "qwen3-8b": (4096, 32, 8, 128, False, 1, False),
    "qwen3-32b": (5120, 64, 8, 128, False, 1, False),
    "glm-4.5-air": (4096, 96, 8, 128, False, 2, False),
    "d256": (4096, 16, 4, 256, False, 1, True),  # head_dim 256 with a gate (Gemma/Qwen3-Next-like heads)
}
ROWS = [(s, t) for s in ("hunyuan3", "qwen3-8b", "qwen3-32b") for t in (512, 2048, 8192)] + \
       [("hunyuan3", 32768), ("glm-4.5-air", 8192), ("d256", 8192)]
# (BM, BK, warps, stages, GROUP_M, programs per SM)
TILES_128 = [(128, 64, 8, 4, 8, 1), (128, 64, 8, 3, 8, 1), (128, 64, 8, 5, 8, 1), (128, 32, 8, 4, 8, 1),
             (128, 64, 8, 4, 16, 1), (128, 64, 8, 4, 4, 1), (64, 64, 8, 4, 8, 1), (64, 64, 8, 5, 8, 1)]
TILES_256 = [(64, 64, 8, 3, 8, 1), (64, 64, 8, 4, 8, 1), (64, 32, 8, 4, 8, 1), (128, 64, 8, 2, 8, 1)]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def inputs(shape, tokens, device, dtype=torch.bfloat16, seed=0):
    hidden, hq, hkv, d, after, rdiv, gate = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    n = ((2 * hq if gate else hq) + 2 * hkv) * d
    x = torch.randn(1, tokens, hidden, generator=g, device=device, dtype=dtype)
    w = torch.randn(n, hidden, generator=g, device=device, dtype=dtype) / hidden ** 0.5
    wq = 1 + 0.1 * torch.randn(d, generator=g, device=device, dtype=dtype)
    wk = 1 + 0.1 * torch.randn(d, generator=g, device=device, dtype=dtype)
    ang = torch.randn(1, tokens, d // rdiv, generator=g, device=device)
    return x, w, wq, wk, ang.cos().to(dtype), ang.sin().to(dtype)


def fused_call(shape, args, tile, epilogue):
    """(callable queuing the launch, its outputs) for one tile config."""
    hidden, hq, hkv, d, after, rdiv, gate = SHAPES[shape]
    x, w, wq, wk, cos, sin = args
    B, S = x.shape[:2]
    variant = Variant(rot=0 if rdiv == 1 else d // rdiv, q_gate=gate)
    why = fused_gemm_supported(x, w, d, d // rdiv, variant)
    if why:
        raise RuntimeError(why)
    qkv = torch.empty(B, S, w.shape[0], dtype=x.dtype, device=x.device)
    q, k, rq, rk, v = forward_outputs(B, S, hq, hkv, d, x.dtype, x.device, False)
    named = dict(x=x, w=w, qkv=qkv, q=q, k=k, wq=wq, wk=wk, cos=cos, sin=sin, rq=rq, rk=rk)
    table = Table()
    sl = {n: table.add(n, t) for n, t in named.items()}
    with config.override(fused_gemm_tile=tile) as cfg:
        launch = plan_fused_forward(sl["x"], sl["w"], sl["qkv"], sl["q"], sl["k"], None, None, sl["wq"], sl["wk"],
                                    sl["cos"], sl["sin"], sl["rq"], sl["rk"], hq, hkv, d, 1e-6, after, variant, cfg,
                                    epilogue=epilogue)
    tensors = table.tensors(named)
    ptrs = [t.data_ptr() for t in tensors]

    def call():  # the stream at call time: a graph capture's
        launch.launch(tensors, ptrs if launch.bound else None, torch.cuda.current_stream().cuda_stream)
    return call, (qkv, q, k, rq, rk), variant


def check(shape, args, outs, variant, epilogue=True):
    hidden, hq, hkv, d, after, rdiv, gate = SHAPES[shape]
    x, w, wq, wk, cos, sin = args
    qkv, q, k, rq, rk = outs
    ref = torch.mm(x[0], w.t())
    e_qkv = ((qkv[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not epilogue:
        return e_qkv < 1e-2, dict(qkv_rel=e_qkv)
    Q, K, RQ, RK, _ = forward_torch(qkv, wq, wk, cos, sin, hq, hkv, 1e-6, after, variant)
    e_q = max((q.float() - Q.float()).abs().max().item(), (k.float() - K.float()).abs().max().item())
    e_r = max(((rq - RQ).abs() / RQ).max().item(), ((rk - RK).abs() / RK).max().item())
    ok = e_qkv < 1e-2 and e_q <= 2 ** -6 * max(Q.float().abs().max().item(), K.float().abs().max().item()) \
        and e_r < 1e-5
    return ok, dict(qkv_rel=e_qkv, qk_abs=e_q, rstd_rel=e_r)


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_fused_forward_out")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default=None, help="shape:tokens,... (default: all)")
    ap.add_argument("--no-plain", action="store_true", help="skip the Triton GEMM without epilogue")
    a = ap.parse_args(argv)
    from fusedqkv.bench import timing

    rows = ROWS if a.rows is None else [(r.split(":")[0], int(r.split(":")[1])) for r in a.rows.split(",")]
    dev = torch.device("cuda")
    flusher = timing.L2Flusher(dev)
    results = []
    for shape, tokens in rows:
        t0 = time.time()
        args = inputs(shape, tokens, dev)
        x, w, wq, wk, cos, sin = args
        hidden, hq, hkv, d, after, rdiv, gate = SHAPES[shape]
        keep = []  # every captured graph's inputs and outputs stay alive while it lives
        graphs = {}
        qkv_floor = torch.empty(tokens, w.shape[0], dtype=x.dtype, device=dev)
        graphs["floor"], _ = graph_of(lambda: torch.mm(x[0], w.t(), out=qkv_floor))
        with config.override(fused_gemm="off"):
            plan = forward_plan(x, w, wq, wk, cos, sin, hq, hkv, 1e-6, "after_rope" if after else "before_rope",
                                None, q_gate=gate)
            graphs["stage"], out = graph_of(lambda: run_forward(plan, x, w, wq, wk, cos, sin))
            keep.append(out)
        errors = {}
        for tile in (TILES_256 if d == 256 else TILES_128):
            name = "x".join(map(str, tile))
            for epi in ((True,) if a.no_plain else (False, True)):
                key = ("fused_" if epi else "gemm_") + name
                try:
                    call, outs, variant = fused_call(shape, args, tile, epi)
                    call()
                    torch.cuda.synchronize()
                    ok, err = check(shape, args, outs, variant, epilogue=epi)
                    if not ok:
                        errors[key] = err
                        continue
                    graphs[key], _ = graph_of(call)
                    keep.append(outs)
                except Exception as e:  # a tile that does not compile or fit: reported, not timed
                    errors[key] = f"{type(e).__name__}: {str(e)[:200]}"
        fns = {n: g.replay for n, g in graphs.items()}
        ms = timing.time_cuda_events_interleaved(fns, a.reps, flusher=flusher)
        med = {n: statistics.median(v) for n, v in ms.items()}
        row = dict(shape=shape, tokens=tokens, ms=med, over_floor={n: v / med["floor"] for n, v in med.items()},
                   errors=errors)
        results.append(row)
        best = min((n for n in med if n.startswith("fused_")), key=med.get, default=None)
        log(f"{shape} {tokens}: floor {med['floor']:.3f} stage {med['stage']:.3f} best {best} "
            f"{med.get(best, float('nan')):.3f} ({time.time() - t0:.1f}s) errors {list(errors)}")
        del graphs, keep
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fused_forward.json").write_text(json.dumps(dict(rows=results, device=torch.cuda.get_device_name()),
                                                             indent=1))
    print(f"{'shape':11s} {'tokens':>6} {'floor ms':>9} {'stage/fl':>9} {'best gemm/fl':>22} {'best fused/fl':>24}")
    for r in results:
        o = r["over_floor"]
        g = min((n for n in o if n.startswith("gemm_")), key=o.get, default=None)
        f = min((n for n in o if n.startswith("fused_")), key=o.get, default=None)
        print(f"{r['shape']:11s} {r['tokens']:6d} {r['ms']['floor']:9.3f} {o['stage']:9.3f} "
              f"{(g or '-')[5:]:>16} {o.get(g, float('nan')):5.3f} {(f or '-')[6:]:>18} {o.get(f, float('nan')):5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
