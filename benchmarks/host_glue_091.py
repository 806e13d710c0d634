"""The Python of the 091 run path alone, on the CPU (no GPU needed): a plan built under the
Triton interpreter, then its launches and cuBLASLt products replaced by no-ops and its address
gather made, so a call runs the bound path minus the launches and the products. What it prints is
the run path's own host cost on this CPU (guards, addresses, outputs, stream, checks).

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/host_glue_091.py [--cprofile]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.ops import backward_091  # noqa: E402
from _oracle import make_inputs  # noqa: E402


def main() -> int:
    args = make_inputs(1, 32, 8, 64, 128, hidden=256, seed=1)
    call = fusedqkv.gqa_qkv_rope_qk_norm_backward
    out = tuple(torch.empty_like(t) for t in call(*args, backend="triton"))
    allocating = backward_091.PLANS.last()
    call(*args, out=out, backend="triton")
    with_out = backward_091.PLANS.last()
    noop = lambda *a: None  # noqa: E731
    for plan in (with_out, allocating):
        for launch in plan.launches + ([plan.finish] if plan.finish is not None else []):
            launch._raw = noop  # "bound": later calls pass addresses
        plan.lt_dx = plan.lt_dx or (noop if plan.mm_dx else None)
        plan.lt_dw = plan.lt_dw or (noop if plan.mm_dw else None)
    call(*args, out=out, backend="triton")  # each plan makes its gather
    call(*args, backend="triton")
    rows = {}
    for name, fn in (("out=", lambda: call(*args, out=out, backend="triton")),
                     ("allocating", lambda: call(*args, backend="triton"))):
        for _ in range(300):
            fn()
        t = []
        for _ in range(15):
            t0 = time.perf_counter_ns()
            for _ in range(500):
                fn()
            t.append((time.perf_counter_ns() - t0) / 500 / 1e3)
        rows[name] = statistics.median(t)
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5000):
            call(*args, out=out, backend="triton")
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    print(f"091 run path's Python on this CPU (path {with_out.path}, launches and products no-ops), us per call")
    for name, us in rows.items():
        print(f"  {name:<12s} {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
