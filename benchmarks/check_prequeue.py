"""GPU check of the prequeued launch order (GEMMs queued first behind a device-side wait).
Run with a timeout; on a hang, faulthandler prints where the host is blocked.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=.shared timeout 90 python3 benchmarks/check_prequeue.py
"""

import faulthandler
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem, timing
from fusedqkv.ops import prequeue


def main() -> int:
    faulthandler.dump_traceback_later(40, exit=True)
    defn = problem.load_definition()
    ref = problem.load_official_reference()
    names = list(defn.outputs)
    ok = True
    for wn in sys.argv[1:] or ["w11_b1_s128", "w09_b4_s128", "w01_b16_s128"]:
        w = defn.workload(wn)
        a = list(problem.generate_inputs(defn, w, device="cuda", seed=w.index).values())
        r = ref(*a)
        prequeue.ENABLED = False
        gqa_qkv_rope_qk_norm_backward(*a)  # warm: compile, cuBLAS handles, workspaces
        torch.cuda.synchronize()
        print(wn, "warm done; prequeue available:", prequeue.available(torch.device("cuda")), flush=True)
        prequeue.ENABLED = True
        got = gqa_qkv_rope_qk_norm_backward(*a)
        torch.cuda.synchronize()
        print(wn, "prequeued call returned", flush=True)
        checks = problem.check_outputs(names, got, r, w)
        again = gqa_qkv_rope_qk_norm_backward(*a)
        det = all(torch.equal(x, y) for x, y in zip(got, again))
        tp = timing.summarize(timing.time_kernel_span(lambda: gqa_qkv_rope_qk_norm_backward(*a), reps=20))["median"]
        prequeue.ENABLED = False
        ti = timing.summarize(timing.time_kernel_span(lambda: gqa_qkv_rope_qk_norm_backward(*a), reps=20))["median"]
        passed = all(c.passed for c in checks)
        ok &= passed and det
        print(wn, "pass" if passed else "FAIL", [round(c.matched_ratio, 5) for c in checks], "det" if det else "NONDET",
              f"prequeue {tp:.4f} ms  in-order {ti:.4f} ms", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
