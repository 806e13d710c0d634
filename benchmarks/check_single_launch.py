"""Quick GPU check of the single-launch backward on a few 091 workloads (run with a timeout:
a broken grid barrier hangs). Prints pass/fail per workload and the kernel span vs three launches.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=.shared timeout 120 python3 benchmarks/check_single_launch.py
"""

import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem, timing
from fusedqkv.ops import single_launch


def main() -> int:
    defn = problem.load_definition()
    ref = problem.load_official_reference()
    names = list(defn.outputs)
    ok = True
    for wn in sys.argv[1:] or ["w11_b1_s128", "w13_b2_s293", "w09_b4_s128"]:
        w = defn.workload(wn)
        a = list(problem.generate_inputs(defn, w, device="cuda", seed=w.index).values())
        r = ref(*a)
        single_launch.MAX_TOKENS = 1 << 30
        got = gqa_qkv_rope_qk_norm_backward(*a)
        torch.cuda.synchronize()
        checks = problem.check_outputs(names, got, r, w)
        again = gqa_qkv_rope_qk_norm_backward(*a)
        det = all(torch.equal(x, y) for x, y in zip(got, again))
        t1 = timing.summarize(timing.time_kernel_span(lambda: gqa_qkv_rope_qk_norm_backward(*a), reps=20))["median"]
        single_launch.MAX_TOKENS = 0
        t3 = timing.summarize(timing.time_kernel_span(lambda: gqa_qkv_rope_qk_norm_backward(*a), reps=20))["median"]
        passed = all(c.passed for c in checks)
        ok &= passed and det
        print(wn, "pass" if passed else "FAIL", [round(c.matched_ratio, 5) for c in checks], "det" if det else "NONDET",
              f"single {t1:.4f} ms  three {t3:.4f} ms", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
