"""KernelIndex run records: digests, the manifest, and a local run store.

A record has the structure of a KernelIndex record of a SOL-ExecBench run::

    {"run": {"apiVersion": "kernelindex.dev/v1alpha1", "kind": "BenchmarkRun",
             "metadata": {name, title, labels},
             "spec": {status, timing: {latencyNs: {mean, median}, primaryStatistic}, observedAt,
                      sourceNative: {source, benchmark, metrics: {sol_score, latency_ms,
                                     avg_speedup, fast_1_count, fast_1_total},
                                     workloads: [{workload, sol_score, flags, latency_ms: {n, min,
                                                  p20, median, p80, max, mean}, spread, ...}]},
                      trust: {flagged, flaggedWorkloads, workloads, flags: {flag: count}, rules},
                      protocolDigest, workloadDigest, environmentDigest, implementationDigest}},
     "protocol": {"kind": "BenchmarkProtocol", ...},
     "environment": {"kind": "ExecutionEnvironment", ...}}

Digests are ``sha256:`` + the hex digest of canonical JSON (sorted keys, no spaces) of
the protocol, the workload set, the environment and the implementation's sources:
the same code on the same setup gives the same digests; a change to one changes its
digest. Runs of the same definition, device and protocol (and workload set) form a
**comparison group**, ranked by SOL score, flagged runs (``spec.trust``: rows that cannot be
trusted, ``bench.trust``) after every unflagged one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional

import torch

API_VERSION = "kernelindex.dev/v1alpha1"
STORE_ENV = "FUSEDQKV_RUN_STORE"


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def digest(obj) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def package_root() -> Path:
    return Path(__file__).resolve().parents[1]


def source_tree(subdirs: Iterable[str] = ("kernels", "ops"), root: Optional[Path] = None) -> dict:
    """relative path -> sha256 of the content, of every .py file under the package's subdirs."""
    root = Path(root) if root is not None else package_root()
    out = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*.py")):
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ----------------------------------------------------------------------------- environment


def _nvidia_driver() -> Optional[str]:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> Optional[str]:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def environment(device) -> dict:
    """The ExecutionEnvironment: what the timings depend on, nothing that changes run to run."""
    device = torch.device(device)
    env = {"kind": "ExecutionEnvironment", "deviceType": device.type,
           "software": {"python": platform.python_version(), "torch": torch.__version__,
                        "triton": _version("triton"), "cuda": torch.version.cuda,
                        "platform": f"{platform.system()}-{platform.machine()}"}}
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        env["gpu"] = {"name": p.name, "count": 1, "computeCapability": f"{p.major}.{p.minor}",
                      "smCount": p.multi_processor_count, "memoryBytes": int(p.total_memory),
                      "l2CacheBytes": int(getattr(p, "L2_cache_size", 0) or 0)}
        env["software"]["driver"] = _nvidia_driver()
        env["hardwareName"] = p.name
    else:
        env["cpu"] = {"model": _cpu_model(), "threads": torch.get_num_threads()}
        env["hardwareName"] = "CPU: " + env["cpu"]["model"]
    return env


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "x"


def comparison_group(definition: str, hardware: str, protocol_digest: str, workload_digest: str) -> str:
    """Key of a comparison group: the same definition (and workload set), device and protocol."""
    return f"{slug(definition)[:40]}.{slug(hardware)[:40]}.{protocol_digest[7:19]}{workload_digest[7:13]}"


# ----------------------------------------------------------------------------- record


def make_record(*, definition: str, implementation: str, impl_label: str, protocol: dict, workloads: dict,
                env: dict, implementation_sources: dict, metrics: dict, latency_ms_mean: Optional[float],
                latency_ms_median: Optional[float], primary_statistic: str, status: str, observed_at: str,
                cpu_run: bool, trust: Optional[dict] = None, per_workload: Optional[list] = None) -> dict:
    """``trust``: the run's flags (``bench.trust.summarize_flags`` and the rules); ``per_workload``:
    per workload its score, flags and the spread of its repetitions (min/p20/median/p80/max)."""
    pd, wd, ed, idg = digest(protocol), digest(workloads), digest(env), digest(implementation_sources)
    hw = env.get("hardwareName", "unknown")
    group = comparison_group(definition, hw, pd, wd)
    stamp = re.sub(r"[^0-9]", "", observed_at)[:14]
    name = f"{slug(definition)[:32]}-{slug(implementation)}-{stamp}-{idg[7:15]}"
    title = f"{implementation} on {definition} ({'CPU run, reduced workloads' if cpu_run else hw})"
    timing = {"latencyNs": {}, "primaryStatistic": primary_statistic}
    if latency_ms_mean is not None:
        timing["latencyNs"]["mean"] = int(round(latency_ms_mean * 1e6))
    if latency_ms_median is not None:
        timing["latencyNs"]["median"] = int(round(latency_ms_median * 1e6))
    run = {
        "apiVersion": API_VERSION,
        "kind": "BenchmarkRun",
        "metadata": {
            "name": name,
            "title": title,
            "labels": {"definition": definition, "implementation": implementation, "hardware": hw,
                       "deviceType": env.get("deviceType", "cpu"), "cpuRun": "true" if cpu_run else "false",
                       "comparisonGroup": group,
                       "flagged": "true" if (trust or {}).get("flagged") else "false"},
            "annotations": {"implementationLabel": impl_label},
        },
        "spec": {
            "status": status,
            "timing": timing,
            "observedAt": observed_at,
            "sourceNative": {"source": "SOL-ExecBench", "benchmark": definition,
                             "metrics": {k: metrics.get(k) for k in
                                         ("sol_score", "latency_ms", "avg_speedup", "fast_1_count", "fast_1_total")}},
            "protocolDigest": pd,
            "workloadDigest": wd,
            "environmentDigest": ed,
            "implementationDigest": idg,
        },
    }
    if trust is not None:
        run["spec"]["trust"] = trust
    if per_workload is not None:
        run["spec"]["sourceNative"]["workloads"] = per_workload
    return {"run": run, "protocol": protocol, "environment": env}


REQUIRED_RUN_SPEC = ("status", "timing", "observedAt", "sourceNative", "protocolDigest", "workloadDigest",
                     "environmentDigest", "implementationDigest")
REQUIRED_METRICS = ("sol_score", "latency_ms", "avg_speedup", "fast_1_count", "fast_1_total")


def validate_record(rec: dict) -> list:
    """Structural problems of a record (empty list when it has the KernelIndex shape)."""
    errs = []
    run = rec.get("run") if isinstance(rec, dict) else None
    if not isinstance(run, dict):
        return ["missing run"]
    if run.get("apiVersion") != API_VERSION:
        errs.append("run.apiVersion")
    if run.get("kind") != "BenchmarkRun":
        errs.append("run.kind")
    md = run.get("metadata", {})
    for k in ("name", "title", "labels"):
        if k not in md:
            errs.append(f"run.metadata.{k}")
    spec = run.get("spec", {})
    for k in REQUIRED_RUN_SPEC:
        if k not in spec:
            errs.append(f"run.spec.{k}")
    if "mean" not in spec.get("timing", {}).get("latencyNs", {}):
        errs.append("run.spec.timing.latencyNs.mean")
    if "primaryStatistic" not in spec.get("timing", {}):
        errs.append("run.spec.timing.primaryStatistic")
    sn = spec.get("sourceNative", {})
    for k in ("source", "benchmark", "metrics"):
        if k not in sn:
            errs.append(f"run.spec.sourceNative.{k}")
    for k in REQUIRED_METRICS:
        if k not in sn.get("metrics", {}):
            errs.append(f"run.spec.sourceNative.metrics.{k}")
    for k in ("protocolDigest", "workloadDigest", "environmentDigest", "implementationDigest"):
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(spec.get(k, ""))):
            errs.append(f"run.spec.{k} format")
    if rec.get("protocol", {}).get("kind") != "BenchmarkProtocol":
        errs.append("protocol.kind")
    if rec.get("environment", {}).get("kind") != "ExecutionEnvironment":
        errs.append("environment.kind")
    if not errs:
        if digest(rec["protocol"]) != spec["protocolDigest"]:
            errs.append("protocolDigest does not match protocol")
        if digest(rec["environment"]) != spec["environmentDigest"]:
            errs.append("environmentDigest does not match environment")
    return errs


# ----------------------------------------------------------------------------- store


def store_dir(path: Optional[str] = None) -> Path:
    if path:
        return Path(path).expanduser()
    env = os.environ.get(STORE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fusedqkv" / "runs"


def save_run(rec: dict, store: Optional[str] = None) -> Path:
    d = store_dir(store)
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{rec['run']['metadata']['name']}.json"
    p.write_text(json.dumps(rec, indent=1, sort_keys=True))
    return p


def load_runs(store: Optional[str] = None) -> list:
    d = store_dir(store)
    out = []
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not validate_record(rec):
            out.append(rec)
    return out


def group_of(rec: dict) -> str:
    return rec["run"]["metadata"]["labels"]["comparisonGroup"]


def _score(rec: dict) -> float:
    s = rec["run"]["spec"]["sourceNative"]["metrics"].get("sol_score")
    return -1.0 if s is None else float(s)


def is_flagged(rec: dict) -> bool:
    """A run some of whose rows cannot be trusted (a score outside [0, 1], an untrusted bound,
    noisy or contended timings: ``bench.trust``). Records older than the flags count as unflagged."""
    return bool(rec["run"]["spec"].get("trust", {}).get("flagged"))


def rank(records: list) -> list:
    """Records of one group, best first: unflagged runs before flagged ones, then SOL score
    descending, then lower latency, then older."""
    def key(r):
        lat = r["run"]["spec"]["timing"]["latencyNs"].get("mean", float("inf"))
        return (is_flagged(r), -_score(r), lat, r["run"]["spec"]["observedAt"], r["run"]["metadata"]["name"])
    return sorted(records, key=key)


def groups(records: list) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(group_of(r), []).append(r)
    return {g: rank(rs) for g, rs in out.items()}


def compare(rec: dict, best: dict) -> dict:
    """A run against its group's #1: metric by metric, and the ratio of mean latencies."""
    a = rec["run"]["spec"]["sourceNative"]["metrics"]
    b = best["run"]["spec"]["sourceNative"]["metrics"]
    out = {"run": rec["run"]["metadata"]["name"], "best": best["run"]["metadata"]["name"], "metrics": {}}
    for k in REQUIRED_METRICS:
        x, y = a.get(k), b.get(k)
        out["metrics"][k] = {"run": x, "best": y, "delta": (x - y) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None}
    la = rec["run"]["spec"]["timing"]["latencyNs"].get("mean")
    lb = best["run"]["spec"]["timing"]["latencyNs"].get("mean")
    out["latency_ratio_vs_best"] = (la / lb) if la and lb else None
    out["same_implementation"] = rec["run"]["spec"]["implementationDigest"] == best["run"]["spec"]["implementationDigest"]
    out["flagged"] = {"run": is_flagged(rec), "best": is_flagged(best)}
    return out
