"""The training block against its GEMM floor, GPU-only (issue 24's table): fusedqkv's block and
torch.compile of the plain-PyTorch reference block, forward and forward+backward, each captured
as a CUDA graph, replayed call by call in a rotating order with the L2 flushed before each, beside
the floor -- the block's GEMMs alone through ``torch.mm`` (forward: y = x W^T; fwd+bwd: y, dX =
dY W, dW = dY^T x) -- in the same run.

Rows: bench_module.py's three blocks (091's hidden 4096 / 32 q / 8 kv heads, norm after RoPE; the
same before RoPE, Qwen3-8B-like; hidden 5120 / 64 q / 8 kv, Qwen3-32B-like) at 512, 2048 and 8192
tokens, and one long-context row (091's block, 1 x 32768 tokens). bf16.

    PYTHONPATH=src python3 benchmarks/bench_floor.py --out $OUT/floor

``--steady SECONDS``: also each graph replayed back to back for SECONDS per round (3 rounds, order
rotated, no flush; ``timing.time_steady``) while nvidia-smi samples the SM clock and board power:
the power-limited regime of a GPU under steady load, where a call's time follows its energy
(session 14), reported beside the flushed interleaved ratios.

``--ab-products``: also the block's fwd+bwd with the training backward's products forced to cuBLAS
(``config.training_triton_products`` off, the plans built under it), in the same rounds: the
``fused/cublas-products`` column (below 1: the Triton products behind the stage pay).

``--smoke``: the script on tiny CPU shapes (wall clock, no graphs; no timing value).
Prints a table last; writes --out/bench_floor.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_families as BF  # noqa: E402  (time_graphs_interleaved, time_graphs_steady)
import bench_module as BM  # noqa: E402  (CONFIGS, rope_cos_sin, time_cpu_interleaved)

from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm  # noqa: E402
from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.ops.internals import raise_compile_limits  # noqa: E402

ROWS = [(c, b, s) for c in BM.CONFIGS for b, s in ((1, 512), (1, 2048), (2, 4096))] + [
    ("091_h4096_q32_kv8", 1, 32768)]
SMOKE_ROWS = [(c, 1, 8) for c in BM.SMOKE_CONFIGS]
PROVIDERS = ("fusedqkv", "compile", "floor")
MODES = ("fwd", "fwd+bwd")


def make_calls(cfg: dict, b: int, s: int, device, dtype, ab_products: bool = False) -> tuple[dict, list]:
    """{(provider, mode): callable} and what the graphs read (kept alive)."""
    g = torch.Generator(device="cpu").manual_seed(b * s)
    fused = GQAQKVRoPEQKNorm(**cfg, device=device, dtype=dtype)
    ref = ReferenceGQAQKVRoPEQKNorm(**cfg, device=device, dtype=dtype)
    ref.load_state_dict(fused.state_dict())
    comp = torch.compile(ref, fullgraph=True, dynamic=False)
    h, hq, hkv, d = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    x = torch.randn(b, s, h, generator=g).to(device, dtype).requires_grad_()
    cos, sin = BM.rope_cos_sin(b, s, d, dtype, device)
    dy = [torch.randn(b, n, s, d, generator=g).to(device, dtype) for n in (hq, hkv, hkv)]

    def with_backward(mod):
        leaves = [x, *mod.parameters()]

        def call():
            out = mod(x, cos, sin)
            return torch.autograd.grad(out, leaves, dy)
        return call

    x2d = x.detach().reshape(b * s, h)
    w = fused.qkv_weight.detach()
    dy2d = torch.randn(b * s, w.shape[0], generator=g).to(device, dtype)
    calls = {("fusedqkv", "fwd"): lambda: fused(x, cos, sin), ("fusedqkv", "fwd+bwd"): with_backward(fused),
             ("compile", "fwd"): lambda: comp(x, cos, sin), ("compile", "fwd+bwd"): with_backward(comp),
             ("floor", "fwd"): lambda: torch.mm(x2d, w.t()),
             ("floor", "fwd+bwd"): lambda: (torch.mm(x2d, w.t()), torch.mm(dy2d, w), torch.mm(dy2d.t(), x2d))}
    if ab_products:
        from fusedqkv.ops import config

        fused_bwd = with_backward(fused)

        def cublas_products():
            with config.override(training_triton_products=False):
                return fused_bwd()
        calls[("fused_cublas", "fwd+bwd")] = cublas_products
    return calls, [fused, ref, comp, x, cos, sin, dy, x2d, w, dy2d]


def time_row(calls: dict, reps: int, gpu: bool) -> dict:
    names = {f"{p}/{m}": (p, m) for p, m in calls}
    if not gpu:
        ms = BM.time_cpu_interleaved({n: calls[k] for n, k in names.items()}, reps)
    else:
        ms = BF.time_graphs_interleaved({n: calls[k] for n, k in names.items()}, reps)
    return {n: statistics.median(v) for n, v in ms.items()}


def time_row_steady(calls: dict, seconds: float, gpu: bool, sampler) -> dict:
    """{"provider/mode": {ms, mhz, watts, samples}} under steady load (``timing.time_steady``):
    ``timing.steady_medians``."""
    fns = {f"{p}/{m}": fn for (p, m), fn in calls.items()}
    if gpu:
        return BF.time_graphs_steady(fns, seconds, 3, sampler)
    return timing.steady_medians(timing.time_steady(fns, seconds=seconds, rounds=3, sampler=sampler))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_floor_out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="all", help="comma-separated row indices (default all)")
    ap.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                    help="also time each graph back to back for SECONDS per round (power-limited regime)")
    ap.add_argument("--ab-products", action="store_true",
                    help="also fwd+bwd with the training backward's products on cuBLAS, in the same rounds")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    gpu = not a.smoke
    raise_compile_limits(64)  # a static compile per row (a module instance each)
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    configs = BM.CONFIGS if gpu else BM.SMOKE_CONFIGS
    rows = ROWS if gpu else SMOKE_ROWS
    if a.rows != "all":
        rows = [rows[int(i)] for i in a.rows.split(",")]
    out = []
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if gpu else "cpu (smoke)", torch=torch.__version__)
    sampler = timing.ClockSampler(torch.cuda.current_device()) if gpu and a.steady > 0 else None
    for name, b, s in rows:
        t0 = time.time()
        calls, keep = make_calls(configs[name], b, s, device, dtype, a.ab_products)
        ms = time_row(calls, 2 if a.smoke else a.reps, gpu)
        steady = time_row_steady(calls, a.steady, gpu, sampler) if a.steady > 0 else None
        del calls, keep
        r = dict(config=name, batch=b, seq=s, tokens=b * s, ms=ms)
        for m in MODES:
            f, c, fl = (ms[f"{p}/{m}"] for p in PROVIDERS)
            r[m] = dict(fused_over_floor=f / fl, compile_over_floor=c / fl, fused_over_compile=f / c)
            if steady is not None:
                f, c, fl = (steady[f"{p}/{m}"]["ms"] for p in PROVIDERS)
                r[m].update(steady_fused_over_floor=f / fl, steady_compile_over_floor=c / fl)
        if a.ab_products:
            r["fwd+bwd"]["fused_over_cublas_products"] = ms["fusedqkv/fwd+bwd"] / ms["fused_cublas/fwd+bwd"]
        if steady is not None:
            r["steady"] = steady
        out.append(r)
        print(f"[{time.strftime('%H:%M:%S')}] {name} {b}x{s} in {time.time() - t0:.0f}s", flush=True)
        with open(os.path.join(a.out, "bench_floor.json"), "w") as f:  # after every row: a cut run keeps its rows
            json.dump(dict(meta=meta, rows=out), f, indent=1)
        if gpu:
            torch.cuda.empty_cache()
    print(f"{meta['device']} | torch {meta['torch']} | CUDA graphs interleaved, L2 flushed, median of {a.reps}")
    print("| block | tokens | fwd fused/floor | fwd compile/floor | fwd+bwd fused/floor | fwd+bwd compile/floor |")
    print("|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['config']} | {r['batch']}x{r['seq']} | {r['fwd']['fused_over_floor']:.3f} | "
              f"{r['fwd']['compile_over_floor']:.3f} | {r['fwd+bwd']['fused_over_floor']:.3f} | "
              f"{r['fwd+bwd']['compile_over_floor']:.3f} |")
    if a.ab_products:
        print("| block | tokens | fwd+bwd fused ms | cuBLAS products ms | fused/cublas-products |")
        print("|---|---|---|---|---|")
        for r in out:
            print(f"| {r['config']} | {r['batch']}x{r['seq']} | {r['ms']['fusedqkv/fwd+bwd']:.4f} | "
                  f"{r['ms']['fused_cublas/fwd+bwd']:.4f} | {r['fwd+bwd']['fused_over_cublas_products']:.3f} |")
    if a.steady > 0:
        print(f"steady load ({a.steady:g} s per graph and round, 3 rounds, no flush): fused/floor, compile/floor, "
              "the floor's and fusedqkv's SM MHz and W")
        print("| block | tokens | mode | fused/floor | compile/floor | floor MHz / W | fused MHz / W |")
        print("|---|---|---|---|---|---|---|")
        for r in out:
            for m in MODES:
                fl, fu = r["steady"][f"floor/{m}"], r["steady"][f"fusedqkv/{m}"]
                print(f"| {r['config']} | {r['batch']}x{r['seq']} | {m} | {r[m]['steady_fused_over_floor']:.3f} | "
                      f"{r[m]['steady_compile_over_floor']:.3f} | {fl['mhz']:.0f} / {fl['watts']:.0f} | "
                      f"{fu['mhz']:.0f} / {fu['watts']:.0f} |")
    if sampler is not None:
        sampler.close()
    for m in MODES:
        big = [r[m]["fused_over_floor"] for r in out if r["tokens"] >= 2048]
        if big:
            print(f"{m}: fused/floor geomean (>= 2048 tokens) {math.exp(sum(map(math.log, big)) / len(big)):.3f}, "
                  f"max {max(big):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
