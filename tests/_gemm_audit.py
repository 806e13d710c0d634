"""The suite's CPU GEMM work, counted at dispatch: FLOPs by dtype and operand layout.

Why: torch's CPU bf16/fp16 GEMM has no fast kernel without AVX-512 BF16 or AMX. Measured on a
2-core AVX2-only EPYC (torch 2.13, 2 threads; benchmarks/NOTES.md, session 16): the NN layout
(``a @ w``, both operands row-major) ran at ~0.28 GFLOP/s, and ~0.1 GFLOP/s under load; TN
(``a.t() @ x``) at ~3.3; NT (``x @ w.t()``, ``F.linear``'s forward) at ~19; fp32 at ~50. So
the suite's time on such a host follows its half-precision GEMM FLOPs, which this counts on
any host.

* :class:`GemmCounter` -- a dispatch mode that tallies every CPU ``mm``/``addmm``/``bmm``/
  ``baddbmm`` (what ``matmul``, ``linear`` and ``@`` decompose to) as ``(dtype, layout) -> FLOPs``;
  ``forbid_half=True`` raises on the first half-precision one instead (the structural test of
  the CPU path).
* :data:`ORACLE` -- the tally of the official reference's calls over the session (conftest
  counts them), checked against :data:`ORACLE_NN_BUDGET`.

``FUSEDQKV_GEMM_AUDIT=FILE python -m pytest`` tallies every test (a measurement, not a test run:
torch.compile refuses a dispatch mode, so the compile tests fail under it). GEMMs in module-scoped
fixtures and in subprocesses are not in the per-test table; the oracle's tally has them all.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)

# the slowest measured rate of a half-precision NN GEMM on an AVX2-only host (under load)
SLOW_NN_FLOPS = 0.1e9
# the official reference's half-precision NN FLOPs over the whole suite: 10 GFLOP, 100 s at
# SLOW_NN_FLOPS (under 2 minutes; its TN GEMMs, as many FLOPs at ~3.3 GFLOP/s, add ~3 s)
ORACLE_NN_BUDGET = 10.0e9
# the measured rates (FLOP/s) of each layout on that host, for the predicted seconds
SLOW_RATES = {"NN": 0.1e9, "TN": 3.3e9, "NT": 19e9, "TT": 3.3e9}


class HalfGemmError(AssertionError):
    """A half-precision GEMM reached torch on the CPU where none may."""


def layout(t: torch.Tensor) -> str:
    """N: row-major (unit stride on the last dim), T: column-major (a transposed view), S: neither."""
    if t.dim() < 2:
        return "N"
    rows, cols = t.shape[-2], t.shape[-1]
    s_row, s_col = t.stride(-2), t.stride(-1)
    if s_col == 1 or cols == 1:
        return "N" if s_row >= cols or rows == 1 else "S"
    if s_row == 1 or rows == 1:
        return "T"
    return "S"


def _mm_operands(func, args):
    if func in (aten.mm.default, aten.mm.out, aten.bmm.default, aten.bmm.out):
        return args[0], args[1]
    if func in (aten.addmm.default, aten.addmm.out, aten.baddbmm.default, aten.baddbmm.out,
                aten._addmm_activation.default):
        return args[1], args[2]
    return None


def gemm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class Tally:
    """FLOPs and calls by (dtype, layout); ``predicted_s``: the time at :data:`SLOW_RATES`."""

    def __init__(self):
        self.flops = collections.Counter()
        self.calls = collections.Counter()

    def add(self, key, flops: int) -> None:
        self.flops[key] += flops
        self.calls[key] += 1

    def add_rows(self, rows) -> None:
        """Add :meth:`rows` of another tally (a pytest-xdist worker's, sent to the controller)."""
        for dt, la, flops, calls in rows:
            key = (getattr(torch, dt), la)
            self.flops[key] += flops
            self.calls[key] += calls

    def merge(self, other: "Tally") -> None:
        self.flops.update(other.flops)
        self.calls.update(other.calls)

    def half(self, lay: str = None) -> int:
        return sum(f for (dt, la), f in self.flops.items() if dt in HALF and (lay is None or la == lay))

    def predicted_s(self) -> float:
        # a strided operand (S) or a batched one takes the slowest measured rate
        return sum(f / SLOW_RATES.get(la, SLOW_NN_FLOPS) for (dt, la), f in self.flops.items() if dt in HALF)

    def rows(self):
        return sorted(((str(dt).replace("torch.", ""), la, f, self.calls[(dt, la)])
                       for (dt, la), f in self.flops.items()), key=lambda r: -r[2])


class GemmCounter(TorchDispatchMode):
    """Counts the CPU GEMMs dispatched while active into ``self.tally``."""

    def __init__(self, forbid_half: bool = False, tally: Tally = None):
        super().__init__()
        self.forbid_half = forbid_half
        self.tally = tally if tally is not None else Tally()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops = _mm_operands(func, args)
        if ops is not None:
            a, b = ops
            if a.device.type == "cpu":
                key = (a.dtype, layout(a) + layout(b) if a.dim() == b.dim() else "S")
                if self.forbid_half and a.dtype in HALF:
                    raise HalfGemmError(f"{func}: a {a.dtype} GEMM {tuple(a.shape)} x {tuple(b.shape)} "
                                        f"(layout {key[1]}) reached torch on the CPU")
                self.tally.add(key, gemm_flops(a, b))
        return func(*args, **(kwargs or {}))


ORACLE = Tally()  # the official reference's calls over the session


def counted_oracle(run):
    """The official reference ``run``, its GEMMs tallied into :data:`ORACLE` (the code runs as-is)."""
    if getattr(run, "_gemm_counted", False):
        return run

    def oracle(*args, **kwargs):
        with GemmCounter(tally=ORACLE):
            return run(*args, **kwargs)

    oracle._gemm_counted = True
    oracle.__wrapped__ = run
    oracle.__name__ = getattr(run, "__name__", "run")
    oracle.__module__ = getattr(run, "__module__", __name__)
    return oracle


def check_oracle_budget(tally: Tally = ORACLE) -> str:
    """'' when the oracle's half-precision NN FLOPs are within the budget, else why not."""
    nn = tally.half("NN")
    if nn <= ORACLE_NN_BUDGET:
        return ""
    return (f"the official reference ran {nn / 1e9:.2f} GFLOP of half-precision NN GEMMs in this session, over "
            f"the budget of {ORACLE_NN_BUDGET / 1e9:.1f} GFLOP ({ORACLE_NN_BUDGET / SLOW_NN_FLOPS:.0f} s at "
            f"{SLOW_NN_FLOPS / 1e9:.1f} GFLOP/s, an AVX2-only CPU's rate): cache its outputs per case or shrink "
            f"the case (tests/_gemm_audit.py)")
