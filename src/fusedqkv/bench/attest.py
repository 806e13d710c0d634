"""Reproductions: rerun a record's implementation on its workloads under its protocol, and attest.

``reproduce_config`` turns a record that ``fusedqkv bench`` wrote into the ``BenchConfig`` of
the same run (device, workloads at their recorded sizes, repetitions, warm-up, statistic, timers,
ceilings, dtype), refusing -- with the reason -- what this machine cannot rerun: another
harness's protocol, another GPU type (or CPU model), code that is not the record's. After the
run, ``make_attestation`` compares the reproduction with the original by a stated rule (``rule``):

* the same protocol, workload, environment and implementation digests;
* the same status, every workload correct in both;
* per workload, the reproduction's latency (the protocol's timer and statistic) within a factor
  of the original's: 1.10 on a GPU (device clocks), 1.50 on a CPU (a wall clock on a shared
  host; ``bench.trust``).

The attestation names the original by its record digest and states agreement or each discrepancy.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from typing import Optional

import torch

from . import harness, records

TOLERANCE = {"cuda": 1.10, "cpu": 1.50}


def _refuse(msg: str):
    raise harness.BenchError(f"--reproduce: {msg}")


def reproduce_config(rec: dict, progress: bool = True) -> harness.BenchConfig:
    name = rec["run"]["metadata"]["name"]
    proto = rec["protocol"]
    if not records.is_own_form(rec) or "deviceType" not in proto:
        h = records._path(proto, "spec.harness") or {}
        _refuse(f"{name} was measured by {h.get('name', 'another harness')} {h.get('version', '')} "
                f"(timer {records.timer_of(rec)}), not by fusedqkv bench: its protocol cannot be rerun here "
                "(benchmarks/sol_execbench_eval.sh runs NVIDIA's evaluator)".replace("  ", " "))
    v = records.verify(rec)
    if v["status"] != "verified":
        _refuse(f"{name}: {v['reason']}")
    sn = rec["run"]["spec"]["sourceNative"]
    ws = sn.get("workloadSet")
    if not ws:
        _refuse(f"{name} predates records that carry their workload set (sourceNative.workloadSet): "
                "its workloads cannot be rerun at their sizes")
    dev_type = proto["deviceType"]
    rec_hw = records.hardware_of(rec)
    if dev_type == "cuda" and not torch.cuda.is_available():
        _refuse(f"{name} ran on {rec_hw} (a GPU); this machine has no CUDA GPU: a reproduction runs on the "
                "record's GPU type")
    here = records.environment(torch.device(dev_type))["hardwareName"]
    if records.slug(here) != records.slug(rec_hw):
        what = "CPU model" if dev_type == "cpu" else "GPU type"
        _refuse(f"{name} ran on {rec_hw}; this machine is {here}: a reproduction needs the same {what}")
    impl = rec["run"]["metadata"]["labels"].get("implementation")
    if impl not in harness.IMPLEMENTATIONS or harness.IMPLEMENTATIONS[impl].role == "bound":
        _refuse(f"{name}: implementation {impl!r} is not one fusedqkv bench runs")
    ctx = harness.Context(torch.device(dev_type), None, "", harness._reference_source())
    ours = records.digest(harness.IMPLEMENTATIONS[impl].sources(ctx))
    theirs = rec["run"]["spec"]["implementationDigest"]
    if ours != theirs:
        _refuse(f"this checkout's {impl} (implementation digest {ours[:19]}) is not the record's ({theirs[:19]}): "
                "a reproduction reruns the record's code; check out the commit that wrote it")
    reps, warmup = proto["repetitions"], proto["warmup"]
    budget = reps.get("budgetS") if isinstance(reps, dict) else None
    names = [f"w{w['index']:02d}_b{w['axes']['batch_size']}_s{w['axes']['seq_len']}" for w in ws["workloads"]]
    return harness.BenchConfig(
        device=dev_type, workloads=names, implementations=[impl],
        reps=reps if isinstance(reps, int) else None, warmup=warmup if isinstance(warmup, int) else None,
        max_tokens=ws.get("maxTokens"), span="kernel_span" in proto.get("timers", []),
        span_source=proto.get("spanSource", "auto"), statistic=proto["statistic"],
        measure_ceilings=dev_type == "cuda" and str(proto.get("sol", {}).get("ceilings", "")).startswith("measured"),
        progress=progress, definition=ws["definition"], time_budget=budget, dtype=proto.get("inputDtype"))


def rule(device_type: str, statistic: str, timer: str) -> dict:
    tol = TOLERANCE[device_type]
    return {"digests": "the same protocol, workload, environment and implementation digests",
            "status": "the same status; every workload correct in both",
            "latency": f"per workload, the reproduction's {timer} {statistic} within a factor {tol:g} of the "
                       f"original's (ratio {1 / tol:.3f} to {tol:.3f})",
            "tolerance": tol}


def _per_workload(rec: dict) -> dict:
    stat = rec["run"]["spec"]["timing"]["primaryStatistic"]
    out = {}
    for w in rec["run"]["spec"]["sourceNative"].get("workloads") or []:
        lat = w.get("latency_ms")
        out[w.get("uuid") or w["workload"]] = {"workload": w["workload"], "correct": w.get("correct"),
                                                "ms": lat.get(stat) if isinstance(lat, dict) else lat,
                                                "flags": w.get("flags") or []}
    return out


def make_attestation(original: dict, repro: dict, observed_at: Optional[str] = None) -> dict:
    o_spec, r_spec = original["run"]["spec"], repro["run"]["spec"]
    dev = original["protocol"]["deviceType"]
    r = rule(dev, o_spec["timing"]["primaryStatistic"], original["protocol"]["timer"])
    tol = r["tolerance"]
    disc = []
    for k in ("protocolDigest", "workloadDigest", "environmentDigest", "implementationDigest"):
        if o_spec[k] != r_spec[k]:
            obj = {"protocolDigest": "protocol", "environmentDigest": "environment"}.get(k)
            keys = ""
            if obj:
                a, b = original[obj], repro[obj]
                diff = sorted(x for x in set(a) | set(b) if a.get(x) != b.get(x))
                keys = f" ({', '.join(diff)})" if diff else ""
            disc.append(f"{k} differs{keys}: {o_spec[k][:19]} vs {r_spec[k][:19]}")
    if o_spec["status"] != r_spec["status"]:
        disc.append(f"status {o_spec['status']} vs {r_spec['status']}")
    po, pr = _per_workload(original), _per_workload(repro)
    rows = []
    for key, w in po.items():
        x = pr.get(key)
        if x is None:
            disc.append(f"{w['workload']}: not in the reproduction")
            continue
        ratio = (x["ms"] / w["ms"]) if (x["ms"] and w["ms"]) else None
        within = ratio is not None and 1 / tol <= ratio <= tol
        rows.append({"workload": w["workload"], "original_ms": w["ms"], "reproduced_ms": x["ms"], "ratio": ratio,
                     "within": within, "correct": x["correct"]})
        if x["correct"] is False or w["correct"] is False:
            disc.append(f"{w['workload']}: correct {w['correct']} in the original, {x['correct']} in the reproduction")
        if not within:
            disc.append(f"{w['workload']}: x{ratio:.3f} ({x['ms']:.4g} ms vs {w['ms']:.4g} ms)" if ratio is not None
                        else f"{w['workload']}: no latency to compare")
    ratios = [x["ratio"] for x in rows if x["ratio"]]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None
    notes = []
    if records.is_flagged(original) or records.is_flagged(repro):
        notes.append("flagged run(s) (bench.trust): timings that cannot be trusted; the agreement is indicative")
    when = observed_at or r_spec["observedAt"]
    stamp = re.sub(r"[^0-9]", "", when)[:14]
    name = original["run"]["metadata"]["name"]
    return {
        "apiVersion": records.API_VERSION, "kind": "Attestation",
        "metadata": {"name": f"{name}--reproduction-{stamp}"},
        "spec": {
            "type": "reproduction", "observedAt": when,
            "subject": {"name": name, "recordDigest": records.record_digest(original),
                        "observedAt": o_spec["observedAt"]},
            "reproduction": {"name": repro["run"]["metadata"]["name"], "recordDigest": records.record_digest(repro),
                             "hardware": records.hardware_of(repro)},
            "rule": r, "verdict": "agrees" if not disc else "disagrees", "discrepancies": disc,
            "geomeanLatencyRatio": geo, "perWorkload": rows,
            "solScore": {"original": o_spec["sourceNative"]["metrics"].get("sol_score"),
                         "reproduced": r_spec["sourceNative"]["metrics"].get("sol_score")},
            "notes": notes,
        },
    }


def describe(att: dict) -> str:
    """One line: the verdict, by whom, when, and (when it disagrees) the first discrepancies."""
    s = att["spec"]
    geo = s.get("geomeanLatencyRatio")
    head = (f"{'agrees' if s['verdict'] == 'agrees' else 'DISAGREES'} ({s['type']} {s['reproduction']['name']}, "
            f"{str(s['observedAt'])[:10]}"
            + (f", geomean latency x{geo:.3f}" if geo else "") + f"; rule: latency within x{s['rule']['tolerance']:g})")
    if s["discrepancies"]:
        head += ": " + "; ".join(s["discrepancies"][:3]) + (" ..." if len(s["discrepancies"]) > 3 else "")
    return head


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
