"""Cold-L2 timing, as NVIDIA's SOL-ExecBench evaluator measures, and the older helpers.

The evaluator (``sol_execbench.core.bench.timing``) times a call by CUPTI: per iteration,
fresh argument addresses (its shifting memory pool), an L2 flush (zeroing a buffer of twice
the L2 size), the call between two host timestamps, then a device synchronize; the
iteration's time is the span from the first start to the last end of the device
activities (kernels, memcpys, memsets) whose launches fall inside the host window; median
over the iterations. Here:

* ``ShiftedArgs``: the arguments at a fresh address every call (our own code, the same
  idea: a pool per tensor, each call 256 bytes further on, strides kept, outputs zeroed).
* ``time_call_span``: that span, per iteration, by CUPTI through ``cupti-python`` when it
  can be imported (launch-window attribution, as the evaluator), else by the torch
  profiler's device activities (grouped at the flush kernel; the argument copies run on a
  side stream so that they are not counted). Same iteration structure either way.
* ``time_call_events``: CUDA events around each call, the same setup and flush, no sync
  between iterations (the evaluator's ``cuda_events`` method) -- the second clock.
* ``time_cuda_events_interleaved``: CUDA events of several implementations taken call by
  call in turn, the order rotated (the card's clock follows its recent load; a block timed
  after another implementation's block inherits its clock).
* ``time_steady``: the other regime -- each implementation called back to back for seconds, no
  flush, the order rotated over rounds, while ``ClockSampler`` reads the SM clock and the board
  power. Under a steady GEMM load the H200 sits at its power limit (session 14: 690-693 W of
  700 W for cuBLAS and our kernels alike, SM clock 1.37-1.53 GHz), so a call's time follows its
  energy, which the flushed, interleaved timing (a lighter duty cycle) does not show.
* ``time_cuda_events`` / ``time_kernel_span`` / ``profile_kernel_calls``: the older
  fixed-argument helpers, kept for the scripts in ``benchmarks/``.
* ``time_cpu_budget``: wall clock for CPU runs (no cache flush; labelled as a CPU run):
  repetitions to a time budget, warm-up until the calls agree, and the host wait of the
  timed calls (``HostWait``: how long this process's threads waited for a CPU).

The L2 flush is ``l2_flush_kernel``: it writes the same 2x-L2 bytes at the same point of
the iteration as the evaluator's ``zero_()``, under a name the profiler path can find.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..ops.device import current_stream
from ..ops.launch import BoundLaunch, Ptr

FLUSH_KERNEL_NAME = "l2_flush_kernel"


class L2Flusher:
    """Overwrites a buffer of twice the device's L2 size."""

    BLOCK = 4096

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or 50 * 1024 * 1024
        self.buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
        # a bound launch (the compiled kernel's launcher, a few us of host) rather than the JIT
        # dispatch (~15-25 us on the lent host): a loop of small calls whose flush costs more
        # host time than the evaluator's zero_() would turn host-bound and time the host
        from ..kernels.l2_flush import l2_flush_kernel

        n = self.buf.numel()
        self._launch = BoundLaunch(l2_flush_kernel, (triton_cdiv(n, self.BLOCK),), [Ptr("buf", 0, self.buf), n],
                                   {"BLOCK": self.BLOCK, "num_warps": 4})
        self._ptrs = [self.buf.data_ptr()]

    def __call__(self) -> None:
        self._launch.launch([self.buf], self._ptrs, current_stream(self.buf.device))


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


def rotated_orders(names: Sequence[str], reps: int) -> list:
    """The call order of each repetition of an interleaved timing: repetition ``r`` starts at
    the ``r``-th name, so over ``len(names)`` repetitions every name follows every other one
    equally often."""
    names = list(names)
    n = len(names)
    return [names[r % n:] + names[:r % n] for r in range(reps)] if n else []


def time_cuda_events_interleaved(fns: dict, reps: int = 30, warmup: int = 3, flusher: L2Flusher | None = None,
                                 setup: Optional[dict] = None) -> dict:
    """CUDA-event times of several callables taken call by call in turn (the order rotated by
    :func:`rotated_orders`), the L2 flushed before each call and no sync between calls.

    Why: the H200's clock follows its recent load for tens of milliseconds, so a block of calls
    of one implementation timed right after another implementation's GEMM-heavy block runs
    10-15 % slower than after a light one; interleaving gives every implementation the same
    predecessors. ``setup[name]()`` (optional, per name) runs untimed before the flush and its
    result is passed to ``fns[name]`` (e.g. a fresh forward before a timed backward).
    Returns ``{name: [ms per call]}``."""
    setup = setup or {}
    names = list(fns)

    def prepare(name):
        return (setup[name](),) if name in setup else ()

    flusher = flusher or L2Flusher(torch.cuda.current_device())
    for name in names:
        for _ in range(warmup):
            a = prepare(name)
            flusher()
            fns[name](*a)
            del a
    torch.cuda.synchronize()
    # one untimed round: the first call after a sync starts on an idle GPU (the host's launch
    # latency would fall inside its events)
    for name in names:
        a = prepare(name)
        flusher()
        fns[name](*a)
        del a
    events = {name: [] for name in names}
    for order in rotated_orders(names, reps):
        for name in order:
            a = prepare(name)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flusher()
            start.record()
            fns[name](*a)
            end.record()
            del a
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) for s, e in evs] for name, evs in events.items()}


class ClockSampler:
    """The SM clock (MHz) and board power (W) of one GPU, sampled by ``nvidia-smi`` every ``ms`` in
    a child process. Without ``nvidia-smi`` it samples nothing (``available`` False)."""

    def __init__(self, index: int = 0, ms: int = 50):
        import shutil
        import subprocess

        self.proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self.proc = subprocess.Popen([exe, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", str(ms), "-i", self.smi_id(index)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)
        os.set_blocking(self.proc.stdout.fileno(), False)

    @property
    def available(self) -> bool:
        return self.proc is not None

    @staticmethod
    def smi_id(index: int) -> str:
        """nvidia-smi's name for torch's device ``index``: its entry of ``CUDA_VISIBLE_DEVICES`` (an
        index or a UUID, both of which ``nvidia-smi -i`` takes), else the index itself."""
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return visible[index] if index < len(visible) else str(index)

    @staticmethod
    def parse(lines) -> list:
        """[(MHz, W)] of ``nvidia-smi``'s csv lines; lines that are not two numbers are skipped."""
        out = []
        for line in lines:
            try:
                mhz, watts = (float(v) for v in line.strip().split(","))
            except ValueError:
                continue
            out.append((mhz, watts))
        return out

    def drain(self) -> list:
        """The samples read since the last drain."""
        if self.proc is None:
            return []
        return self.parse(iter(self.proc.stdout.readline, ""))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


def time_steady(fns: dict, seconds: float = 1.5, rounds: int = 3, sync: Optional[Callable] = None,
                sampler: Optional[ClockSampler] = None, skip_samples: int = 2) -> dict:
    """Each callable called back to back for ``seconds`` (no flush, no sync inside), one after the
    other in an order rotated over ``rounds``; wall clock between two syncs over the calls made.
    ``sampler``: its samples taken during a callable's stretch, less the first ``skip_samples``
    (they may predate the load), go to that callable. Returns ``{name: {"ms": [ms per call, per
    round], "mhz": [...], "watts": [...]}}``."""
    sync = sync or (lambda: None)
    out = {name: dict(ms=[], mhz=[], watts=[]) for name in fns}
    for order in rotated_orders(list(fns), rounds):
        for name in order:
            fn = fns[name]
            fn()
            sync()
            if sampler is not None:
                sampler.drain()
            calls, t0 = 0, time.perf_counter()
            end = t0 + seconds
            while True:
                for _ in range(8):
                    fn()
                calls += 8
                if time.perf_counter() >= end:
                    sync()  # the queued calls finish inside the measured stretch
                    break
            elapsed = time.perf_counter() - t0
            out[name]["ms"].append(1e3 * elapsed / calls)
            if sampler is not None:
                samples = sampler.drain()[skip_samples:]
                out[name]["mhz"] += [m for m, _ in samples]
                out[name]["watts"] += [w for _, w in samples]
    return out


def steady_medians(raw: dict) -> dict:
    """``{name: {ms, mhz, watts, samples}}``: medians of :func:`time_steady`'s rounds and clock samples
    (NaN where nothing was sampled)."""
    def med(v):
        return statistics.median(v) if v else float("nan")
    return {n: dict(ms=med(r["ms"]), mhz=med(r["mhz"]), watts=med(r["watts"]), samples=len(r["mhz"]))
            for n, r in raw.items()}


def kernel_calls_from_events(events, skip: tuple = ()) -> list:
    """Group device activities into calls split at each flush: per call, its (name, start_us,
    end_us) in start order. ``events`` in any order; activities whose name contains one of
    ``skip`` are dropped, and so are calls left empty."""
    acts = [DeviceActivity(n, a, e) for n, a, e in events if not any(k in n for k in skip)]
    return [[(a.name, a.start, a.end) for a in call] for call in group_at_flush(acts) if call]


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


# ----------------------------------------------------------------------------- CPU runs: budget and host wait


def _run_delay_ns() -> Optional[dict]:
    """Per thread of this process, the time it has spent runnable but waiting for a CPU (ns;
    the second field of ``/proc/self/task/<tid>/schedstat``); None where the kernel does not say."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out or None


class HostWait:
    """How long this process's threads waited for a CPU over a block: the largest run-queue wait
    of one thread as a fraction of the block's wall time. ~0 when every thread got a CPU whenever
    it wanted one; ~0.5 for the thread that shares a core with another process's busy loop. The
    largest, not the mean: threads meeting at a barrier (every parallel region) all wait for the
    slowest one, so one thread kept off its core slows the whole call. ``fraction`` is None off
    Linux (no ``/proc/self/task/*/schedstat``)."""

    def __init__(self):
        self.fraction: Optional[float] = None

    def __enter__(self) -> "HostWait":
        self._d0, self._t0 = _run_delay_ns(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        d1 = _run_delay_ns()
        if self._d0 is None or d1 is None or wall <= 0:
            return
        # a thread born inside the block counts all its wait; one that ended drops out
        waited = max((v - self._d0.get(tid, 0) for tid, v in d1.items()), default=0)
        self.fraction = max(0.0, waited / 1e9 / wall)


@dataclass
class CpuTimes:
    samples_ms: list
    warmup_calls: int
    warmup_stable: Optional[bool]  # None: a fixed warm-up was asked for
    host_wait: Optional[float]


# the adaptive CPU protocol: repetitions to a time budget, as timeit.autorange picks its loop count
CPU_MIN_REPS = 5
CPU_MAX_REPS = 1000
CPU_WARMUP_CAP_S = 2.0  # the first calls of a process can run 10x slow for ~2 s (allocator, thread pool)
CPU_STABLE_WITHIN = 0.25  # warm-up ends when 3 consecutive calls agree within 25 %


def _stable(ms: list) -> bool:
    last = ms[-3:]
    return len(last) == 3 and max(last) <= (1.0 + CPU_STABLE_WITHIN) * min(last)


def time_cpu_budget(fn: Callable[[], object], budget_s: float = 1.0, reps: Optional[int] = None,
                    warmup: Optional[int] = None, min_reps: int = CPU_MIN_REPS, max_reps: int = CPU_MAX_REPS,
                    warmup_cap_s: float = CPU_WARMUP_CAP_S) -> CpuTimes:
    """Wall clock of single calls on a CPU.

    Warm-up: ``warmup`` calls when given; else until three consecutive calls agree within
    ``CPU_STABLE_WITHIN`` (at least one call, at most ``warmup_cap_s``). Timed: ``reps`` calls when
    given; else calls until ``budget_s`` has passed and at least ``min_reps`` were made (at most
    ``max_reps``). The host wait (:class:`HostWait`) covers the timed calls."""
    if budget_s is None or not budget_s > 0:
        raise ValueError(f"budget_s: expected > 0, got {budget_s!r}")
    wms: list = []
    t_w = time.perf_counter()
    while True:
        if warmup is not None:
            if len(wms) >= warmup:
                break
        elif wms and (_stable(wms) or time.perf_counter() - t_w >= warmup_cap_s):
            break
        t0 = time.perf_counter()
        fn()
        wms.append((time.perf_counter() - t0) * 1000.0)
    out = []
    with HostWait() as hw:
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            out.append((t1 - t0) * 1000.0)
            n = len(out)
            if reps is not None:
                if n >= reps:
                    break
            elif n >= max_reps or (n >= min_reps and t1 - t_start >= budget_s):
                break
    return CpuTimes(out, len(wms), None if warmup is not None else _stable(wms), hw.fraction)


# ----------------------------------------------------------------------------- evaluator-style timing


SHIFT_BYTES = 256  # each call's arguments start this much further into their pool (keeps 256-byte alignment)


class TimingError(RuntimeError):
    """The span timer could not attribute device activity to the calls (or found it inconsistent)."""


class ShiftedArgs:
    """``inputs`` then ``outputs`` at a fresh address on every call, for ``calls`` calls.

    Per tensor one pool: the storage the tensor spans plus ``calls - 1`` shifts of
    SHIFT_BYTES. Call k copies the tensor's data to offset k (outputs: zero-fills it) and
    returns a view there with the tensor's shape and strides (stride-0 broadcasts stay
    broadcasts). Non-tensors pass through. The copies are queued on ``stream`` (default:
    the current stream); the caller orders them before the call.
    """

    def __init__(self, inputs: Sequence, outputs: Sequence = (), calls: int = 1):
        if calls < 1:
            raise ValueError(f"calls: expected >= 1, got {calls}")
        self.calls, self.done = calls, 0
        self.entries = [self._entry(t, calls, False) for t in inputs] + [self._entry(t, calls, True) for t in outputs]

    @staticmethod
    def _span(t: torch.Tensor) -> int:
        if t.numel() == 0:
            return 0
        return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)

    @classmethod
    def _entry(cls, t, calls: int, zero: bool):
        if not isinstance(t, torch.Tensor):
            return ("value", t)
        if any(st < 0 for st in t.stride()):
            t = t.contiguous()
        span = cls._span(t)
        step = max(1, SHIFT_BYTES // t.element_size())
        pool = torch.empty(span + (calls - 1) * step, dtype=t.dtype, device=t.device)
        src = None if zero else t.as_strided((span,), (1,))
        return ("tensor", pool, src, tuple(t.shape), tuple(t.stride()), span, step)

    def __call__(self, stream: Optional["torch.cuda.Stream"] = None) -> list:
        if self.done >= self.calls:
            raise RuntimeError(f"ShiftedArgs: {self.calls} calls were planned; call {self.done + 1} asked")
        k, out = self.done, []
        self.done += 1
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        if stream is not None:  # the pool's previous region may still be read on the current stream
            stream.wait_stream(torch.cuda.current_stream())
        with ctx:
            for e in self.entries:
                if e[0] == "value":
                    out.append(e[1])
                    continue
                _, pool, src, shape, stride, span, step = e
                region = pool.narrow(0, k * step, span)
                if src is None:
                    region.zero_()
                else:
                    region.copy_(src)
                out.append(pool.as_strided(shape, stride, k * step))
        return out


@dataclass
class DeviceActivity:
    """One kernel, memcpy or memset on the device: times in ns of the tracer's clock."""
    name: str
    start: int
    end: int
    correlation: int = 0
    stream: Optional[int] = None


@dataclass
class SpanTimes:
    samples_ms: list
    source: str  # "cupti" or "torch.profiler"
    activities_per_call: list = field(default_factory=list)


def attribute_to_windows(windows: Sequence, launches: Sequence, activities: Sequence) -> list:
    """The evaluator's attribution: per host window ``(t0, t1)``, the device activities
    whose launch (``(host_time, correlation)``) lies in ``[t0, t1]``, in start order."""
    by_corr: dict = {}
    for a in activities:
        by_corr.setdefault(a.correlation, []).append(a)
    launches = sorted(launches)
    times = [t for t, _ in launches]
    import bisect

    calls = []
    for t0, t1 in windows:
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        corrs = {launches[i][1] for i in range(lo, hi)}
        calls.append(sorted((a for c in corrs for a in by_corr.get(c, ())), key=lambda a: a.start))
    return calls


def group_at_flush(activities: Sequence, flush_name: str = FLUSH_KERNEL_NAME, skip_streams=()) -> list:
    """Device activities (any order) split into calls at each flush kernel: per call those
    after one flush and before the next, in start order, leaving out the streams in
    ``skip_streams`` (where the argument copies ran) and anything before the first flush."""
    calls, cur = [], None
    for a in sorted(activities, key=lambda a: a.start):
        if flush_name in a.name:
            if cur is not None:
                calls.append(cur)
            cur = []
        elif cur is not None and a.stream not in skip_streams:
            cur.append(a)
    if cur is not None:
        calls.append(cur)
    return calls


def span_ms(call: Sequence) -> float:
    """First start to last end of one call's device activities, in ms (clock in ns)."""
    return (max(a.end for a in call) - min(a.start for a in call)) / 1e6


def cupti_available() -> bool:
    try:
        from cupti import cupti  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or unusable: the profiler path
        return False
    return True


def _spans(calls: list, reps: int, source: str) -> SpanTimes:
    if len(calls) != reps or any(not c for c in calls):
        empty = sum(1 for c in calls if not c)
        raise TimingError(f"{source}: device activity for {len(calls) - empty} of {reps} calls")
    kinds = {tuple(sorted(a.name for a in c)) for c in calls}
    if len(kinds) > 1:  # the evaluator rejects a call whose kernels change between iterations
        raise TimingError(f"{source}: the calls ran different kernels: "
                          + " | ".join(", ".join(k) for k in sorted(kinds))[:500])
    return SpanTimes([span_ms(c) for c in calls], source, [len(c) for c in calls])


def time_call_span(fn: Callable, inputs: Sequence, outputs: Sequence = (), reps: int = 50, warmup: int = 10,
                   flusher: Optional[L2Flusher] = None, source: str = "auto") -> SpanTimes:
    """Per iteration: fresh argument addresses, L2 flush, ``fn(*inputs, *outputs)``, device
    synchronize; the span of the call's device activity (see the module docstring).
    ``source``: "auto" (CUPTI when cupti-python imports, else the torch profiler), "cupti"
    or "profiler"."""
    if source not in ("auto", "cupti", "profiler"):
        raise ValueError(f"source: expected auto, cupti or profiler, got {source!r}")
    if source == "auto":
        source = "cupti" if cupti_available() else "profiler"
    flusher = flusher or L2Flusher(torch.cuda.current_device())
    if source == "cupti":
        return _span_cupti(fn, inputs, outputs, reps, warmup, flusher)
    return _span_profiler(fn, inputs, outputs, reps, warmup, flusher)


def _warm(fn, args: ShiftedArgs, warmup: int, flusher, stream=None) -> None:
    torch.cuda.synchronize()
    for _ in range(warmup):
        a = args(stream)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        flusher()
        fn(*a)
    torch.cuda.synchronize()


def _span_cupti(fn, inputs, outputs, reps, warmup, flusher) -> SpanTimes:
    from cupti import cupti

    args = ShiftedArgs(inputs, outputs, warmup + reps)
    _warm(fn, args, warmup, flusher)
    device_kinds = (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET)
    host_kinds = (cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER)
    launches, acts, windows = [], [], []

    def requested():
        return 8 * 1024 * 1024, 0

    def completed(records):
        for r in records:
            if r.kind in device_kinds:
                name = r.name if r.kind == cupti.ActivityKind.CONCURRENT_KERNEL else str(r.kind)
                acts.append(DeviceActivity(name, r.start, r.end, r.correlation_id))
            elif r.kind in host_kinds:
                launches.append((r.start, r.correlation_id))

    kinds = host_kinds + device_kinds
    for k in kinds:
        cupti.activity_enable(k)
    try:
        cupti.activity_register_callbacks(requested, completed)
        torch.cuda.synchronize()
        for _ in range(reps):
            a = args()
            flusher()
            t0 = cupti.get_timestamp()
            fn(*a)
            t1 = cupti.get_timestamp()
            torch.cuda.synchronize()
            windows.append((t0, t1))
        cupti.activity_flush_all(0)
    finally:
        for k in kinds:
            cupti.activity_disable(k)
        cupti.finalize()
    return _spans(attribute_to_windows(windows, launches, acts), reps, "cupti")


def _span_profiler(fn, inputs, outputs, reps, warmup, flusher) -> SpanTimes:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    copies = torch.cuda.Stream()  # the argument copies run here, outside the counted streams
    args = ShiftedArgs(inputs, outputs, warmup + reps)
    _warm(fn, args, warmup, flusher, copies)
    main = torch.cuda.current_stream()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            a = args(copies)
            main.wait_stream(copies)
            flusher()
            fn(*a)
            torch.cuda.synchronize()
        flusher()
        torch.cuda.synchronize()
    acts = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA:
            acts.append(DeviceActivity(e.name(), e.start_ns(), e.end_ns(), e.correlation_id(),
                                       e.device_resource_id()))
    flushes = [a for a in acts if FLUSH_KERNEL_NAME in a.name]
    if not flushes:
        raise TimingError("torch.profiler: no flush kernel among the device activities")
    first = min(flushes, key=lambda a: a.start)
    # the profiler's stream ids are its own: the copy stream is the one whose activity (the
    # first call's argument copies) precedes the first flush
    skip = {a.stream for a in acts if a.start < first.start} - {first.stream}
    calls = group_at_flush(acts, skip_streams=skip)
    calls = calls[:-1] if len(calls) == reps + 1 and not calls[-1] else calls  # the closing flush
    return _spans(calls, reps, "torch.profiler")


def time_call_events(fn: Callable, inputs: Sequence, outputs: Sequence = (), reps: int = 50, warmup: int = 10,
                     flusher: Optional[L2Flusher] = None) -> list:
    """CUDA events around each call, after fresh argument addresses and an L2 flush; no
    synchronize between iterations (the evaluator's ``cuda_events`` method)."""
    flusher = flusher or L2Flusher(torch.cuda.current_device())
    args = ShiftedArgs(inputs, outputs, warmup + reps)
    _warm(fn, args, warmup, flusher)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        a = args()
        flusher()
        starts[i].record()
        fn(*a)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]
