"""The RoPE/QK-norm backward stage alone, for Nsight Compute: launch configurations x workloads.

Run under ncu, filtered to the stage kernel; each (workload, config) is launched
--reps times after one warm-up (compile) launch, in the order printed to stderr, so the
n-th profiled kernel maps to a printed line:

    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:rope_qk_norm_bwd_kernel --csv \
        python3 benchmarks/profile_stage.py --workloads 11,9,1,5,0 --configs T4_g16_w4_p3,T8_g16_w4_p2

A config is T<tokens per block>_g<heads per step>_w<warps>_p<head steps in flight>[_G<heads per group>]
(no _G: every head in one program); "default" is the launcher's choice.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from fusedqkv.bench import problem
from fusedqkv.ops import config
from fusedqkv.ops import rope_qk_norm as stage


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="11,9,1,5,0")
    ap.add_argument("--configs", default="default")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--variants", default="exact", help="exact (091), accurate (fp32, one rounding), nocs (exact, "
                    "no grad_cos/sin), nofin (exact, the finish left to a second kernel that is not launched): "
                    "to price each part of the stage")
    args = ap.parse_args()
    defn = problem.load_definition()
    dev = torch.device("cuda")
    orig_regs, orig_regs_g8 = stage.MAX_REGISTERS, getattr(stage, "MAX_REGISTERS_GROUPED_8", 0)
    for wi in (int(x) for x in args.workloads.split(",")):
        w = defn.workloads[wi]
        a = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        gq, gk, gv, _hs, cos, sin, W, wq, wk, xq, xk, rq, rk, _eps = a
        M = w.tokens
        dqkv = torch.empty(M, W.shape[0], device=dev, dtype=gq.dtype)
        scratch = torch.empty(M, W.shape[1], device=dev, dtype=gq.dtype)
        gc, gs = torch.empty_like(cos), torch.empty_like(sin)
        g1, g2 = torch.empty_like(wq), torch.empty_like(wk)
        for cfg, var in ((c, v) for c in args.configs.split(",") for v in args.variants.split(",")):
            cfg_t = None
            if cfg != "default":
                t, g, nw, pf, gsz = re.fullmatch(r"T(\d+)_g(\d+)_w(\d+)_p(\d+)(?:_G(\d+))?", cfg).groups()
                cfg_t = (int(t), int(g), int(nw), int(pf), int(gsz or 0))
            regs = [int(t[1:]) for t in var.split("+") if t[:1] == "r" and t[1:].isdigit()]
            stage.MAX_REGISTERS = regs[0] if regs else orig_regs
            stage.MAX_REGISTERS_GROUPED_8 = regs[0] if regs else orig_regs_g8
            settings = dict(stage_tile=cfg_t, fused_finish="nofin" not in var, stage_tma="notma" not in var)
            for rep in range(args.reps + 1):
                cs = (None, None) if "nocs" in var else (gc, gs)
                with config.override(**settings):
                    stage.rope_qk_norm_backward(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv=dqkv,
                                                grad_cos=cs[0], grad_sin=cs[1], grad_q_norm_weight=g1,
                                                grad_k_norm_weight=g2, exact="accurate" not in var,
                                                scratch=scratch)
                if rep:
                    print(f"launch {w.name} M={M} {cfg} {var} rep{rep}", file=sys.stderr, flush=True)
                else:
                    print(f"warmup {w.name} M={M} {cfg} {var}", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
    stage.MAX_REGISTERS, stage.MAX_REGISTERS_GROUPED_8 = orig_regs, orig_regs_g8
    return 0


if __name__ == "__main__":
    sys.exit(main())
