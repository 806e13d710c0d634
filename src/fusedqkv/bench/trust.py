"""When a bench row cannot be trusted: the flags and their thresholds (the ranking: ``records.rank``).

SOL-ExecBench's score ``S = 1/(1 + (T - T_sol)/(T_b - T_sol))`` lies in [0, 1] only while
``T_sol <= T`` and ``T_sol < T_b``. A row (one implementation on one workload) is flagged,
never clipped, when:

* ``below_sol`` -- its time T is below the SOL bound T_sol (S > 1): the bound or the timing is wrong;
* ``bound_not_below_baseline`` -- T_sol >= T_b: S is undefined or outside [0, 1] for every
  implementation of the workload;
* ``bound_unsteady`` -- the ceilings behind T_sol were measured (every CPU run; a GPU run with
  ``--measure-ceilings``) and the measurement that set them was noisy (spread over
  ``NOISE_SPREAD``) or, on a CPU, waited for the processor (host wait over ``HOST_WAIT``);
* ``noisy`` / ``baseline_noisy`` (CPU runs) -- the spread of its own / the baseline's
  repetitions, ``(p80 - p20) / median``, is over ``NOISE_SPREAD``;
* ``host_busy`` / ``baseline_host_busy`` (CPU runs) -- while it (or the baseline) was timed, one
  of this process's threads waited for a CPU more than ``HOST_WAIT`` of the wall time (run-queue
  delay, ``/proc/self/task/*/schedstat``; ``timing.HostWait``): other processes took cores the
  timed code wanted, so a wall clock measured them as well.

A bound row (the two-GEMM floor: a timing, not a score) is flagged ``floor_unsteady`` when it
timed slower than the kernel it bounds: the floor is part of the kernel's work, so on a steady
device it cannot be slower; its timing was not steady and fused/floor there is no bound.

Why these thresholds, and why the timing flags are CPU-only: a process alone on its cores
waits for a CPU close to never, while the thread that shares a core with another process's busy
loop waits about half the time -- 0.10 sits well between. A spread of half the median
between p20 and p80 is far beyond the repeatability of undisturbed calls; only a disturbed run
reaches it. A GPU run times by device clocks (kernel span, CUDA events): host load does not slow
the device, and the H200 box's host jitter at 128-586 tokens gives kernel-span spreads up to
~0.6 of the median on quiet runs of unchanged code (``benchmarks/results``), so on a GPU the
spread is recorded, not flagged; its datasheet bound is below every time measured there, so a
quiet GPU run raises no flag.

Every flag is a property of the row's own numbers, so "S in [0, 1] or flagged" holds by
construction (``check_invariant``). A run is flagged when any of its rows is; ``fusedqkv
runs`` ranks flagged runs after every unflagged one.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

NOISE_SPREAD = 0.5  # (p80 - p20) / median of the repetitions
HOST_WAIT = 0.10  # the most-waiting thread's run-queue wait / wall time of the timed calls (CPU runs)

FLAGS = {
    "below_sol": "time below the SOL bound (S > 1)",
    "bound_not_below_baseline": "SOL bound not below the baseline's time (S undefined or outside [0, 1])",
    "bound_unsteady": "the measured ceilings behind the SOL bound were noisy or taken on a busy host",
    "noisy": f"spread of the repetitions (p80 - p20) / median > {NOISE_SPREAD}",
    "baseline_noisy": f"the baseline's spread (p80 - p20) / median > {NOISE_SPREAD}",
    "host_busy": f"host busy while timed: a thread waited for a CPU > {HOST_WAIT:.0%} of the wall time",
    "baseline_host_busy": f"host busy while the baseline was timed (run-queue wait > {HOST_WAIT:.0%})",
    "floor_unsteady": "the two-GEMM floor (a bound) timed slower than the kernel it bounds: its timing is "
                      "unsteady, and fused/floor there is no bound",
}


def rules(cpu: bool) -> dict:
    """The flag rules in force, for records and reports."""
    return {"noiseSpread": NOISE_SPREAD, "hostWait": HOST_WAIT if cpu else None,
            "timingFlags": "CPU runs" if cpu else "none (GPU device clocks: spread recorded, not flagged)",
            "flags": dict(FLAGS)}


def spread(t: Optional[dict]) -> Optional[float]:
    """(p80 - p20) / median of a timer summary (``timing.summarize``), None when not available."""
    if not t or t.get("n", 0) < 2 or not t.get("median"):
        return None
    return (t["p80"] - t["p20"]) / t["median"]


def timing_flags(t: Optional[dict], cpu: bool) -> list:
    """Flags of one timer summary: only on a CPU run (wall clock)."""
    if not cpu or not t:
        return []
    out = []
    s = spread(t)
    if s is not None and s > NOISE_SPREAD:
        out.append("noisy")
    w = t.get("host_wait")
    if w is not None and w > HOST_WAIT:
        out.append("host_busy")
    return out


def bound_flags(ceilings: dict, cpu: bool) -> list:
    """``bound_unsteady`` when measured ceilings came from a noisy or (CPU) contended measurement:
    the matmul behind the FLOP/s, the copy behind the bytes/s."""
    d = ceilings.get("detail") if ceilings.get("source") == "measured" else None
    if not d:
        return []
    chosen = d.get("chosen") or {"flops": d, "bytes": d}
    for quantity, key in (("flops", "matmul_ms"), ("bytes", "copy_ms")):
        m = chosen.get(quantity) or {}
        s = spread(m.get(key))
        if (s is not None and s > NOISE_SPREAD) or (cpu and (m.get("host_wait") or 0.0) > HOST_WAIT):
            return ["bound_unsteady"]
    return []


def floor_flags(floor_ms: Optional[float], kernel_ms: Optional[float]) -> list:
    """``floor_unsteady`` when a bound's time is above the time of the kernel it bounds."""
    if floor_ms is not None and kernel_ms is not None and floor_ms > kernel_ms:
        return ["floor_unsteady"]
    return []


def score_flags(t: Optional[float], t_sol: Optional[float], t_base: Optional[float]) -> list:
    """The flags that keep S in [0, 1]: T below T_sol, or T_sol not below T_b."""
    out = []
    if t_sol is not None and t_base is not None and t_base <= t_sol:
        out.append("bound_not_below_baseline")
    if t is not None and t_sol is not None and t < t_sol:
        out.append("below_sol")
    return out


def row_flags(t, t_sol, t_base, own_timing: Optional[dict], baseline_timing: Optional[dict], cpu: bool,
              run_flags: Iterable[str] = (), is_baseline: bool = False) -> list:
    """All flags of one implementation on one workload, in a fixed order."""
    out = score_flags(t, t_sol, t_base) + list(run_flags) + timing_flags(own_timing, cpu)
    if not is_baseline:
        out += ["baseline_" + f for f in timing_flags(baseline_timing, cpu)]
    return [f for f in FLAGS if f in out]


def in_range(s: Optional[float]) -> bool:
    return s is None or (math.isfinite(s) and 0.0 <= s <= 1.0)


def check_invariant(score: Optional[float], flags: list) -> bool:
    """A score outside [0, 1] is always flagged."""
    return in_range(score) or bool(flags)


def summarize_flags(per_row: list) -> dict:
    """Run level: per flag the number of workloads it is raised on; flagged workloads; flagged."""
    counts: dict = {}
    for fl in per_row:
        for f in fl:
            counts[f] = counts.get(f, 0) + 1
    n = sum(1 for fl in per_row if fl)
    return {"flagged": n > 0, "flaggedWorkloads": n, "workloads": len(per_row),
            "flags": {f: counts[f] for f in FLAGS if f in counts}}


def describe(summary: dict) -> str:
    """``3/4 workloads: host_busy 3, below_sol 1`` (or ``no flags``)."""
    if not summary or not summary.get("flagged"):
        return "no flags"
    parts = ", ".join(f"{k} {v}" for k, v in summary["flags"].items())
    return f"{summary['flaggedWorkloads']}/{summary['workloads']} workloads: {parts}"
