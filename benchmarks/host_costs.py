"""Host time of the launches in one 091 backward call, GPU kept busy (so no launch waits):
what the host spends between the stage's launch and the GEMMs' (the official timer pays it
as idle GPU time at a few hundred tokens).

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=... python3 benchmarks/host_costs.py [--workloads 11,15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem
from fusedqkv.ops import rope_qk_norm as stage


def host_us(fn, n=200, reps=5):
    """Median over reps of the mean host time of n calls, behind a long GPU sleep."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 1e-3 * n * 0.2))  # ~0.2 ms of GPU sleep per call: the queue never drains
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="11,15")
    ap.add_argument("--cprofile", action="store_true", help="also the Python profile of 200 whole calls")
    args = ap.parse_args()
    defn = problem.load_definition()
    dev = torch.device("cuda")
    for wi in (int(x) for x in args.workloads.split(",")):
        w = defn.workloads[wi]
        a = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, eps = a
        M = w.tokens
        out = tuple(torch.empty_like(t) for t in gqa_qkv_rope_qk_norm_backward(*a))
        dq = torch.empty(M, W.shape[0], device=dev, dtype=gq.dtype)
        x = hs.reshape(M, -1)
        dx = out[0].view(M, -1)
        gc, gs = torch.empty_like(cos), torch.empty_like(sin)
        g1, g2 = torch.empty_like(wq), torch.empty_like(wk)
        Wt = W.t()
        dqt = dq.t()
        cases = {
            "full call (out=)": lambda: gqa_qkv_rope_qk_norm_backward(*a, out=out),
            "validate": lambda: __import__("fusedqkv.ops.gqa_backward", fromlist=["x"]).validate_backward_inputs(a),
            "stage launch": lambda: stage.rope_qk_norm_backward(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv=dq,
                                                                grad_cos=gc, grad_sin=gs, grad_q_norm_weight=g1,
                                                                grad_k_norm_weight=g2, exact=True, scratch=dx),
            "mm(dqkv, W, out=)": lambda: torch.mm(dq, W, out=dx),
            "mm(dqkv^T, X, out=)": lambda: torch.mm(dqt, x, out=out[3]),
            "mm(dqkv, W)": lambda: torch.mm(dq, W),
            "F.linear(dqkv, W^T)": lambda: F.linear(dq, Wt),
            "addmm(out=, beta=0)": lambda: torch.addmm(dx, dq, W, beta=0, out=dx),
            "aten.mm.out": lambda: torch.ops.aten.mm.out(dq, W, out=dx),
            "torch.empty": lambda: torch.empty(M, W.shape[0], device=dev, dtype=gq.dtype),
        }
        print(f"\n{w.name} M={M}: host us per call (GPU busy)")
        for k, fn in cases.items():
            fn()
            print(f"  {k:<24s} {host_us(fn):8.1f}", flush=True)
        if args.cprofile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                gqa_qkv_rope_qk_norm_backward(*a, out=out)
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main())
