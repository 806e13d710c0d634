"""Cold-L2 timing, two ways, as the official harness measures.

* ``time_cuda_events``: CUDA events around each call, L2 flushed before each one.
* ``time_kernel_span``: from the profiler's device activity, the span from the first
  kernel start to the last kernel end of each call (idle gaps between launches are
  paid, the host time before the first launch is not), L2 flushed before each one.
* ``time_cpu``: wall clock for CPU runs (no cache flush; labelled as a CPU run).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

FLUSH_KERNEL_NAME = "l2_flush_kernel"


class L2Flusher:
    """Overwrites a buffer of twice the device's L2 size."""

    BLOCK = 4096

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or 50 * 1024 * 1024
        self.buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        from ..kernels.l2_flush import l2_flush_kernel

        n = self.buf.numel()
        l2_flush_kernel[(triton_cdiv(n, self.BLOCK),)](self.buf, n, BLOCK=self.BLOCK, num_warps=4)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def summarize(samples_ms) -> dict:
    xs = sorted(float(x) for x in samples_ms)
    if not xs:
        return {"n": 0}
    q = lambda p: xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]  # noqa: E731
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0],
            "max": xs[-1], "p20": q(0.2), "p80": q(0.8)}


def _warm_up(fn, warmup: int, flusher: L2Flusher | None) -> L2Flusher:
    """Warm-up calls, each after a flush, as timed calls will be; returns the flusher."""
    flusher = flusher or L2Flusher(torch.cuda.current_device())
    for _ in range(warmup):
        flusher()
        fn()
    torch.cuda.synchronize()
    return flusher


def time_cuda_events(fn: Callable[[], object], reps: int = 50, warmup: int = 5, flusher: L2Flusher | None = None) -> list:
    flusher = _warm_up(fn, warmup, flusher)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flusher()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def kernel_calls_from_events(events, skip: tuple = ()) -> list:
    """Group device activities into calls split at each flush: per call, its (name, start_us,
    end_us) in start order. ``events`` in any order; activities whose name contains one of
    ``skip`` are dropped."""
    calls, cur = [], None
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if FLUSH_KERNEL_NAME in name:
            if cur:
                calls.append(cur)
            cur = []
            continue
        if cur is None or any(k in name for k in skip):
            continue  # activity before the first flush (warm-up tail), or skipped
        cur.append((name, start, end))
    if cur:
        calls.append(cur)
    return calls


def _span_ms(call) -> float:
    """First kernel start to last kernel end of one call, in ms."""
    return (max(e for _, _, e in call) - min(s for _, s, _ in call)) / 1000.0


def profile_kernel_calls(fn: Callable[[], object], reps: int = 50, warmup: int = 5, flusher: L2Flusher | None = None,
                         before: Callable[[], object] | None = None, skip: tuple = ()) -> list:
    """The device kernels of each of ``reps`` calls, L2 flushed before each one (and ``before``
    queued after the flush, e.g. a GPU sleep whose kernel ``skip`` then drops)."""
    from torch.profiler import ProfilerActivity, profile

    flusher = _warm_up(fn, warmup, flusher)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flusher()
            if before is not None:
                before()
            fn()
        flusher()  # closes the last call
        torch.cuda.synchronize()
    evs = []
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            evs.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return kernel_calls_from_events(evs, skip)


def time_kernel_span(fn: Callable[[], object], reps: int = 50, warmup: int = 5, flusher: L2Flusher | None = None) -> list:
    return [_span_ms(c) for c in profile_kernel_calls(fn, reps, warmup, flusher)]


def time_cpu(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> list:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out
