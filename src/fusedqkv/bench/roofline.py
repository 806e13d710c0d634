"""Speed of light: an analytic roofline per workload, and the SOL score.

* **Work** of one 091 backward call: the FLOPs of its two GEMMs
  (dX = dQKV . W and dW = dQKV^T . X, ``2 * 2*M*N*K`` with M tokens, N = qkv_size,
  K = hidden_size) -- the elementwise RoPE/QK-norm work is negligible beside them and
  is left out -- and the **minimal bytes**: every input read once, every output written
  once (sizes from the definition's shapes and dtypes).
* **Ceilings** of the device in use: a datasheet table (dense bf16 tensor FLOP/s and
  HBM bandwidth) for the GPUs we know, or ceilings measured at start (a large bf16
  matmul and a large copy), ``--measure-ceilings``. On a CPU there is no datasheet:
  the ceilings are always measured and labelled so.
* ``T_sol = max(FLOPs / peak_flops, bytes / peak_bw)``.
* **SOL score** of a latency T against the baseline T_b of the same run:
  ``S = 1 / (1 + (T - T_sol) / (T_b - T_sol))`` -- 1 at the bound, 0.5 at the
  baseline, towards 0 when slower; in [0, 1] only while T_sol <= T and T_sol < T_b. Outside
  that the formula's value is kept and the row flagged (``trust``), never clipped.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Ceilings:
    """Peak dense bf16 FLOP/s and memory bandwidth (bytes/s) of a device, and where they come from."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    source: str  # "datasheet" or "measured"
    detail: Optional[dict] = None  # measured: the repetitions' summaries and the host wait

    def to_json(self) -> dict:
        d = asdict(self)
        d["tflops"] = self.flops_per_s / 1e12
        d["tb_per_s"] = self.bytes_per_s / 1e12
        return d


# Dense (no sparsity) BF16 tensor-core throughput and HBM bandwidth, SXM parts unless named.
# Sources: NVIDIA H100 / H200 / B200 (HGX) / A100 datasheets.
DATASHEET = {
    "B200": Ceilings("NVIDIA B200", 2.25e15, 8.0e12, "datasheet"),
    "H200": Ceilings("NVIDIA H200 SXM", 989.4e12, 4.8e12, "datasheet"),
    "H100 PCIE": Ceilings("NVIDIA H100 PCIe", 756.0e12, 2.0e12, "datasheet"),
    "H100 NVL": Ceilings("NVIDIA H100 NVL", 835.0e12, 3.9e12, "datasheet"),
    "H100": Ceilings("NVIDIA H100 SXM", 989.4e12, 3.35e12, "datasheet"),
    "A100": Ceilings("NVIDIA A100 SXM 80GB", 312.0e12, 2.039e12, "datasheet"),
}


def datasheet_ceilings(device_name: str) -> Optional[Ceilings]:
    """Datasheet ceilings for a device name such as ``NVIDIA H200`` (most specific key first)."""
    up = device_name.upper()
    for key in sorted(DATASHEET, key=len, reverse=True):
        if key in up:
            return DATASHEET[key]
    return None


# ----------------------------------------------------------------------------- work


def workload_flops(defn, axes: dict) -> int:
    """FLOPs of the two GEMMs of the 091 backward."""
    env = {**defn.const_axes(), **axes}
    m = int(env["batch_size"]) * int(env["seq_len"])
    n, k = int(env["qkv_size"]), int(env["hidden_size"])
    return 2 * (2 * m * n * k)


def workload_bytes(defn, axes: dict, dtype: Optional[str] = None) -> int:
    """Minimal bytes: every input read once and every output written once (``dtype``: every
    tensor in that dtype instead of the definition's, as a CPU run with ``--dtype`` has them)."""
    total = 0
    for specs, shapes in ((defn.inputs, defn.input_shapes(axes)), (defn.outputs, defn.output_shapes(axes))):
        for name, spec in specs.items():
            shape = shapes[name]
            if shape is None:
                continue
            total += math.prod(shape) * _ITEMSIZE[dtype or spec["dtype"]]
    return total


def sol_time_ms(flops: float, nbytes: float, ceil: Ceilings) -> float:
    return max(flops / ceil.flops_per_s, nbytes / ceil.bytes_per_s) * 1e3


def roofline(defn, axes: dict, ceil: Ceilings, dtype: Optional[str] = None) -> dict:
    f, b = workload_flops(defn, axes), workload_bytes(defn, axes, dtype)
    t_compute, t_memory = f / ceil.flops_per_s * 1e3, b / ceil.bytes_per_s * 1e3
    return {"flops": f, "bytes": b, "arithmetic_intensity": f / b, "t_compute_ms": t_compute,
            "t_memory_ms": t_memory, "sol_ms": max(t_compute, t_memory),
            "bound": "compute" if t_compute >= t_memory else "memory"}


# ----------------------------------------------------------------------------- scores


def sol_score(t: float, t_sol: float, t_base: float) -> Optional[float]:
    """S = 1 / (1 + (T - T_sol) / (T_b - T_sol)) where it is in [0, 1]; None otherwise."""
    s = sol_score_formula(t, t_sol, t_base)
    if s is None or t_base <= t_sol or t < t_sol:
        return None
    return s


def sol_score_formula(t: float, t_sol: float, t_base: float) -> Optional[float]:
    """The formula's value as it falls, also outside [0, 1] (T < T_sol or T_b < T_sol: the row
    is then flagged, see ``trust``); None when it has no value (T_b == T_sol, a missing or
    non-finite time)."""
    if t is None or t_base is None or t_sol is None:
        return None
    if not all(math.isfinite(x) for x in (t, t_sol, t_base)) or t <= 0 or t_base <= 0 or t_base == t_sol:
        return None
    d = 1.0 + (t - t_sol) / (t_base - t_sol)
    return (1.0 / d) if d != 0 else None


def geomean(xs: Iterable[float]) -> Optional[float]:
    xs = [float(x) for x in xs]
    if not xs or any(x <= 0 for x in xs):
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def aggregate(times: list, base_times: list, sol_times: list) -> dict:
    """Run-level figures from per-workload latencies (None where not measured/correct).

    Mean SOL score over the workloads: a failed or missing one counts 0 (a failed workload
    scores nothing); a correct one its formula value as it falls (outside [0, 1] only on rows
    ``trust`` flags); a workload where the formula has no value (T_b == T_sol, flagged) is left
    out of the mean. Speed-up as mean of ratios and geomean, and how many workloads were
    faster than the baseline.
    """
    scores, ratios, faster = [], [], 0
    for t, tb, ts in zip(times, base_times, sol_times):
        if t is None or tb is None:
            scores.append(0.0)
            continue
        scores.append(sol_score_formula(t, ts, tb))
        ratios.append(tb / t)
        faster += int(t < tb)
    n = len(times)
    defined = [s for s in scores if s is not None]
    return {"sol_score": (sum(defined) / len(defined)) if defined else None, "sol_scores": scores,
            "avg_speedup": (sum(ratios) / len(ratios)) if ratios else None,
            "geomean_speedup": geomean(ratios), "fast_1_count": faster, "fast_1_total": n}


# ----------------------------------------------------------------------------- measured


def _times_ms(fn, device: torch.device, reps: int) -> list:
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize(device)
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


CPU_SLOW_MATMUL_S = 0.05  # a CPU's bf16 512^3 matmul slower than this (< 5.4 GFLOP/s) is left out of its bound


def measure_ceilings(device, name: str, when: str = "start", dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """A matmul and a device copy, best of a few: achievable FLOP/s and bytes/s. On a GPU the
    matmul is in ``dtype`` (bf16 by default); on a CPU the faster of fp32 (what the CPU path
    multiplies in, fast on every x86 CPU) and bf16 (the reference's, where it is fast: one probe
    call, since without AVX-512 BF16 it is ~180x slower than fp32 and would take minutes). The
    repetitions' summaries (their spread says how steady the bound is) and, on a CPU, how long this
    process waited for a processor meanwhile go into ``detail``."""
    from .timing import HostWait, summarize

    device = torch.device(device)
    gpu = device.type == "cuda"
    n = 8192 if gpu else 512
    reps = 10
    matmuls = {}
    with HostWait() as hw:
        # a CPU run in float32 (--dtype) is bounded by the float32 matmul it runs
        cpu_dts = [torch.float32] if dtype == torch.float32 else [torch.float32, torch.bfloat16]
        for dt in ([dtype] if gpu else cpu_dts):
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            c = torch.empty(n, n, device=device, dtype=dt)
            if not gpu and dt == torch.bfloat16:
                torch.mm(a, b, out=c)  # the first call JITs (oneDNN)
                t0 = time.perf_counter()
                torch.mm(a, b, out=c)
                if time.perf_counter() - t0 > CPU_SLOW_MATMUL_S:
                    matmuls[dt] = None  # measured slow: not this CPU's bound
                    continue
            matmuls[dt] = _times_ms(lambda: torch.mm(a, b, out=c), device, reps=reps)
            del a, b, c
        nbytes = (1 << 30) if gpu else (64 << 20)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        src.fill_(1)
        cp = _times_ms(lambda: dst.copy_(src), device, reps=reps)
    best = min((dt for dt, ms in matmuls.items() if ms), key=lambda dt: min(matmuls[dt]))
    flops = 2 * n ** 3 / (min(matmuls[best]) * 1e-3)
    bw = 2 * nbytes / (min(cp) * 1e-3)
    del src, dst
    label = lambda dt: str(dt).replace("torch.", "")  # noqa: E731
    detail = {"when": when, "matmul_dtype": label(best), "matmul_n": n, "matmul_ms": summarize(matmuls[best]),
              "copy_ms": summarize(cp), "host_wait": None if gpu else hw.fraction}
    if not gpu:
        detail["matmul_ms_by_dtype"] = {label(dt): (summarize(ms) if ms else f"left out: one call > {CPU_SLOW_MATMUL_S} s")
                                        for dt, ms in matmuls.items()}
    return Ceilings(name, flops, bw, "measured", detail)


def best_ceilings(measurements: list) -> Ceilings:
    """The highest FLOP/s and the highest bytes/s of several measurements of one device (the
    bound is what the device can do; a measurement slowed by other load only understates it).
    ``detail.chosen``: the measurement each figure came from."""
    f = max(measurements, key=lambda m: m.flops_per_s)
    b = max(measurements, key=lambda m: m.bytes_per_s)
    return Ceilings(f.name, f.flops_per_s, b.bytes_per_s, "measured",
                    {"flops_from": f.detail.get("when"), "bytes_from": b.detail.get("when"),
                     "chosen": {"flops": f.detail, "bytes": b.detail},
                     "measurements": [m.detail for m in measurements]})


# ----------------------------------------------------------------------------- CPU GEMM rates


def cpu_native_bf16() -> Optional[bool]:
    """Whether this x86 CPU lists AVX-512 BF16 or AMX-BF16 (torch's fast CPU bf16 GEMMs), None
    where its flags cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return None


def cpu_gemm_rates(m: int = 16, k: int = 1024, n: int = 1024) -> dict:
    """FLOP/s of one ``a @ w`` (both row-major: the layout of the reference's dX GEMM) in bf16 and
    in fp32 on this CPU, the better of two calls after one warm-up."""
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        a, w = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        best = math.inf
        for i in range(3):
            t0 = time.perf_counter()
            torch.mm(a, w)
            if i:
                best = min(best, time.perf_counter() - t0)
        out[str(dt).replace("torch.", "")] = 2 * m * k * n / max(best, 1e-9)
    return out
