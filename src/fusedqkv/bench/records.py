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

Two forms of record live in a store:

* **fusedqkv's own** (``fusedqkv bench``, ``fusedqkv runs import TRACES.jsonl``): the record
  carries what its digests are of (``sourceNative.workloadSet``, ``sourceNative.implementationSources``
  beside the protocol and environment), so every digest is recomputed (``verify``) and a mismatch
  is an error, never accepted;
* **external** (a published KernelIndex record, e.g. a SOL-ExecBench leaderboard run): its
  digests are the publisher's and cannot be recomputed from its contents; it is stored as
  published, marked unverified (``imported.verification``). Its comparison group comes from its
  protocol and environment: one definition, GPU type and evaluation stack version
  (``harness_group``), as the leaderboard's protocol says.

A record's own digest (``record_digest``: its run, protocol and environment) is what a citation
(``citation``) and an attestation (a reproduction's verdict, ``save_attestation``) name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional

import torch

API_VERSION = "kernelindex.dev/v1alpha1"
STORE_ENV = "FUSEDQKV_RUN_STORE"
RECORD_FORM = "fusedqkv/v1"  # annotation of the records fusedqkv writes: every digest recomputable
ATTESTATIONS = "attestations"  # the store's folder of attestations (load_runs reads only the top level)


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
                cpu_run: bool, trust: Optional[dict] = None, per_workload: Optional[list] = None,
                solution_digest: Optional[str] = None) -> dict:
    """``trust``: the run's flags (``bench.trust.summarize_flags`` and the rules); ``per_workload``:
    per workload its score, flags and the spread of its repetitions (min/p20/median/p80/max);
    ``solution_digest``: the sources digest of the solution this implementation exports as."""
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
            "annotations": {"implementationLabel": impl_label, "recordForm": RECORD_FORM},
        },
        "spec": {
            "status": status,
            "timing": timing,
            "observedAt": observed_at,
            "sourceNative": {"source": "SOL-ExecBench", "benchmark": definition,
                             "metrics": {k: metrics.get(k) for k in
                                         ("sol_score", "latency_ms", "avg_speedup", "fast_1_count", "fast_1_total")},
                             # what the workload and implementation digests are of: recomputable (verify)
                             "workloadSet": workloads, "implementationSources": implementation_sources},
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
    if solution_digest is not None:
        run["metadata"]["annotations"]["solutionDigest"] = solution_digest
    return {"run": run, "protocol": protocol, "environment": env}


REQUIRED_RUN_SPEC = ("status", "timing", "observedAt", "sourceNative", "protocolDigest", "workloadDigest",
                     "environmentDigest", "implementationDigest")
REQUIRED_METRICS = ("sol_score", "latency_ms", "avg_speedup", "fast_1_count", "fast_1_total")


def structure_errors(rec: dict) -> list:
    """The fields a record lacks for the KernelIndex shape (empty list when it has it)."""
    errs = []
    run = rec.get("run") if isinstance(rec, dict) else None
    if not isinstance(run, dict):
        return ["missing run"]
    if run.get("apiVersion") != API_VERSION:
        errs.append("run.apiVersion")
    if run.get("kind") != "BenchmarkRun":
        errs.append("run.kind")
    md = run.get("metadata") if isinstance(run.get("metadata"), dict) else {}
    for k in ("name", "title", "labels"):
        if k not in md:
            errs.append(f"run.metadata.{k}")
    spec = run.get("spec") if isinstance(run.get("spec"), dict) else {}
    for k in REQUIRED_RUN_SPEC:
        if k not in spec:
            errs.append(f"run.spec.{k}")
    timing = spec.get("timing") if isinstance(spec.get("timing"), dict) else {}
    if "mean" not in (timing.get("latencyNs") or {}):
        errs.append("run.spec.timing.latencyNs.mean")
    if "primaryStatistic" not in timing:
        errs.append("run.spec.timing.primaryStatistic")
    sn = spec.get("sourceNative") if isinstance(spec.get("sourceNative"), dict) else {}
    for k in ("source", "benchmark", "metrics"):
        if k not in sn:
            errs.append(f"run.spec.sourceNative.{k}")
    for k in REQUIRED_METRICS:
        if k not in (sn.get("metrics") or {}):
            errs.append(f"run.spec.sourceNative.metrics.{k}")
    for k in ("protocolDigest", "workloadDigest", "environmentDigest", "implementationDigest"):
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(spec.get(k, ""))):
            errs.append(f"run.spec.{k} format")
    if not isinstance(rec.get("protocol"), dict) or rec["protocol"].get("kind") != "BenchmarkProtocol":
        errs.append("protocol.kind")
    if not isinstance(rec.get("environment"), dict) or rec["environment"].get("kind") != "ExecutionEnvironment":
        errs.append("environment.kind")
    if not errs and not is_own_form(rec):  # an external record's group comes from these
        errs += [f for f in ("run.spec.sourceNative.benchmark", "environment.spec.hardware.product",
                             "protocol.spec.harness.name", "protocol.spec.harness.version") if _path(rec, f) is None]
    return errs


def _path(obj, dotted: str):
    for k in dotted.split("."):
        if not isinstance(obj, dict) or k not in obj:
            return None
        obj = obj[k]
    return obj


def is_own_form(rec: dict) -> bool:
    """A record fusedqkv wrote (``fusedqkv bench`` or ``runs import`` of traces): its digests are
    recomputable. Records older than the form annotation are known by their group label and protocol."""
    md = rec.get("run", {}).get("metadata", {})
    return (str((md.get("annotations") or {}).get("recordForm", "")).startswith("fusedqkv/")
            or "comparisonGroup" in (md.get("labels") or {})
            or str((rec.get("protocol") or {}).get("name", "")).startswith("sol-execbench-style/"))


def _digest_checks(rec: dict) -> dict:
    """Per digest of the record: "matches", "differs" or "not recomputable" (its object absent)."""
    spec, sn = rec["run"]["spec"], rec["run"]["spec"]["sourceNative"]
    objs = {"protocolDigest": rec.get("protocol"), "environmentDigest": rec.get("environment"),
            "workloadDigest": sn.get("workloadSet"), "implementationDigest": sn.get("implementationSources")}
    return {k: ("not recomputable" if o is None else ("matches" if digest(o) == spec[k] else "differs"))
            for k, o in objs.items()}


_MISMATCH = {"protocolDigest": "protocolDigest does not match protocol",
             "environmentDigest": "environmentDigest does not match environment",
             "workloadDigest": "workloadDigest does not match its workload set (sourceNative.workloadSet)",
             "implementationDigest": "implementationDigest does not match its implementation sources "
                                     "(sourceNative.implementationSources)"}


def digest_mismatches(rec: dict) -> list:
    """What does not match in a record of fusedqkv's own form (its digests, its group label)."""
    checks = _digest_checks(rec)
    out = [_MISMATCH[k] for k, v in checks.items() if v == "differs"]
    labels = rec["run"]["metadata"]["labels"]
    if not out and "comparisonGroup" in labels and labels["comparisonGroup"] != expected_group(rec):
        out.append("labels.comparisonGroup does not match its definition, hardware and digests")
    return out


def validate_record(rec: dict) -> list:
    """Structural problems of a record (empty list when it has the KernelIndex shape) and, for a
    record of fusedqkv's own form, every digest that does not match what it is of."""
    errs = structure_errors(rec)
    if errs or not is_own_form(rec):
        return errs
    return digest_mismatches(rec)


def verify(rec: dict) -> dict:
    """How far a (structurally valid) record's digests hold: ``status`` verified (every digest
    that can be recomputed matches; fusedqkv's form), mismatch (fusedqkv's form, one does not:
    ``mismatches``) or unverified (an external record: its digests are not of its contents in
    this canonical form); ``checks`` per digest, ``reason`` in words."""
    checks = _digest_checks(rec)
    if is_own_form(rec):
        bad = digest_mismatches(rec)
        if bad:
            return {"form": "fusedqkv", "status": "mismatch", "checks": checks, "mismatches": bad,
                    "reason": "; ".join(bad)}
        unchecked = [k for k, v in checks.items() if v == "not recomputable"]
        return {"form": "fusedqkv", "status": "verified", "checks": checks, "mismatches": [],
                "reason": "every digest recomputed from the record matches"
                          + (f" ({', '.join(unchecked)} not recomputable: a record older than sourceNative."
                             "workloadSet/implementationSources)" if unchecked else "")}
    if all(v == "matches" for v in checks.values()):
        return {"form": "external", "status": "verified", "checks": checks, "mismatches": [],
                "reason": "every digest recomputed from the record matches"}
    spec = rec["run"]["spec"]
    return {"form": "external", "status": "unverified", "checks": checks, "mismatches": [],
            "reason": ("its digests cannot be recomputed from its contents: sha256 of the canonical JSON of its "
                       f"protocol is {digest(rec['protocol'])[:19]}..., its protocolDigest {spec['protocolDigest'][:19]}..."
                       if checks["protocolDigest"] == "differs" else
                       "its digests cannot all be recomputed from its contents")
                      + "; stored as published"}


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
    """The store's records: fusedqkv's whose digests hold, and external ones (unverified)."""
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


def run_path(name: str, store: Optional[str] = None) -> Path:
    return store_dir(store) / f"{name}.json"


def find_run(name: str, store: Optional[str] = None) -> Optional[dict]:
    return next((r for r in load_runs(store) if r["run"]["metadata"]["name"] == name), None)


# ----------------------------------------------------------------------------- groups and accessors


def definition_of(rec: dict) -> str:
    return rec["run"]["spec"]["sourceNative"]["benchmark"]


def hardware_of(rec: dict) -> str:
    """The device a record ran on (the GPU type, or ``CPU: model``)."""
    labels, env = rec["run"]["metadata"].get("labels") or {}, rec.get("environment") or {}
    return (labels.get("hardware") or env.get("hardwareName") or _path(env, "spec.hardware.product")
            or "unknown")


def implementation_of(rec: dict) -> str:
    labels = rec["run"]["metadata"].get("labels") or {}
    if labels.get("implementation"):
        return labels["implementation"]
    ext = rec["run"]["spec"]["sourceNative"].get("externalId")
    return f"external #{ext}" if ext else "external"


def timer_of(rec: dict) -> str:
    """The protocol's primary timer (fusedqkv's protocol, or a KernelIndex protocol's measurement)."""
    p = rec.get("protocol") or {}
    return p.get("timer") or _path(p, "spec.measurement.timer") or "unknown"


def harness_group(rec: dict) -> str:
    """Group key of a record measured by an evaluation stack (the leaderboard's rule): one
    definition, GPU type and stack version."""
    h = rec["protocol"]["spec"]["harness"]
    hw = _path(rec, "environment.spec.hardware.product") or hardware_of(rec)
    return f"{slug(definition_of(rec))[:40]}.{slug(hw)[:40]}.{slug(h['name'])[:40]}-{slug(str(h['version']))}"


def expected_group(rec: dict) -> str:
    if _path(rec, "protocol.spec.harness") is not None:
        return harness_group(rec)
    labels, spec = rec["run"]["metadata"]["labels"], rec["run"]["spec"]
    return comparison_group(labels.get("definition", definition_of(rec)), labels.get("hardware", "unknown"),
                            spec["protocolDigest"], spec["workloadDigest"])


def group_of(rec: dict) -> str:
    """Its comparison group: our label on our records; from its protocol on an external one."""
    if is_own_form(rec) and "comparisonGroup" in rec["run"]["metadata"]["labels"]:
        return rec["run"]["metadata"]["labels"]["comparisonGroup"]
    return harness_group(rec)


def group_rule(rec: dict) -> str:
    """In words, what the records of its group share."""
    if _path(rec, "protocol.spec.harness") is not None:
        h = rec["protocol"]["spec"]["harness"]
        return f"definition, GPU type and {h['name']} {h['version']}"
    return "definition, workload set, device and protocol"


# ----------------------------------------------------------------------------- citation


def record_digest(rec: dict) -> str:
    """The digest of a record itself (run, protocol, environment; not the store's bookkeeping)."""
    return digest({k: rec[k] for k in ("run", "protocol", "environment")})


def citation(rec: dict, path) -> str:
    """One line to cite a record by: name, record digest, observed date, where it is stored."""
    md, spec = rec["run"]["metadata"], rec["run"]["spec"]
    return (f"{md['name']}, {record_digest(rec)}, observed {str(spec['observedAt'])[:10]}, {path}")


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
        lat = r["run"]["spec"]["timing"]["latencyNs"].get("mean")
        lat = float("inf") if lat is None else lat  # a run of failed workloads only has none
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


# ----------------------------------------------------------------------------- attestations


def save_attestation(att: dict, store: Optional[str] = None) -> Path:
    d = store_dir(store) / ATTESTATIONS
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{att['metadata']['name']}.json"
    p.write_text(json.dumps(att, indent=1, sort_keys=True))
    return p


def load_attestations(store: Optional[str] = None) -> dict:
    """Subject record name -> its attestations, oldest first."""
    d = store_dir(store) / ATTESTATIONS
    out: dict = {}
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            att = json.loads(p.read_text())
            subject = att["spec"]["subject"]["name"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.setdefault(subject, []).append(att)
    for v in out.values():
        v.sort(key=lambda a: str(a["spec"].get("observedAt", "")))
    return out


# ----------------------------------------------------------------------------- across clocks


class CompareError(Exception):
    """Two records that cannot be put in one table; the message says why."""


def workload_latencies(rec: dict) -> dict:
    """uuid -> {workload, axes, timers: {timer: ms}} of the workloads a record has per-workload
    latencies of (its primary statistic; a failed workload has none)."""
    sn, stat = rec["run"]["spec"]["sourceNative"], rec["run"]["spec"]["timing"]["primaryStatistic"]
    primary = timer_of(rec)
    out = {}
    for w in sn.get("workloads") or []:
        if not w.get("uuid"):
            continue
        ok = w.get("status") in (None, "ok", "PASSED") and w.get("correct") is not False

        def pick(v):
            return v if isinstance(v, (int, float)) else (v or {}).get(stat)

        timers = {primary: pick(w.get("latency_ms")) if ok else None}
        for tm, v in (w.get("otherTimers") or {}).items():
            timers[tm] = pick(v) if ok else None
        axes = {k: w.get("axes", {}).get(k) for k in ("batch_size", "seq_len")}
        out[w["uuid"]] = {"workload": w.get("workload"), "axes": axes, "timers": timers}
    return out


def same_implementation(a: dict, b: dict) -> tuple:
    """(True, False or None, how): whether two records ran the same code -- by the digest of the
    exported solution (a bench record's annotation, an imported traces record's solution.json),
    by the digest prefix in the solution's name, or by equal implementation digests."""
    def ann(r):
        return r["run"]["metadata"].get("annotations") or {}

    sa, sb = ann(a).get("solutionDigest"), ann(b).get("solutionDigest")
    if sa and sb:
        return sa == sb, f"solution digests {sa[:19]} and {sb[:19]}"
    for x, y in ((a, b), (b, a)):
        name, d = ann(x).get("solutionName"), ann(y).get("solutionDigest")
        m = re.search(r"_([0-9a-f]{8})$", str(name or ""))
        if m and d:
            return d[7:15] == m.group(1), f"solution {name} against the exported solution's digest {d[:19]}"
    if a["run"]["spec"]["implementationDigest"] == b["run"]["spec"]["implementationDigest"]:
        return True, "equal implementation digests"
    return None, "not established (neither record names the solution it ran)"


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def cross_clock(a: dict, b: dict) -> dict:
    """One table of two records of one definition and GPU type, per workload (matched by uuid and
    axes): each record's latencies by its timers and the ratios B / A with their geomeans.
    CompareError when they cannot share a table."""
    na, nb = a["run"]["metadata"]["name"], b["run"]["metadata"]["name"]
    if definition_of(a) != definition_of(b):
        raise CompareError(f"{na} is of {definition_of(a)}, {nb} of {definition_of(b)}: records compare only "
                           "within one definition")
    ha, hb = hardware_of(a), hardware_of(b)
    if slug(ha) != slug(hb):
        raise CompareError(f"{na} ran on {ha}, {nb} on {hb}: records compare only within one GPU type "
                           "(a ratio across devices measures the devices, not the clocks)")
    la, lb = workload_latencies(a), workload_latencies(b)
    for n, lw in ((na, la), (nb, lb)):
        if not lw:
            raise CompareError(f"{n} has no per-workload latencies with workload uuids (a published record "
                               "carries suite-level figures only; a bench record older than them lacks uuids)")
    common = [u for u in la if u in lb and la[u]["axes"] == lb[u]["axes"]]
    if not common:
        raise CompareError(f"{na} and {nb} have no workload in common (same uuid and axes)"
                           + (": a CPU run's workloads are reduced" if "true" in (
                               a["run"]["metadata"]["labels"].get("cpuRun"), b["run"]["metadata"]["labels"].get("cpuRun"))
                              else ""))
    ta = list(next(iter(la.values()))["timers"])
    tb = list(next(iter(lb.values()))["timers"])
    pairs = [(x, y) for y in tb for x in ta]
    rows = []
    for u in common:
        wa, wb = la[u]["timers"], lb[u]["timers"]
        ratios = {f"{y}/{x}": (wb.get(y) / wa[x]) if (wb.get(y) and wa.get(x)) else None for x, y in pairs}
        ax = la[u]["axes"]
        rows.append({"workload": la[u]["workload"] or lb[u]["workload"], "uuid": u,
                     "tokens": (ax["batch_size"] or 0) * (ax["seq_len"] or 0),
                     "a": {x: wa.get(x) for x in ta}, "b": {y: wb.get(y) for y in tb}, "ratios": ratios})
    same, how = same_implementation(a, b)
    ga, gb = group_of(a), group_of(b)
    return {"a": na, "b": nb, "timers": {"a": ta, "b": tb}, "rows": rows,
            "geomean": {f"{y}/{x}": _geomean([r["ratios"][f"{y}/{x}"] for r in rows]) for x, y in pairs},
            "only_a": [la[u]["workload"] or u for u in la if u not in common],
            "only_b": [lb[u]["workload"] or u for u in lb if u not in common],
            "same_group": ga == gb, "groups": {"a": ga, "b": gb},
            "same_implementation": same, "implementation_basis": how}
