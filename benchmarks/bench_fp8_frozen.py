"""GPU benchmark of the FP8 block with a frozen weight (LoRA's base: no dW), eager, with and without
``config.fp8_frozen_weight_cache`` (W's two FP8 casts kept from call to call while W is unchanged; issue 35).

The cache is an eager feature: under CUDA-graph capture it is neither read nor filled (a replay cannot
consult a host cache), so these rows are eager calls, the providers interleaved call by call in rotated
order. An eager FP8 call's host time exceeds its GPU time up to 8192 tokens (session 27), so CUDA events around
back-to-back calls time the host (session 26's run_5 did; its 8192 row went the wrong way). Here each
call waits behind a GPU sleep while the host enqueues it (``gpu_only_interleaved``): the events span the
kernels alone, the L2 flushed before each; the call's host time (wall clock) is its own column. Each call is
``torch.autograd.grad`` of q, k, v with respect to hidden_states and the norm weights (the weight frozen):
the forward GEMM, the stage, the backward stage and dX.

  bf16           the block in bf16, W frozen
  fp8            fp8="rowwise", W frozen, W cast every call (the default)
  fp8_cached     the same with config.fp8_frozen_weight_cache on: W cast on the first call only
  fp8_floor      the forward and dX GEMMs of the rowwise recipe on operands cast beforehand

Prints a table last; writes --out/bench_fp8_frozen.json. Rows as bench_fp8.py's (indices 0-9).

    PYTHONPATH=src:/tmp/site python3 benchmarks/bench_fp8_frozen.py --rows 1,4,7,0,3,6,2 --out $OUT/frozen
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import ROWS, Row  # noqa: E402
from bench_module import CONFIGS, SIZES  # noqa: E402

from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.ops import config, fp8  # noqa: E402


def frozen_call(row: Row, w: torch.Tensor, recipe, cache: bool):
    inputs = [row.x, row.wq, row.wk]
    fn = row.fused(recipe)

    def call():
        with config.override(fp8_frozen_weight_cache=cache):
            outs = fn(row.x, w, row.wq, row.wk)
        return torch.autograd.grad(outs, inputs, row.grads)
    return call


def gpu_only_interleaved(fns: dict, reps: int, flusher, ahead_ms: float = 6.0, warmup: int = 3) -> tuple:
    """Per call, in rotated order: a device sync, a GPU sleep of ``ahead_ms`` (``torch.cuda._sleep``, a
    benchmark-only torch internal), the L2 flush, the start event, the call (its host wall clock taken),
    the end event. The host enqueues all of it while the GPU sleeps, so the events hold the kernels and
    the gaps the GPU itself takes between them, not the host's enqueue. Returns ``(gpu_ms, host_ms,
    ahead)``; ``ahead`` False: some call's host time reached 0.8 x ``ahead_ms`` (its events may hold host
    time)."""
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 2_000_000
    cycles = int(ahead_ms * khz)
    for fn in fns.values():
        for _ in range(warmup):
            flusher()
            fn()
    gpu, host = {k: [] for k in fns}, {k: [] for k in fns}
    for order in timing.rotated_orders(list(fns), reps):
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            flusher()
            start.record()
            t0 = time.perf_counter()
            fns[name]()
            host[name].append((time.perf_counter() - t0) * 1e3)
            end.record()
            gpu[name].append((start, end))
    torch.cuda.synchronize()
    gpu_ms = {k: [s.elapsed_time(e) for s, e in v] for k, v in gpu.items()}
    return gpu_ms, host, all(t < 0.8 * ahead_ms for v in host.values() for t in v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", default="1,4,7,0,3,6,2", help="indices into bench_fp8.py's ten rows (0-9)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    sizes = {**SIZES, 32768: (1, 32768)}
    flusher = timing.L2Flusher(device)
    out = []
    for i in args.rows.split(","):
        cname, tokens = ROWS[int(i)]
        b, s = sizes[tokens]
        row = Row(CONFIGS[cname], b, s, device, dtype)
        w = row.w.detach()  # frozen: no dW
        fp8.forget_frozen_weight_casts()
        fns = {"bf16": frozen_call(row, w, None, False), "fp8": frozen_call(row, w, "rowwise", False),
               "fp8_cached": frozen_call(row, w, "rowwise", True), "fp8_floor": row.fp8_floor(dw=False)}
        # the cached calls equal the uncached ones bitwise (the same casts)
        same = all(torch.equal(a, c) for a, c in zip(fns["fp8"](), fns["fp8_cached"]()))
        times, host, ahead = gpu_only_interleaved(fns, args.reps, flusher)
        med = {k: statistics.median(v) for k, v in times.items()}
        host_med = {k: statistics.median(v) for k, v in host.items()}
        r = dict(config=cname, tokens=tokens, ms=med, host_ms=host_med, gpu_ahead_of_host=ahead, same=same,
                 cached_over_fp8=med["fp8_cached"] / med["fp8"],
                 fp8_over_bf16=med["fp8"] / med["bf16"], cached_over_bf16=med["fp8_cached"] / med["bf16"],
                 cached_over_floor=med["fp8_cached"] / med["fp8_floor"])
        out.append(r)
        print(f"{cname} {tokens}: GPU " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + " ms; host "
              + ", ".join(f"{k} {v:.3f}" for k, v in host_med.items()) + f" ms; GPU ahead of host: {ahead}", flush=True)
        fp8.forget_frozen_weight_casts()
        del row, fns
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_fp8_frozen.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)
    print(f"{'config':<22} {'tokens':>6} {'bf16':>8} {'fp8':>8} {'cached':>8} {'floor':>8} {'cached/fp8':>10} "
          f"{'fp8/bf16':>8} {'cached/bf16':>11} {'host fp8':>9} {'host cached':>11} {'same':>5}")
    for r in out:
        m = r["ms"]
        print(f"{r['config']:<22} {r['tokens']:>6} {m['bf16']:8.3f} {m['fp8']:8.3f} {m['fp8_cached']:8.3f} "
              f"{m['fp8_floor']:8.3f} {r['cached_over_fp8']:10.3f} {r['fp8_over_bf16']:8.3f} "
              f"{r['cached_over_bf16']:11.3f} {r['host_ms']['fp8']:9.3f} {r['host_ms']['fp8_cached']:11.3f} "
              f"{str(r['same']):>5}")
    print("GPU columns: kernels only (each call behind a GPU sleep); host columns: the eager call's wall clock, ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
