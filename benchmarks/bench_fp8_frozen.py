"""GPU benchmark of the FP8 block with a frozen weight (LoRA's base: no dW), eager, with and without
``config.fp8_frozen_weight_cache`` (W's two FP8 casts kept from call to call while W is unchanged; issue 35).

The cache is an eager feature: under CUDA-graph capture it is neither read nor filled (a replay cannot
consult a host cache), so these rows are eager calls timed by CUDA events, the L2 flushed before each, the
providers interleaved call by call in rotated order (``timing.time_cuda_events_interleaved``). Each call is
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
        times = timing.time_cuda_events_interleaved(fns, reps=args.reps, flusher=flusher)
        med = {k: statistics.median(v) for k, v in times.items()}
        r = dict(config=cname, tokens=tokens, ms=med, same=same, cached_over_fp8=med["fp8_cached"] / med["fp8"],
                 fp8_over_bf16=med["fp8"] / med["bf16"], cached_over_bf16=med["fp8_cached"] / med["bf16"],
                 cached_over_floor=med["fp8_cached"] / med["fp8_floor"])
        out.append(r)
        print(f"{cname} {tokens}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + " ms", flush=True)
        fp8.forget_frozen_weight_casts()
        del row, fns
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_fp8_frozen.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)
    print(f"{'config':<22} {'tokens':>6} {'bf16':>8} {'fp8':>8} {'cached':>8} {'floor':>8} {'cached/fp8':>10} "
          f"{'fp8/bf16':>8} {'cached/bf16':>11} {'same':>5}")
    for r in out:
        m = r["ms"]
        print(f"{r['config']:<22} {r['tokens']:>6} {m['bf16']:8.3f} {m['fp8']:8.3f} {m['fp8_cached']:8.3f} "
              f"{m['fp8_floor']:8.3f} {r['cached_over_fp8']:10.3f} {r['fp8_over_bf16']:8.3f} "
              f"{r['cached_over_bf16']:11.3f} {str(r['same']):>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
