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


def kernel_spans_from_events(events) -> list:
    """Group device activities into calls split at each flush kernel; span of each call in ms.

    ``events`` are (name, start_us, end_us) for device activities, in any order.
    """
    spans, cur = [], None
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if FLUSH_KERNEL_NAME in name:
            if cur is not None:
                spans.append(cur)
            cur = [None, None]
            continue
        if cur is None:
            continue  # activity before the first flush (warm-up tail)
        cur[0] = start if cur[0] is None else min(cur[0], start)
        cur[1] = end if cur[1] is None else max(cur[1], end)
    if cur is not None:
        spans.append(cur)
    return [(e - s) / 1000.0 for s, e in spans if s is not None]


def time_kernel_span(fn: Callable[[], object], reps: int = 50, warmup: int = 5, flusher: L2Flusher | None = None) -> list:
    from torch.profiler import ProfilerActivity, profile

    flusher = _warm_up(fn, warmup, flusher)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flusher()
            fn()
        flusher()  # closes the last call
        torch.cuda.synchronize()
    evs = []
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            evs.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return kernel_spans_from_events(evs)


def time_cpu(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> list:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out
