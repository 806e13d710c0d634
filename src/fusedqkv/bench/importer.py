"""Records from outside ``fusedqkv bench``: NVIDIA's evaluator's traces, and published records.

``read_source`` tells the two apart by content (``fusedqkv runs import FILE`` is one command):

* **traces** (``traces.jsonl`` of SOL-ExecBench's evaluator: one JSON object per workload with
  ``definition``, ``workload``, ``solution`` and ``evaluation``) become a record of fusedqkv's own
  form (``record_from_traces``): protocol "SOL-ExecBench evaluation stack" at its version, timer
  ``harness_reported`` (the evaluator produced the latencies), primary statistic ``mean``; the
  environment the traces report; metrics as the leaderboard computes them (below);
* a **KernelIndex record** (``{"run", "protocol", "environment"}``, e.g. a leaderboard run) is
  checked (``check_manifest``): one that fusedqkv wrote has every digest recomputed, and a
  mismatch is an error; any other is external, stored as published and marked unverified.

Metrics of traces, per workload T = the evaluator's ``latency_ms``, T_b = its
``reference_latency_ms`` (the reference, same run, same clock): ``latency_ms`` the mean of T over
the passed workloads, ``avg_speedup`` the mean of the evaluator's ``speedup_factor``,
``fast_1_count`` the workloads with a speed-up over 1 (of ``fast_1_total``, every workload of the
traces), ``sol_score`` the mean of S = 1/(1 + (T - T_sol)/(T_b - T_sol)), a failed workload 0
(``roofline.aggregate``). T_sol is the dataset's ``sol_ms`` on a B200 (the GPU it was derived
for); on another GPU the roofline of its datasheet ceilings (``roofline``); on a GPU without
datasheet ceilings there is no T_sol, and ``sol_score`` is left out (None) and the record says so.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from pathlib import Path
from typing import Optional

from . import problem, records, roofline, trust

HARNESS = "SOL-ExecBench evaluation stack"
COMPARATOR = "sol_execbench_eval"
TIMER = "harness_reported"
# where a traces' environment may name the stack's version (the evaluator's own traces do not yet)
VERSION_KEYS = ("sol_execbench", "sol-execbench", "evaluation_stack", "stack_version")


class RecordImportError(Exception):
    """A file that cannot become a record; the message names what is wrong, in one line."""


# ----------------------------------------------------------------------------- detection


def read_source(path) -> tuple:
    """("traces", [objects]) or ("manifest", object), by the file's content."""
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise RecordImportError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        if "run" in obj or "protocol" in obj:
            return "manifest", obj
        if "evaluation" in obj and "workload" in obj:  # a traces file of one workload
            return "traces", [obj]
        raise RecordImportError(f"{path}: expected a KernelIndex record (run, protocol, environment) or the "
                                f"evaluator's traces.jsonl; got a JSON object with keys {', '.join(sorted(obj)[:6])}")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    traces = []
    for i, ln in enumerate(lines, 1):
        try:
            t = json.loads(ln)
        except ValueError:
            raise RecordImportError(f"{path}: expected a KernelIndex record (JSON) or traces.jsonl (one JSON object "
                                    f"per line); line {i} is not JSON") from None
        if not isinstance(t, dict) or "evaluation" not in t or "workload" not in t:
            raise RecordImportError(f"{path}: line {i}: expected an evaluator trace (definition, workload, solution, "
                                    "evaluation)")
        traces.append(t)
    if not traces:
        raise RecordImportError(f"{path}: empty; expected a KernelIndex record or the evaluator's traces.jsonl")
    return "traces", traces


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- traces


def _one(traces: list, key: str, what: str):
    vals = {json.dumps(t.get(key), sort_keys=True) for t in traces}
    if len(vals) != 1:
        raise RecordImportError(f"traces: expected one {what} for every workload, got {len(vals)}: "
                                + ", ".join(sorted(vals))[:200])
    return traces[0].get(key)


def stack_version(traces: list, given: Optional[str]) -> str:
    if given:
        return given
    for t in traces:
        libs = ((t.get("evaluation") or {}).get("environment") or {}).get("libs") or {}
        for k in VERSION_KEYS:
            if libs.get(k):
                return str(libs[k])
        for k in VERSION_KEYS:
            if t.get(k):
                return str(t[k])
    raise RecordImportError("--stack-version: the traces do not name the evaluation stack's version "
                            "(evaluation.environment.libs); give it, e.g. --stack-version v1.0 or the evaluator's commit")


def traces_protocol(version: str) -> dict:
    """The protocol of an evaluator run, in the KernelIndex form the leaderboard's records use."""
    return {
        "apiVersion": records.API_VERSION, "kind": "BenchmarkProtocol",
        "metadata": {"name": f"sol-execbench-{records.slug(version)}", "title": f"{HARNESS} {version}"},
        "spec": {
            "harness": {"name": HARNESS, "version": version},
            "correctness": {"reference": "definition reference implementation", "comparator": COMPARATOR},
            "measurement": {"timer": TIMER, "primaryStatistic": "mean"},
            "comparability": {"family": "sol_execbench_evaluator",
                              "notes": "Latencies as NVIDIA's evaluator reported them (its timer); suite mean "
                                       "over the workloads. Comparable only within one definition, GPU type and "
                                       "evaluation stack version."},
        },
    }


def traces_environment(env: dict, version: str) -> dict:
    hw = str(env.get("hardware") or "unknown")
    return {
        "apiVersion": records.API_VERSION, "kind": "ExecutionEnvironment",
        "metadata": {"name": f"sol-execbench-{records.slug(hw)}-{records.slug(version)}",
                     "title": f"SOL-ExecBench {hw}, stack {version}"},
        "spec": {"hardware": {"vendor": "nvidia" if "nvidia" in hw.lower() else "unknown", "product": hw},
                 "software": {"libraries": {**(env.get("libs") or {}), "evaluation_stack": version}}},
        "hardwareName": hw, "deviceType": "cuda",
    }


def sol_times(defn: Optional[problem.Definition], hardware: str, traces: list) -> tuple:
    """(uuid -> T_sol in ms or None, the SOL source in words)."""
    if defn is None:
        return {}, "none: the definition is not one fusedqkv knows (no axes for a roofline); sol_score left out"
    by_uuid = {w.uuid: w for w in defn.workloads}
    if "B200" in hardware.upper():
        return ({t["workload"]["uuid"]: getattr(by_uuid.get(t["workload"]["uuid"]), "b200_sol_ms", None)
                 for t in traces}, "the dataset's sol_ms (B200, metadata.json)")
    ceil = roofline.datasheet_ceilings(hardware)
    if ceil is None:
        return {}, (f"none: the dataset's sol_ms is for the B200 and {hardware} has no datasheet ceilings "
                    "(bench/roofline.py); sol_score left out")
    out = {}
    for t in traces:
        axes = {**t["workload"]["axes"]}
        out[t["workload"]["uuid"]] = roofline.roofline(defn, axes, ceil)["sol_ms"]
    return out, (f"roofline of {ceil.name} datasheet ceilings ({ceil.flops_per_s / 1e12:.1f} TFLOP/s dense bf16, "
                 f"{ceil.bytes_per_s / 1e12:.2f} TB/s): two-GEMM FLOPs, minimal bytes (fusedqkv.bench.roofline); "
                 "the dataset's sol_ms is for the B200")


def _check_traces(traces: list) -> None:
    for i, t in enumerate(traces, 1):
        w, ev = t.get("workload"), t.get("evaluation")
        missing = [k for k, ok in (("definition", isinstance(t.get("definition"), str)),
                                   ("solution", isinstance(t.get("solution"), str)),
                                   ("workload.uuid", isinstance(w, dict) and "uuid" in w),
                                   ("workload.axes", isinstance(w, dict) and isinstance(w.get("axes"), dict)),
                                   ("evaluation.status", isinstance(ev, dict) and "status" in ev)) if not ok]
        if missing:
            raise RecordImportError(f"traces: line {i} lacks {', '.join(missing)}")


def record_from_traces(traces: list, version: Optional[str] = None, solution: Optional[dict] = None) -> dict:
    """A record of an evaluator run (see the module docstring)."""
    _check_traces(traces)
    name_def = _one(traces, "definition", "definition")
    sol_name = _one(traces, "solution", "solution")
    env_raw = _one([t["evaluation"] for t in traces], "environment", "environment")
    if not isinstance(env_raw, dict) or not env_raw.get("hardware"):
        raise RecordImportError("traces: evaluation.environment.hardware is missing (the GPU the run is of)")
    version = stack_version(traces, version)
    impl_sources = {"solution": sol_name}
    sol_digest = None
    if solution is not None:
        from .solution import sources_digest

        if solution.get("name") != sol_name:
            raise RecordImportError(f"--solution: its name {solution.get('name')!r} is not the traces' solution "
                                    f"{sol_name!r}")
        impl_sources = {s["path"]: records.sha256_text(s["content"]) for s in solution.get("sources", [])}
        sol_digest = sources_digest(solution)  # == digest(impl_sources)
    try:
        defn = problem.load_definition(name_def)
    except KeyError:
        defn = None
    hw = env_raw["hardware"]
    protocol, env = traces_protocol(version), traces_environment(env_raw, version)
    sols, sol_source = sol_times(defn, hw, traces)

    rows, times, bases, tsols, failed, row_flags = [], [], [], [], [], []
    known = {w.uuid: w for w in defn.workloads} if defn else {}
    for t in traces:
        w, ev = t["workload"], t["evaluation"]
        perf = ev.get("performance") or {}
        passed = ev["status"] == "PASSED" and perf.get("latency_ms") is not None
        kw = known.get(w["uuid"])
        name = (problem.Workload(kw.index, kw.uuid, dict(w["axes"]), kw.eps, kw.atol, kw.rtol).name if kw
                else w["uuid"][:8])
        lat, ref = perf.get("latency_ms"), perf.get("reference_latency_ms")
        sp = perf.get("speedup_factor") if perf.get("speedup_factor") is not None else (
            (ref / lat) if (ref and lat) else None)
        t_sol = sols.get(w["uuid"])
        s = roofline.sol_score_formula(lat, t_sol, ref) if passed else 0.0
        flags = trust.score_flags(lat, t_sol, ref) if passed else []
        if not passed:
            failed.append(f"{name} ({ev['status']})")
        rows.append({"workload": name, "uuid": w["uuid"], "axes": dict(w["axes"]), "status": ev["status"],
                     "latency_ms": lat if passed else None, "reference_latency_ms": ref, "speedup": sp,
                     "sol_ms": t_sol, "sol_score": s if t_sol is not None else None, "flags": flags,
                     "correctness": ev.get("correctness"), "timestamp": ev.get("timestamp")})
        times.append(lat if passed else None)
        bases.append(ref)
        tsols.append(t_sol)
        row_flags.append(flags)
    missing = [w.name for w in (defn.workloads if defn else ()) if w.uuid not in {r["uuid"] for r in rows}]
    passed_rows = [r for r in rows if r["latency_ms"] is not None]
    lats = [r["latency_ms"] for r in passed_rows]
    speedups = [r["speedup"] for r in passed_rows if r["speedup"] is not None]
    agg = roofline.aggregate(times, bases, tsols) if sols else None
    metrics = {
        "latency_ms": statistics.fmean(lats) if lats else None,
        "avg_speedup": statistics.fmean(speedups) if speedups else None,
        "fast_1_count": sum(1 for x in speedups if x > 1.0),
        "fast_1_total": len(rows),
        "sol_score": agg["sol_score"] if agg else None,
    }
    status = "failed" if (failed or missing) else "passed"
    observed = max((str(r["timestamp"]) for r in rows if r.get("timestamp")), default="unknown")
    workload_set = {"definition": name_def, "workloads": sorted((t["workload"] for t in traces),
                                                                key=lambda w: w["uuid"])}
    pd, wd, ed, idg = (records.digest(protocol), records.digest(workload_set), records.digest(env),
                       records.digest(impl_sources))
    stamp = re.sub(r"[^0-9]", "", observed)[:14]
    rname = f"{records.slug(name_def)[:32]}-sol-execbench-{records.slug(hw)}-{stamp}-{idg[7:15]}"
    notes = []
    if failed:
        notes.append("failed workloads: " + ", ".join(failed))
    if missing:
        notes.append("workloads of the definition missing from the traces: " + ", ".join(missing))
    if metrics["sol_score"] is None:
        notes.append("sol_score left out: " + sol_source)
    run = {
        "apiVersion": records.API_VERSION, "kind": "BenchmarkRun",
        "metadata": {
            "name": rname,
            "title": f"{sol_name} on {name_def} ({hw}, {HARNESS} {version})",
            "labels": {"definition": name_def, "implementation": sol_name, "hardware": hw, "deviceType": "cuda",
                       "cpuRun": "false", "origin": "evaluator-traces",
                       "flagged": "true" if any(row_flags) else "false"},
            "annotations": {"recordForm": records.RECORD_FORM, "solutionName": sol_name,
                            "implementationLabel": f"exported solution {sol_name}",
                            **({"solutionDigest": sol_digest} if sol_digest else
                               {"implementationDigestOf": "the solution's name only (no solution.json given)"})},
        },
        "spec": {
            "status": status,
            "timing": {"latencyNs": {"mean": int(round(metrics["latency_ms"] * 1e6))} if lats else {"mean": None},
                       "primaryStatistic": "mean"},
            "observedAt": observed,
            "sourceNative": {"source": "sol-execbench", "benchmark": name_def, "metrics": metrics,
                             "solSource": sol_source,
                             "baseline": "the evaluator's reference_latency_ms (the reference, same run)",
                             "workloads": rows, "workloadSet": workload_set,
                             "implementationSources": impl_sources,
                             **({"failedWorkloads": failed} if failed else {}),
                             **({"missingWorkloads": missing} if missing else {}),
                             **({"notes": notes} if notes else {})},
            "trust": {**trust.summarize_flags(row_flags), "rules": {"flags": "score flags only (below_sol, "
                                                                             "bound_not_below_baseline): the "
                                                                             "evaluator's timings are as reported"}},
            "protocolDigest": pd, "workloadDigest": wd, "environmentDigest": ed, "implementationDigest": idg,
        },
    }
    if lats:
        run["spec"]["timing"]["latencyNs"]["median"] = int(round(statistics.median(lats) * 1e6))
    rec = {"run": run, "protocol": protocol, "environment": env}
    # the leaderboard's groups: one definition, GPU type and stack version (a published record of
    # the same GPU and version lands in this group)
    run["metadata"]["labels"]["comparisonGroup"] = records.harness_group(rec)
    return rec


# ----------------------------------------------------------------------------- manifests


def check_manifest(rec: dict, path: str = "manifest") -> dict:
    """The verification of a published record (``records.verify``); RecordImportError naming the
    missing fields, or the digests that do not match in a record fusedqkv wrote."""
    errs = records.structure_errors(rec)
    if errs:
        raise RecordImportError(f"{path}: not a KernelIndex record: missing or malformed {', '.join(errs)}")
    v = records.verify(rec)
    if v["status"] == "mismatch":
        raise RecordImportError(f"{path}: digest mismatch (a record fusedqkv wrote, changed since): "
                                + "; ".join(v["mismatches"]))
    return v


def imported(rec: dict, origin: str, verification: dict, source: str, sha256: str, when: str) -> dict:
    """The record as stored: its run, protocol and environment untouched, and the store's note of
    where it came from and how far its digests hold."""
    return {**{k: rec[k] for k in ("run", "protocol", "environment")},
            "imported": {"origin": origin, "source": source, "sourceSha256": sha256, "importedAt": when,
                         "verification": {k: verification[k] for k in ("form", "status", "checks", "reason")}}}
