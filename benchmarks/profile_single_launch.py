"""Nsight Compute view of the single-launch backward: each phase alone and both, under
several tile configurations (module globals of fusedqkv.ops.single_launch).

    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gqa_bwd_single_launch --csv \\
        python3 benchmarks/profile_single_launch.py --workloads 11,9 --configs base,s4,bkw128
"""

import argparse
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem
from fusedqkv.ops import single_launch as SL

CONFIGS = {
    "base": {},
    "s2": {"STAGES": 2},
    "s4": {"STAGES": 4},
    "bkw128": {"BKW": 128, "STAGES": 2},
    "bn64": {"BN": 64},
    "bk128": {"BK": 128, "BKW": 128, "STAGES": 2},
    "w4": {"NUM_WARPS": 4, "BLOCK_T": 4, "BM": 64, "BJ": 64},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="11,9")
    ap.add_argument("--configs", default="base")
    args = ap.parse_args()
    defn = problem.load_definition()
    SL.MAX_TOKENS = 1 << 30
    base = {k: getattr(SL, k) for k in ("STAGES", "BKW", "BK", "BN", "BM", "BJ", "NUM_WARPS", "BLOCK_T")}
    for wi in (int(x) for x in args.workloads.split(",")):
        w = defn.workloads[wi]
        a = list(problem.generate_inputs(defn, w, device="cuda", seed=w.index).values())
        for cfg in args.configs.split(","):
            for k, v in {**base, **CONFIGS[cfg]}.items():
                setattr(SL, k, v)
            for split in (True, False):
                SL.SPLIT_PHASES = split
                for rep in range(2):
                    gqa_qkv_rope_qk_norm_backward(*a)
                    torch.cuda.synchronize()
                    tag = "phase1 phase2" if split else "single"
                    print(f"{'launch' if rep else 'warmup'} {w.name} M={w.tokens} {cfg} {tag}", file=sys.stderr,
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
