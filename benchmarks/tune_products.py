"""The two products at few tokens: cuBLAS vs Triton dW (+ cuBLAS dX) vs Triton dW and dX, and
tile configurations, on the whole op (kernel span, the official timer) with the official
correctness check, next to the GEMM floor.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=... python3 benchmarks/tune_products.py --out $OUT [--workloads 11,15]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import harness, problem, timing
from fusedqkv.ops import projection as P

BIG = 1 << 30
# name: (DW_MAX_TOKENS, DX_MAX_TOKENS, dW tile (BJ, BN, BK, warps, stages) or None, dX tile or None)
MODES = {
    "cublas": (0, 0, None, None),
    "tdw": (BIG, 0, None, None),
    "tdw_256": (BIG, 0, (128, 256, 64, 8, 3), None),
    "tdw_64": (BIG, 0, (64, 128, 64, 4, 3), None),
    "tdw_s4": (BIG, 0, (128, 128, 64, 8, 4), None),
    "tdw_tdx": (BIG, BIG, None, None),
    "tdw_tdx_128": (BIG, BIG, None, (128, 128, 64, 8, 3)),
    "tdw_tdx_bk128": (BIG, BIG, None, (64, 128, 128, 4, 3)),
}


def set_mode(m):
    dwmax, dxmax, dwt, dxt = MODES[m]
    P.DW_MAX_TOKENS, P.DX_MAX_TOKENS = dwmax, dxmax
    P.DW_BJ, P.DW_BN, P.DW_BK, P.DW_WARPS, P.DW_STAGES = dwt or (128, 128, 64, 8, 3)
    P.DX_BM, P.DX_BN, P.DX_BK, P.DX_WARPS, P.DX_STAGES = dxt or (64, 128, 64, 4, 4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_products_out")
    ap.add_argument("--workloads", default="11,2,8,9,15,13,3,1")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    defn = problem.load_definition()
    ref = problem.load_official_reference()
    dev = torch.device("cuda")
    flusher = timing.L2Flusher(dev)
    names = list(defn.outputs)
    modes = args.modes.split(",")
    rows = []
    for wi in (int(x) for x in args.workloads.split(",")):
        w = defn.workloads[wi]
        a = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        ref_out = ref(*a)
        floor = harness.IMPLEMENTATIONS["gemm_floor"].prepare(None, a, ref_out)
        row = {"workload": w.name, "tokens": w.tokens,
               "floor": timing.summarize(timing.time_kernel_span(floor, reps=args.reps, flusher=flusher))["median"]}
        for m in modes:
            set_mode(m)
            out = tuple(torch.empty_like(t) for t in ref_out)
            try:
                got = gqa_qkv_rope_qk_norm_backward(*a, out=out)
                checks = problem.check_outputs(names, got, ref_out, w)
                again = gqa_qkv_rope_qk_norm_backward(*a)
                t = timing.summarize(timing.time_kernel_span(lambda: gqa_qkv_rope_qk_norm_backward(*a, out=out),
                                                             reps=args.reps, flusher=flusher))["median"]
                row[m] = {"ms": t, "pass": all(c.passed for c in checks),
                          "min_matched": min(c.matched_ratio for c in checks),
                          "det": all(torch.equal(x, y) for x, y in zip(got, again))}
            except Exception as e:  # a config that does not compile must not end the sweep
                row[m] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        set_mode("cublas")
        rows.append(row)
        print(f"{w.name} done", flush=True)
    with open(os.path.join(args.out, "tune_products.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} | kernel span, median ms | ratio to the GEMM floor | P pass, D det")
    print(f"{'workload':<14s} {'M':>5s} {'floor':>7s} " + " ".join(f"{m:>15s}" for m in modes))
    for r in rows:
        cells = []
        for m in modes:
            c = r[m]
            cells.append(f"{'ERR':>15s}" if "error" in c else
                         f"{c['ms']:.4f} {c['ms'] / r['floor']:.2f}{'P' if c['pass'] else 'F'}{'D' if c['det'] else 'N'}".rjust(15))
        print(f"{r['workload']:<14s} {r['tokens']:5d} {r['floor']:7.4f} " + " ".join(cells))
    for r in rows:
        for m in modes:
            if "error" in r[m]:
                print(r["workload"], m, r[m]["error"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
