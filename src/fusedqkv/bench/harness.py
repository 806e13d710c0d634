"""The benchmark harness: implementations side by side on the workloads of 091.

Implementations (``IMPLEMENTATIONS``):

* ``fusedqkv`` -- our op, destination passing (Triton + cuBLAS on CUDA, the torch path on CPU);
* ``eager`` -- the reference (the official ``run`` of ``definition.json`` when the pack is
  present, else our eager re-implementation); it is the oracle and the SOL baseline T_b;
* ``compile`` -- ``torch.compile`` of the reference; its correctness is reported as measured
  and does not decide the exit status (GPU only by default);
* ``gemm_floor`` -- the two GEMMs alone on a precomputed dQKV: a bound, not a solution.

Per workload: inputs by the official name heuristics (seed = workload index), the
oracle's outputs once, then per implementation one checked call (official policy) and
the timings: on CUDA as NVIDIA's evaluator iterates (arguments at a fresh address, L2
flush, the call), by kernel span (CUPTI, else the torch profiler) and by CUDA events,
median of 50 after 10 warm-up calls by default; on a CPU, wall clock (no flush), labelled
as a CPU run.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import json
import math
import re
import sys
import threading
import time
import traceback
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..ops import host_gemm
from ..ops.internals import raise_compile_limits
from . import problem, records, roofline, timing, trust

CPU_QUICK_WORKLOADS = (2, 11, 8, 13)  # small ones: b1 s131, b1 s128, b1 s256, b2 s293
CPU_QUICK_MAX_TOKENS = 64
CPU_MAX_TOKENS = 128
# CPU runs time each implementation on each workload for a budget of wall time (at least
# timing.CPU_MIN_REPS calls), as timeit.autorange does, instead of a fixed count
CPU_BUDGET_S = 1.0
CPU_QUICK_BUDGET_S = 0.3
# A CPU run with neither --max-tokens/--workloads nor --reps/--time-budget fits its timed calls
# into this many seconds: it measures one call of each implementation at CPU_PROBE_POINTS tokens
# and cuts tokens (CPU_TOKEN_STEPS), then the per-call budget, to fit (calibrate_cpu). The README's
# main job is then ~3 minutes with its install, on any x86 CPU.
CPU_RUN_BUDGET_S = 90.0
CPU_QUICK_RUN_BUDGET_S = 20.0
CPU_PROBE_POINTS = (1, 8)  # tokens of the calibration's calls (after one warm-up call at the first)
CPU_TOKEN_STEPS = (128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)
CPU_MIN_BUDGET_S = 0.05


class BenchError(Exception):
    """A user-facing error: printed as one line by the CLI."""


# ----------------------------------------------------------------------------- implementations


@dataclass(frozen=True)
class Implementation:
    name: str
    label: str
    role: str  # "kernel", "reference", "peer" or "bound"
    claims_correct: bool
    default_devices: tuple
    prepare: Callable  # (ctx, args, ref_out) -> Call (or a callable of no arguments) returning the outputs
    sources: Callable  # (ctx) -> dict for the implementation digest


@dataclass
class Context:
    device: torch.device
    reference: Callable
    reference_label: str
    reference_source: dict
    compiled: dict = field(default_factory=dict)
    dtype: Optional[torch.dtype] = None  # a CPU run's --dtype: every floating input and output in it
    note: Callable = lambda msg: None  # a line for the user (Progress.note)
    cache: dict = field(default_factory=dict)  # what one run reads once (the shipped modules)


def _reference_source() -> dict:
    pack = problem.official_pack_dir()
    if pack is not None:
        src = json.loads((pack / "definition.json").read_text())["reference"]
        return {"reference": "definition.json", "sha256": records.sha256_text(src)}
    return {"reference": "fusedqkv eager re-implementation", "files": records.source_tree(("ops",))}


def _shipped(ctx) -> dict:
    """The modules the exported solution ships, read and checked once per run (ExportError)."""
    from . import solution

    if "shipped" not in ctx.cache:
        try:
            ctx.cache["shipped"] = solution.shipped_modules()
        except solution.ExportError as e:
            ctx.cache["shipped"] = e
    if isinstance(ctx.cache["shipped"], Exception):
        raise ctx.cache["shipped"]
    return ctx.cache["shipped"]


def _fusedqkv_sources(ctx) -> dict:
    """What the fusedqkv implementation runs: the modules the exported solution ships (so a
    run's implementationDigest and the solution's sources agree), else every kernels/ and ops/
    file, marked, when the package cannot be exported self-contained."""
    from . import solution

    try:
        return {"files": {rel: records.sha256_text(text) for rel, text in _shipped(ctx).items()},
                "set": "solution closure"}
    except solution.ExportError as e:
        return {"files": records.source_tree(("kernels", "ops")), "set": "kernels/ and ops/",
                "exportError": str(e).splitlines()[0]}


class Call:
    """One implementation's call: ``fn(*inputs, *outputs)`` returns its outputs. The timers
    pass ``inputs`` and ``outputs`` at a fresh address each iteration (as the evaluator
    does); calling the object runs ``fn`` on the originals."""

    def __init__(self, fn: Callable, inputs, outputs=()):
        self.fn, self.inputs, self.outputs = fn, list(inputs), list(outputs)

    def __call__(self):
        return self.fn(*self.inputs, *self.outputs)


def as_call(x) -> Call:
    """A Call, from a Call or from a callable of no arguments."""
    return x if isinstance(x, Call) else Call(lambda: x(), [])


def _prep_fusedqkv(ctx, args, ref_out):
    from ..ops.backward_091 import gqa_qkv_rope_qk_norm_backward

    n = len(args)
    # the reference casts its outputs to bf16; under --dtype ours are in the inputs' dtype
    out = tuple(torch.empty_like(t, dtype=ctx.dtype) for t in ref_out)
    # destination passing, as the exported solution's run(*inputs, *outputs)
    return Call(lambda *a: gqa_qkv_rope_qk_norm_backward(*a[:n], out=a[n:]), args, out)


def _prep_eager(ctx, args, ref_out):
    return Call(ctx.reference, args)


def _prep_compile(ctx, args, ref_out):
    fn = ctx.compiled.get("fn")
    if fn is None:
        raise_compile_limits(64)
        fn = ctx.compiled["fn"] = torch.compile(ctx.reference)
    # the next call compiles (dynamo + inductor) for these shapes: say so before the wait
    if ctx.device.type == "cpu":
        ctx.note("  compile: torch.compile of the reference compiles for this workload's shapes now "
                 "(inductor's C++ on a CPU: 40 s or more, once per shape) ...")
    elif not ctx.compiled.get("noted"):
        ctx.compiled["noted"] = True
        ctx.note("  compile: torch.compile of the reference compiles on its first calls (tens of seconds) ...")
    return Call(fn, args)


def _gemm_floor(dqkv, w, x, gx, gw):
    # the products as the CPU path computes them (fp32 there: ops.host_gemm)
    host_gemm.mm(dqkv, w, out=gx)
    host_gemm.mm(dqkv.t(), x, out=gw)
    return gx, gw


def _prep_gemm_floor(ctx, args, ref_out):
    hs, w = args[3], args[6]
    m = hs.shape[0] * hs.shape[1]
    x = hs.reshape(m, hs.shape[2])
    gen = torch.Generator(device="cpu").manual_seed(0)
    dqkv = torch.randn(m, w.shape[0], generator=gen).to(device=w.device, dtype=w.dtype)
    gx = torch.empty(m, w.shape[1], device=w.device, dtype=w.dtype)
    gw = torch.empty_like(w)
    return Call(_gemm_floor, [dqkv, w, x], [gx, gw])


IMPLEMENTATIONS = {
    "fusedqkv": Implementation(
        "fusedqkv", "fusedqkv (Triton + cuBLAS on CUDA; torch path on CPU), destination passing", "kernel", True,
        ("cuda", "cpu"), _prep_fusedqkv, _fusedqkv_sources),
    "eager": Implementation(
        "eager", "eager reference", "reference", True, ("cuda", "cpu"), _prep_eager,
        lambda ctx: ctx.reference_source),
    "compile": Implementation(
        "compile", "torch.compile(reference)", "peer", False, ("cuda",), _prep_compile,
        lambda ctx: {**ctx.reference_source, "wrapper": "torch.compile(default)"}),
    "gemm_floor": Implementation(
        "gemm_floor", "two-GEMM floor (bound: dX and dW GEMMs on a precomputed dQKV)", "bound", False,
        ("cuda",), _prep_gemm_floor,
        lambda ctx: {"sha256": records.sha256_text(inspect.getsource(_prep_gemm_floor) + inspect.getsource(_gemm_floor))}),
}


def default_implementations(device: torch.device) -> list:
    return [n for n, i in IMPLEMENTATIONS.items() if device.type in i.default_devices]


# ----------------------------------------------------------------------------- progress


class Progress:
    """One line per step on stderr (rewritten in place on a terminal)."""

    HEARTBEAT_S = 10.0  # a line at least this often while something runs

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.t0 = self.last_out = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.current = None  # (what runs now, since when)
        self._lock = threading.Lock()
        self._beat = None

    def running(self, msg: str) -> None:
        """``msg`` runs now: after HEARTBEAT_S without output a line says so, and again each HEARTBEAT_S."""
        self.current = (msg, time.perf_counter())
        if self.enabled and self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="fusedqkv-bench-progress", daemon=True)
            self._beat.start()

    def close(self) -> None:
        self.current, self.enabled = None, False

    def _heartbeat(self) -> None:
        while self.enabled:
            time.sleep(0.5)
            cur, now = self.current, time.perf_counter()
            if cur is not None and now - self.last_out >= self.HEARTBEAT_S:
                self._write(f"  ... {cur[0]} running for {now - cur[1]:.0f} s ({now - self.t0:.0f} s in all)",
                            newline=True)

    def _write(self, line: str, newline: bool) -> None:
        with self._lock:
            self.stream.write(("\r\033[K" if self.tty else "") + line + ("\n" if newline or not self.tty else ""))
            self.stream.flush()
            self.last_out = time.perf_counter()

    def step(self, msg: str) -> None:
        self.done += 1
        self.current = None
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0.0
        line = f"[{self.done:>3d}/{self.total}] {el:6.1f}s (eta {eta:5.0f}s) {msg}"
        self._write(line, newline=self.done >= self.total)

    def note(self, msg: str) -> None:
        if self.enabled:
            self._write(msg, newline=True)


# ----------------------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    device: str = "auto"
    workloads: Optional[list] = None  # names/indices/uuids; None = default set
    implementations: Optional[list] = None  # None = default set for the device
    reps: Optional[int] = None  # None: GPU 50 (quick 10); CPU adaptive to time_budget
    warmup: Optional[int] = None  # None: GPU 10 (quick 2); CPU until the calls agree
    quick: bool = False
    max_tokens: Optional[int] = None  # CPU reduction cap
    span: bool = True
    span_source: str = "auto"  # auto (CUPTI when cupti-python imports, else the torch profiler), cupti, profiler
    statistic: str = "median"  # the evaluator's
    measure_ceilings: bool = False
    progress: bool = True
    definition: str = problem.DEFAULT_DEFINITION
    time_budget: Optional[float] = None  # CPU: seconds of timed calls per implementation and workload
    dtype: Optional[str] = None  # CPU: floating inputs cast to this dtype (None: the definition's)


CPU_DTYPES = {"float32": torch.float32}


@dataclass
class Plan:
    """A checked BenchConfig: everything resolved, nothing run yet."""

    device: torch.device
    definition: problem.Definition
    implementations: list
    workloads: list
    cap: Optional[int]
    reps: Optional[int]  # None: adaptive (CPU)
    warmup: Optional[int]  # None: until stable (CPU)
    time_budget: Optional[float]  # CPU adaptive repetitions
    span: bool
    span_source: str
    primary_timer: str
    timers: list
    dtype: Optional[str] = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise BenchError(f"--device: expected cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False); use --device cpu")
    return torch.device(name)


def resolve_implementations(names, device: torch.device) -> list:
    if not names:
        chosen = default_implementations(device)
    else:
        chosen = []
        for n in names:
            if n not in IMPLEMENTATIONS:
                raise BenchError(f"unknown implementation {n!r}; known: {', '.join(IMPLEMENTATIONS)}")
            if n not in chosen:
                chosen.append(n)
    if "eager" not in chosen:  # the baseline of the SOL score is always measured
        chosen.insert(0 if not chosen else 1, "eager")
    return chosen


_REDUCED_NAME = re.compile(r"^w(\d+)_b(\d+)_s(\d+)$")


def _reduced_by_name(defn, key: str):
    """The workload a reduced run printed as ``key`` (``w00_b32_s4``: w00_b32_s256 cut to 128
    tokens), at exactly that size, or None when ``key`` is no such name."""
    m = _REDUCED_NAME.match(str(key))
    if not m:
        return None
    idx, b, sl = (int(g) for g in m.groups())
    try:
        w = defn.workload(idx)
    except KeyError:
        return None
    r = problem.reduced_workload(w, b * sl)
    return r if (r.axes["batch_size"], r.axes["seq_len"]) == (b, sl) else None


def resolve_workloads(defn, keys, device: torch.device, quick: bool, max_tokens: Optional[int]) -> tuple:
    """(workloads, reduction cap or None). Keys are indices, uuids, names, or the names of
    reduced workloads a CPU run prints (those keep the size they name)."""
    cpu = device.type == "cpu"
    cap = (max_tokens or (CPU_QUICK_MAX_TOKENS if quick else CPU_MAX_TOKENS)) if cpu else max_tokens
    if keys:
        out = []
        for k in keys:
            try:
                w = defn.workload(k)
            except KeyError:
                w = None
            if w is not None:
                out.append(problem.reduced_workload(w, cap) if cap else w)
                continue
            r = _reduced_by_name(defn, k)
            if r is None:
                raise BenchError(f"unknown workload {k!r}; known: {', '.join(w.name for w in defn.workloads)} "
                                 "(or an index, a uuid, or a reduced name a CPU run prints, e.g. w00_b32_s4)")
            out.append(r)
        return out, cap
    wls = [defn.workload(i) for i in CPU_QUICK_WORKLOADS] if (cpu and quick) else list(defn.workloads)
    return ([problem.reduced_workload(w, cap) for w in wls] if cap else wls), cap


def _positive(name: str, v, allow_zero: bool = False, kind=int):
    if v is None:
        return None
    bad = (not isinstance(v, (int, float)) or isinstance(v, bool) or (kind is int and not float(v).is_integer())
           or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero))
    if bad:
        raise BenchError(f"{name}: expected {'a whole number' if kind is int else 'a number'} "
                         f"{'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return kind(v)


def plan_bench(cfg: BenchConfig) -> Plan:
    """Checks every setting of a run (raising BenchError naming the option) without running
    anything: the CLI calls it before it touches --out."""
    reps = _positive("--reps", cfg.reps)
    warmup = _positive("--warmup", cfg.warmup, allow_zero=True)
    budget = _positive("--time-budget", cfg.time_budget, kind=float)
    max_tokens = _positive("--max-tokens", cfg.max_tokens)
    if cfg.statistic not in ("mean", "median"):
        raise BenchError(f"--statistic: expected mean or median, got {cfg.statistic!r}")
    if cfg.span_source not in ("auto", "cupti", "profiler"):
        raise BenchError(f"--span-clock: expected auto, cupti or profiler, got {cfg.span_source!r}")
    device = resolve_device(cfg.device)
    cpu = device.type == "cpu"
    if budget is not None and not cpu:
        raise BenchError("--time-budget: CPU runs only (a GPU run times a fixed --reps, as the evaluator)")
    if cfg.dtype is not None:
        if cfg.dtype not in CPU_DTYPES:
            raise BenchError(f"--dtype: expected {' or '.join(CPU_DTYPES)} (CPU runs; default: the definition's "
                             f"dtypes), got {cfg.dtype!r}")
        if not cpu:
            raise BenchError("--dtype: CPU runs only (a GPU run uses the definition's dtypes, as the evaluator)")
    try:
        defn = problem.load_definition(cfg.definition)
    except KeyError as e:
        raise BenchError(str(e).strip("'\"")) from None
    problem.official_pack_dir(defn.name)  # a $FUSEDQKV_SOL_EXECBENCH without the pack raises, before anything runs
    impl_names = resolve_implementations(cfg.implementations, device)
    wls, cap = resolve_workloads(defn, cfg.workloads, device, cfg.quick, max_tokens)
    if cpu:
        budget = None if reps is not None else (budget or (CPU_QUICK_BUDGET_S if cfg.quick else CPU_BUDGET_S))
    else:
        # GPU: the evaluator's 10 warm-up calls and 50 timed ones
        reps = reps or (10 if cfg.quick else 50)
        warmup = warmup if warmup is not None else (2 if cfg.quick else 10)
    span = cfg.span and not cpu
    if span and cfg.span_source == "cupti" and not timing.cupti_available():
        raise BenchError("--span-clock cupti: cupti-python is not importable (pip install cupti-python)")
    span_source = ("cupti" if timing.cupti_available() else "profiler") if cfg.span_source == "auto" else cfg.span_source
    primary_timer = "cpu_wall" if cpu else ("kernel_span" if span else "cuda_events")
    timers = ["cpu_wall"] if cpu else (["kernel_span", "cuda_events"] if span else ["cuda_events"])
    return Plan(device, defn, impl_names, wls, cap, reps, warmup, budget, span, span_source, primary_timer, timers,
                cfg.dtype)


@dataclass
class CpuCalibration:
    """What a CPU run chose from measured calls (its header line says so): the cap on tokens per
    workload and the seconds of timed calls per implementation and workload, so that the run's
    estimated time fits ``run_budget_s``."""

    probe_ms: dict           # implementation -> {tokens: ms of one call}
    cap: Optional[int]
    budget_s: Optional[float]
    estimate_s: float
    run_budget_s: float
    gemm_gflops: dict        # {"bfloat16": x, "float32": y}: one row-major GEMM each
    native_bf16: Optional[bool]
    chose: tuple             # what it chose: "tokens" and/or "repetitions" (the rest was given)

    @property
    def slow_bf16(self) -> bool:
        g = self.gemm_gflops
        return g["bfloat16"] < 0.25 * g["float32"]

    def header(self) -> str:
        probes = "; ".join(f"{name} " + ", ".join(f"{ms:.1f} ms at {t}" for t, ms in by.items())
                           for name, by in self.probe_ms.items())
        chose = []
        if "tokens" in self.chose:
            chose.append(f"workloads cut to <= {self.cap} tokens")
        if "repetitions" in self.chose:
            chose.append(f"{self.budget_s:g} s of timed calls each (>= {timing.CPU_MIN_REPS} calls)")
        if not self.chose:
            line = "CPU run: tokens and repetitions as given (no calibration)"
        else:
            line = (f"CPU calibration (one call per token count: {probes}): {', '.join(chose)}; "
                    f"estimated {self.estimate_s:.0f} s of calls (budget {self.run_budget_s:g} s)")
        if self.estimate_s > self.run_budget_s:
            line += " -- over budget even at the smallest settings"
        if self.slow_bf16:
            g = self.gemm_gflops
            why = ("no native bf16 (no avx512_bf16 or amx_bf16 in its flags)" if self.native_bf16 is False
                   else "a slow bf16 GEMM")
            line += (f"\nthis CPU has {why}: the official reference's bf16 GEMMs run at {g['bfloat16'] / 1e9:.2f} "
                     f"GFLOP/s (fp32: {g['float32'] / 1e9:.1f} GFLOP/s); fusedqkv's CPU path multiplies in fp32")
        return line

    def to_json(self) -> dict:
        return {"probeMs": {n: {str(t): ms for t, ms in by.items()} for n, by in self.probe_ms.items()},
                "maxTokens": self.cap, "budgetS": self.budget_s, "estimateS": self.estimate_s,
                "runBudgetS": self.run_budget_s, "gemmGflops": {k: v / 1e9 for k, v in self.gemm_gflops.items()},
                "nativeBf16": self.native_bf16, "chose": list(self.chose)}


def _pair_seconds(call_s: float, budget_s: Optional[float], reps: Optional[int], extra_calls: int) -> float:
    """One implementation on one workload as time_cpu_budget runs it, plus ``extra_calls`` (the
    correctness call; the reference output too for the baseline)."""
    warm = min(3, max(1, math.ceil(timing.CPU_WARMUP_CAP_S / max(call_s, 1e-9))))
    timed = reps * call_s if reps is not None else max(timing.CPU_MIN_REPS * call_s, budget_s)
    return (extra_calls + warm) * call_s + timed


def _call_model(by_tokens: dict):
    """seconds(tokens) = a + b * tokens through the two measured points (ms), padded 15 %."""
    (t_lo, lo), (t_hi, hi) = sorted(by_tokens.items())
    b = max(0.0, (hi - lo) / (t_hi - t_lo)) / 1e3
    a = max(0.0, lo / 1e3 - b * t_lo)
    return lambda tokens: 1.15 * (a + b * tokens)


def calibrate_cpu(pl: "Plan", cfg: "BenchConfig", ctx: "Context", impls: list, prog: "Progress") -> tuple:
    """(plan, CpuCalibration): the plan with the cap and per-call budget that fit the run's
    budget, for what the user left unset (--max-tokens/--workloads, --reps/--time-budget)."""
    free_tokens = cfg.max_tokens is None and not cfg.workloads
    free_reps = cfg.reps is None and cfg.time_budget is None
    run_budget = CPU_QUICK_RUN_BUDGET_S if cfg.quick else CPU_RUN_BUDGET_S
    if not (free_tokens or free_reps):  # everything given: only whether the reference's GEMMs are slow here
        cal = CpuCalibration({}, pl.cap, pl.time_budget, math.nan, run_budget, roofline.cpu_gemm_rates(),
                             roofline.cpu_native_bf16(), ())
        return pl, cal
    prog.running("CPU calibration")
    prog.note("measuring this CPU: one GEMM in bf16 and fp32, one call of each implementation at "
              + " and ".join(map(str, CPU_PROBE_POINTS)) + " tokens")
    rates = roofline.cpu_gemm_rates()
    probe_ms: dict = {impl.name: {} for impl in impls}
    gen_s = 0.0
    base = pl.workloads[0]
    for i, tokens in enumerate((CPU_PROBE_POINTS[0],) + CPU_PROBE_POINTS):
        w = problem.reduced_workload(base, tokens)
        t0 = time.perf_counter()
        args = list(problem.generate_inputs(pl.definition, w, device=pl.device, seed=w.index).values())
        if ctx.dtype is not None:  # --dtype: as the run casts them
            args = [a.to(ctx.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        gen_s = max(gen_s, time.perf_counter() - t0)
        with torch.no_grad():
            t0 = time.perf_counter()
            ref_out = tuple(ctx.reference(*args))
            ref_ms = (time.perf_counter() - t0) * 1e3
            for impl in impls:
                if impl.name == "eager":
                    ms = ref_ms
                else:
                    fn = impl.prepare(ctx, args, ref_out)
                    t0 = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - t0) * 1e3
                if i:  # the first round warms up
                    probe_ms[impl.name][w.tokens] = ms
    models = {name: _call_model(by) for name, by in probe_ms.items()}

    def estimate(cap, budget):
        wls, _ = resolve_workloads(pl.definition, cfg.workloads, pl.device, cfg.quick, cap)
        total = 0.0
        for w in wls:
            total += gen_s
            for name, model in models.items():
                total += _pair_seconds(model(w.tokens), budget, pl.reps, 2 if name == "eager" else 1)
        return total

    caps = [c for c in CPU_TOKEN_STEPS if c <= pl.cap] if free_tokens else [pl.cap]
    budgets = ([pl.time_budget * f for f in (1, 0.5, 0.25) if pl.time_budget * f >= CPU_MIN_BUDGET_S]
               if free_reps else [pl.time_budget])
    choice = None
    for cap in caps:
        for budget in budgets:
            est = estimate(cap, budget)
            if est <= run_budget:
                choice = (cap, budget, est)
                break
        if choice:
            break
    if choice is None:
        choice = (caps[-1], budgets[-1], estimate(caps[-1], budgets[-1]))
    cap, budget, est = choice
    chose = tuple(k for k, free in (("tokens", free_tokens), ("repetitions", free_reps)) if free)
    cal = CpuCalibration(probe_ms, cap, budget, est, run_budget, rates, roofline.cpu_native_bf16(), chose)
    if free_tokens and cap != pl.cap:
        wls, cap = resolve_workloads(pl.definition, cfg.workloads, pl.device, cfg.quick, cap)
        pl = dataclasses.replace(pl, workloads=wls, cap=cap)
    if free_reps and budget != pl.time_budget:
        pl = dataclasses.replace(pl, time_budget=budget)
    return pl, cal


def repetitions_spec(reps: Optional[int], budget: Optional[float]):
    """The protocol's repetitions: a count, or the adaptive rule of a CPU run."""
    if reps is not None:
        return reps
    return {"adaptive": f"calls until {budget:g} s of wall time and at least {timing.CPU_MIN_REPS} calls "
                        f"(at most {timing.CPU_MAX_REPS}), as timeit.autorange",
            "budgetS": budget, "minimum": timing.CPU_MIN_REPS, "maximum": timing.CPU_MAX_REPS}


def warmup_spec(warmup: Optional[int]):
    if warmup is not None:
        return warmup
    return {"untilStable": f"until 3 consecutive calls agree within {timing.CPU_STABLE_WITHIN:.0%} "
                           f"(at least 1 call, at most {timing.CPU_WARMUP_CAP_S:g} s)",
            "withinFraction": timing.CPU_STABLE_WITHIN, "capS": timing.CPU_WARMUP_CAP_S}


def protocol_for(device: torch.device, reps, warmup, primary_timer: str, timers: list,
                 statistic: str, ceilings_source: str, definition: str, span_source: str = "auto",
                 dtype: Optional[str] = None) -> dict:
    cpu = device.type == "cpu"
    proto = {
        "kind": "BenchmarkProtocol",
        "name": f"sol-execbench-style/{'cpu-wall' if cpu else 'evaluator-cold-l2'}",
        "definition": definition,
        "deviceType": device.type,
        "warmup": warmup,
        "repetitions": reps,
        "timer": primary_timer,
        "timers": timers,
        "statistic": statistic,
        "l2Flush": "none (CPU run)" if cpu else "before every iteration: l2_flush_kernel overwrites 2x L2",
        "inputs": "official name heuristics, seed = workload index",
        "correctness": {"compare": "float32", "nonFiniteFails": True, "allZeroFails": True,
                        "rule": "|x - y| <= atol + rtol * |y|",
                        "requiredMatchedRatio": problem.REQUIRED_MATCHED_RATIO,
                        "tolerances": "per workload (definition)", "oracle": "reference"},
        "baseline": "eager reference, same run",
        "sol": {"model": "roofline: max(two-GEMM FLOPs / peak FLOP/s, minimal bytes / peak bandwidth)",
                "ceilings": ceilings_source,
                "score": "S = 1 / (1 + (T - T_sol) / (T_b - T_sol)); failed workload scores 0"},
    }
    if not cpu:
        proto["iteration"] = ("as NVIDIA's evaluator: arguments at a fresh address (256-byte shifting pool, "
                              "outputs zeroed), L2 flush, the call; kernel span: device synchronize after "
                              "each call, span of the call's device activity; CUDA events: no synchronize")
        if "kernel_span" in timers:
            proto["spanSource"] = span_source
    if dtype is not None:  # only then: the protocols (and digests) of runs in the definition's dtypes stay as they were
        proto["inputDtype"] = dtype
    return proto


# ----------------------------------------------------------------------------- run


def _time(call, device, reps, warmup, span, flusher, span_source: str = "auto", budget_s: Optional[float] = None) -> dict:
    """The evaluator's iteration (fresh argument addresses, L2 flush, the call) timed by
    kernel span (CUPTI or the profiler) and by CUDA events; wall clock on a CPU (repetitions
    to ``budget_s`` when ``reps`` is None, with the host wait of the timed calls)."""
    call = as_call(call)
    if device.type == "cuda":
        out = {"cuda_events": timing.summarize(timing.time_call_events(
            call.fn, call.inputs, call.outputs, reps=reps, warmup=warmup, flusher=flusher))}
        if span:
            st = timing.time_call_span(call.fn, call.inputs, call.outputs, reps=reps, warmup=warmup,
                                       flusher=flusher, source=span_source)
            out["kernel_span"] = {**timing.summarize(st.samples_ms), "source": st.source,
                                  "activities_per_call": max(st.activities_per_call, default=0)}
        return out
    ct = timing.time_cpu_budget(call, budget_s=budget_s or CPU_BUDGET_S, reps=reps, warmup=warmup)
    return {"cpu_wall": {**timing.summarize(ct.samples_ms), "host_wait": ct.host_wait,
                         "warmup_calls": ct.warmup_calls, "warmup_stable": ct.warmup_stable}}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(cfg: BenchConfig, plan: Optional[Plan] = None) -> dict:
    """Run the benchmark; returns the results (everything the records and the report need).
    ``plan``: ``plan_bench(cfg)`` where the caller already has it."""
    pl = plan or plan_bench(cfg)
    device, defn, impl_names = pl.device, pl.definition, pl.implementations
    cpu = device.type == "cpu"
    primary_timer = pl.primary_timer
    prog = Progress(len(pl.workloads) * len(impl_names), enabled=cfg.progress)
    cast = CPU_DTYPES[pl.dtype] if pl.dtype else None
    ref, ref_label = problem.reference_impl(defn.name)
    ctx = Context(device, ref, ref_label, _reference_source(), dtype=cast, note=prog.note)
    impls = [IMPLEMENTATIONS[n] for n in impl_names]
    calibration = None
    if cpu:
        pl, calibration = calibrate_cpu(pl, cfg, ctx, impls, prog)
        prog.note(calibration.header())
    wls, cap = pl.workloads, pl.cap
    prog.total = len(wls) * len(impls)

    env = records.environment(device)
    hw = env["hardwareName"]
    # a CPU measures the faster of an fp32 and a bf16 matmul (roofline.measure_ceilings)
    mm_dtype = cast or torch.bfloat16
    mm_label = str(mm_dtype).replace("torch.", "").replace("bfloat16", "bf16")
    if cpu and cast is None:
        mm_label = "fp32 or bf16, the faster"
    ceil = None if (cpu or cfg.measure_ceilings) else roofline.datasheet_ceilings(hw)
    measured = None
    if ceil is None or cfg.measure_ceilings:
        prog.running(f"measuring the SOL ceilings ({mm_label} matmul, copy)")
        measured = roofline.measure_ceilings(device, hw, dtype=mm_dtype)
        ceil = measured
    if ceil.source != "measured":
        ceil_source = f"datasheet ({ceil.name})"
    elif cpu:  # the faster of two measurements: load during one of them only understates the device
        ceil_source = f"measured at start and at end, the faster of each ({mm_label} matmul, copy)"
    else:
        ceil_source = f"measured at start ({mm_label} matmul, copy)"
    protocol = protocol_for(device, repetitions_spec(pl.reps, pl.time_budget), warmup_spec(pl.warmup),
                            primary_timer, pl.timers, cfg.statistic, ceil_source, defn.name, pl.span_source,
                            pl.dtype)
    workload_set = {"definition": defn.name, "deviceReduced": cap is not None, "maxTokens": cap,
                    "workloads": [w.to_json() for w in wls]}
    if pl.dtype:
        workload_set["dtype"] = pl.dtype

    names = list(defn.outputs)
    flusher = timing.L2Flusher(device) if not cpu else None
    reps_note = (f"reps {pl.reps}" if pl.reps is not None
                 else f"reps adaptive ({pl.time_budget:g} s each, >= {timing.CPU_MIN_REPS})")
    prog.note(f"fusedqkv bench: {defn.name} on {hw}{' (CPU run, reduced workloads)' if cpu else ''}: "
              f"{len(wls)} workloads x {', '.join(impl_names)}; {reps_note}, timer {primary_timer}; "
              f"reference: {ref_label}" + (f"; inputs cast to {pl.dtype}" if pl.dtype else ""))

    rows = []
    for w in wls:
        args = list(problem.generate_inputs(defn, w, device=device, seed=w.index).values())
        if cast is not None:
            args = [a.to(cast) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        with torch.no_grad():
            ref_out = tuple(ref(*args))
        _sync(device)
        row = {"workload": w.name, "index": w.index, "uuid": w.uuid, "axes": dict(w.axes), "tokens": w.tokens,
               "tolerance": {"atol": w.atol, "rtol": w.rtol},
               "b200": ({"sol_ms": w.b200_sol_ms, "baseline_ms": w.b200_baseline_ms}
                        if w.b200_sol_ms is not None else None),
               "impls": {}}
        for impl in impls:
            res = {"status": "ok", "role": impl.role}
            prog.running(f"{w.name:<16s} {impl.name:<10s}")
            try:
                with torch.no_grad():
                    fn = impl.prepare(ctx, args, ref_out)
                    got = fn()
                    _sync(device)
                    if impl.role in ("kernel", "peer"):
                        checks = problem.check_outputs(names, tuple(got), ref_out, w)
                        res["checks"] = [c.to_json() for c in checks]
                        res["correct"] = all(c.passed for c in checks)
                        res["min_matched_ratio"] = min(c.matched_ratio for c in checks)
                    elif impl.role == "reference":
                        res["correct"] = True
                        res["note"] = "the oracle"
                    else:
                        res["correct"] = None
                        res["note"] = "a bound, not a solution"
                    del got
                    res["timings"] = _time(fn, device, pl.reps, pl.warmup, pl.span, flusher, pl.span_source,
                                           pl.time_budget)
                res["latency_ms"] = res["timings"][primary_timer][cfg.statistic]
            except Exception as e:  # noqa: BLE001 - a failing peer is a result, not a crash
                res.update(status="error", correct=False if impl.role != "bound" else None,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500],
                           traceback=traceback.format_exc(limit=4)[-2000:])
            row["impls"][impl.name] = res
            lat = res.get("latency_ms")
            ok = {True: "ok", False: "FAIL", None: "-"}[res.get("correct")] if res["status"] == "ok" else "ERROR"
            hwait = res.get("timings", {}).get("cpu_wall", {}).get("host_wait")
            prog.step(f"{w.name:<16s} {impl.name:<10s} {ok:<5s} "
                      + (f"{lat:9.4f} ms" if lat is not None else res.get("error", "")[:80])
                      + (f"  (host busy: waited {hwait:.0%})" if hwait is not None and hwait > trust.HOST_WAIT else ""))
        rows.append(row)
        del args, ref_out
        if device.type == "cuda":
            torch.cuda.empty_cache()

    prog.running("measuring the ceilings again" if cpu else "scoring")
    if cpu:  # again at the end; the bound is the faster of the two (see ceil_source)
        ceil = measured = roofline.best_ceilings([measured, roofline.measure_ceilings(device, hw, when="end",
                                                                                      dtype=mm_dtype)])
    for r, w in zip(rows, wls):
        rl = roofline.roofline(defn, w.axes, ceil, pl.dtype)
        r["roofline"], r["sol_ms"] = rl, rl["sol_ms"]

    # run-level figures per implementation, and the flags of rows that cannot be trusted
    run_flags = trust.bound_flags(ceil.to_json(), cpu)
    base = [r["impls"]["eager"].get("latency_ms") for r in rows]
    sols = [r["sol_ms"] for r in rows]
    summary = {}
    for impl in impls:
        lats, scored, row_flags = [], [], []
        for r in rows:
            x = r["impls"][impl.name]
            lat = x.get("latency_ms")
            lats.append(lat)
            good = x["status"] == "ok" and (x.get("correct") is not False)
            scored.append(lat if good else None)
        agg = roofline.aggregate(scored, base, sols)
        for r, s in zip(rows, agg["sol_scores"]):
            x = r["impls"][impl.name]
            x["sol_score"] = s
            tb, t = r["impls"]["eager"].get("latency_ms"), x.get("latency_ms")
            x["speedup"] = (tb / t) if (tb and t) else None
            own = x.get("timings", {}).get(primary_timer)
            x["spread"] = trust.spread(own)
            if impl.role == "bound":  # not scored: its own timing's flags, and whether it bounds the kernel
                kernels = [r["impls"][k].get("latency_ms") for k in impl_names if IMPLEMENTATIONS[k].role == "kernel"
                           and r["impls"][k]["status"] == "ok"]
                fl = trust.timing_flags(own, cpu) + trust.floor_flags(t, min(kernels) if kernels else None)
                x["flags"] = [f for f in trust.FLAGS if f in fl]
                row_flags.append(x["flags"])
                continue
            x["flags"] = trust.row_flags(t, r["sol_ms"], tb, own,
                                         r["impls"]["eager"].get("timings", {}).get(primary_timer), cpu,
                                         run_flags, is_baseline=impl.name == "eager")
            if s is None and x["status"] == "ok" and x.get("correct") is not False and t is not None:
                x["flags"] = x["flags"] or ["bound_not_below_baseline"]  # no value: T_b == T_sol
            assert trust.check_invariant(s, x["flags"]), (r["workload"], impl.name, s)
            row_flags.append(x["flags"])
        measured_lats = [x for x in lats if x is not None]
        srcs = impl.sources(ctx)
        per_stat = {st: [r["impls"][impl.name]["timings"][primary_timer][st] for r in rows
                         if r["impls"][impl.name].get("timings")] for st in ("mean", "median")}
        n_correct = sum(1 for r in rows if r["impls"][impl.name].get("correct") is True)
        errors = sum(1 for r in rows if r["impls"][impl.name]["status"] != "ok")
        summary[impl.name] = {
            "label": impl.label, "role": impl.role, "claims_correct": impl.claims_correct,
            "correct_count": n_correct, "error_count": errors, "total": len(rows),
            "all_correct": (n_correct == len(rows)) if impl.role != "bound" else None,
            "sol_score": agg["sol_score"] if impl.role != "bound" else None,
            "avg_speedup": agg["avg_speedup"], "geomean_speedup": agg["geomean_speedup"],
            "fast_1_count": agg["fast_1_count"], "fast_1_total": agg["fast_1_total"],
            "latency_ms": (sum(measured_lats) / len(measured_lats)) if measured_lats else None,
            # per statistic of the per-call distribution, averaged over the workloads
            "latency_ms_by_statistic": {st: (sum(v) / len(v)) if v else None for st, v in per_stat.items()},
            "implementationDigest": records.digest(srcs),
            "trust": {**trust.summarize_flags(row_flags), "rules": trust.rules(cpu)},
        }
        summary[impl.name]["_sources"] = srcs

    prog.close()
    failed = [n for n in impl_names if IMPLEMENTATIONS[n].claims_correct and not summary[n]["all_correct"]]
    observed = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return {
        "definition": defn.name, "definition_meta": defn.meta, "device": device.type, "cpu_run": cpu,
        "hardware": hw, "observedAt": observed, "reference_label": ref_label,
        "implementations": impl_names, "primary_timer": primary_timer, "statistic": cfg.statistic,
        "reps": protocol["repetitions"], "warmup": protocol["warmup"], "quick": cfg.quick,
        "ceilings": ceil.to_json(), "measured_ceilings": measured.to_json() if measured else None,
        "datasheet_ceilings": (roofline.datasheet_ceilings(hw).to_json()
                               if (not cpu and roofline.datasheet_ceilings(hw)) else None),
        "protocol": protocol, "workload_set": workload_set, "environment": env,
        "workloads": rows, "summary": summary, "failed_claims": failed,
        "bound_flags": run_flags, "cpu_calibration": calibration.to_json() if calibration else None,
        "floor_flags": {r["workload"]: r["impls"][n]["flags"] for r in rows for n in impl_names
                        if IMPLEMENTATIONS[n].role == "bound" and "floor_unsteady" in r["impls"][n].get("flags", [])},
        "solution_digest": solution_digest(ctx) if "fusedqkv" in impl_names else None,
    }


def _workload_detail(results: dict, name: str) -> list:
    """Per workload of one implementation: its uuid and axes (what a record is matched on across
    clocks), score, flags, the spread of its repetitions, and the other timers' statistics."""
    out = []
    for r in results["workloads"]:
        x = r["impls"][name]
        timings = x.get("timings", {})
        t = timings.get(results["primary_timer"], {})
        d = {"workload": r["workload"], "uuid": r.get("uuid"), "axes": r.get("axes"), "status": x.get("status"),
             "correct": x.get("correct"), "sol_score": x.get("sol_score"), "sol_ms": r.get("sol_ms"),
             "flags": x.get("flags", []),
             "latency_ms": {k: t[k] for k in ("n", "min", "p20", "median", "p80", "max", "mean") if k in t},
             "spread": x.get("spread"), "host_wait": t.get("host_wait")}
        other = {tm: {k: v[k] for k in ("median", "mean") if k in v} for tm, v in timings.items()
                 if tm != results["primary_timer"] and isinstance(v, dict)}
        if other:
            d["otherTimers"] = other
        out.append(d)
    return out


def solution_digest(ctx: Optional[Context] = None) -> Optional[str]:
    """The sources digest of the solution ``fusedqkv export-solution`` writes from this checkout
    (None when it cannot be exported): what links a bench record of fusedqkv to the evaluator's
    traces of that solution."""
    from . import solution

    try:
        mods = _shipped(ctx) if ctx is not None else None
        return solution.sources_digest(solution.build_solution(modules=mods))
    except solution.ExportError:
        return None


def build_records(results: dict) -> dict:
    """One KernelIndex record per implementation that is a solution (bounds have none)."""
    out = {}
    for name in results["implementations"]:
        s = results["summary"][name]
        if s["role"] == "bound":
            continue
        status = "Succeeded" if s["all_correct"] and not s["error_count"] else ("Errored" if s["error_count"] else "Failed")
        metrics = {k: s[k] for k in ("sol_score", "latency_ms", "avg_speedup", "fast_1_count", "fast_1_total")}
        out[name] = records.make_record(
            definition=results["definition"], implementation=name, impl_label=s["label"],
            protocol=results["protocol"], workloads=results["workload_set"], env=results["environment"],
            implementation_sources=s["_sources"], metrics=metrics, latency_ms_mean=s["latency_ms_by_statistic"]["mean"],
            latency_ms_median=s["latency_ms_by_statistic"]["median"], primary_statistic=results["statistic"],
            status=status, observed_at=results["observedAt"], cpu_run=results["cpu_run"],
            trust=s.get("trust"), per_workload=_workload_detail(results, name),
            solution_digest=results.get("solution_digest") if name == "fusedqkv" else None)
    return out


def finite_or_none(x):
    return x if (x is None or not isinstance(x, float) or math.isfinite(x)) else None
