"""``fusedqkv`` command line: ``bench``, ``runs``, ``export-solution``.

Errors a user can cause (unknown names, an unwritable --out, --device cuda without a
GPU, an empty run store, a file ``runs import`` cannot take) print one line on stderr and
exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    def __init__(self, msg: str, code: int = EXIT_USAGE):
        super().__init__(msg)
        self.code = code



def _fmt_or_dash(v, fmt: str) -> str:
    """A metric formatted for a table, '-' when it does not apply."""
    return fmt.format(v) if v is not None else "-"

def _err(msg: str, code: int = EXIT_USAGE) -> int:
    print(f"fusedqkv: error: {msg}", file=sys.stderr)
    return code


def _csv(s):
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def _writable_dir(path: str) -> Path:
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".fusedqkv_write_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CliError(f"--out {path}: not a writable folder ({e.strerror or e})") from None
    return p


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fusedqkv", description="fusedqkv: fused GQA QKV/RoPE/QK-norm kernels and a "
                                 "SOL-ExecBench-style benchmark.")
    sub = ap.add_subparsers(dest="cmd")

    b = sub.add_parser("bench", help="benchmark fusedqkv and its peers on the workloads of 091; write records and a report")
    b.add_argument("--out", default="runs/latest", help="output folder (default runs/latest)")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when available, else a CPU run on reduced workloads")
    b.add_argument("--workloads", help="comma-separated workload names, indices or uuids (default: all 16; "
                   "--quick on CPU: 4 small ones)")
    b.add_argument("--impl", "--implementations", dest="impls",
                   help="comma-separated: fusedqkv, eager, compile, gemm_floor (default: all on CUDA, "
                   "fusedqkv,eager on CPU; eager is always measured, it is the baseline)")
    b.add_argument("--reps", type=int, help="timed repetitions per workload, >= 1 (default: GPU 50, quick 10; "
                   "CPU as many as fit in --time-budget, at least 5)")
    b.add_argument("--warmup", type=int, help="warm-up calls before timing, >= 0 (default: GPU 10, quick 2; "
                   "CPU until 3 calls in a row agree within 25%%, at most 2 s)")
    b.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="CPU runs: seconds of timed calls per implementation and workload (default 1, quick 0.3)")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (and on CPU fewer, smaller workloads)")
    b.add_argument("--max-tokens", type=int, help="cap tokens per workload (CPU default 128, quick 64)")
    b.add_argument("--statistic", default="median", choices=["mean", "median"],
                   help="primary statistic (default median, the evaluator's)")
    b.add_argument("--no-span", action="store_true", help="CUDA events only (skip the kernel-span timer)")
    b.add_argument("--span-clock", default="auto", choices=["auto", "cupti", "profiler"],
                   help="kernel-span source: cupti (cupti-python, as NVIDIA's evaluator), profiler (torch.profiler), "
                   "auto (cupti when importable)")
    b.add_argument("--measure-ceilings", action="store_true",
                   help="SOL from a matmul and a copy measured at start instead of the datasheet table")
    b.add_argument("--store", help="run store folder (default $FUSEDQKV_RUN_STORE or ~/.cache/fusedqkv/runs)")
    b.add_argument("--no-store", action="store_true", help="do not add the run to the run store")
    b.add_argument("--quiet", action="store_true", help="no progress display")
    b.add_argument("--dtype", help="CPU runs: cast the definition's floating inputs to this dtype (float32: a CPU "
                   "without fast bf16 matmul); recorded in the protocol")
    b.add_argument("--reproduce", metavar="RECORD",
                   help="rerun a record (a name in the run store, or a record file) under its protocol on its "
                   "workloads, and write an attestation: agreement within a stated rule, or the discrepancy")

    r = sub.add_parser("runs", help="list the runs of a comparison group ranked by SOL score (flagged runs last); "
                       "'runs import FILE' adds an evaluator's traces.jsonl or a published KernelIndex record")
    r.add_argument("action", nargs="?", metavar="import", help="import FILE into the run store")
    r.add_argument("file", nargs="?", metavar="FILE", help="traces.jsonl of NVIDIA's evaluator, or a KernelIndex "
                   "record (manifest.json); told apart by content")
    r.add_argument("--store", help="run store folder")
    r.add_argument("--group", help="comparison group key (default: the group of the latest run; 'all' for every group)")
    r.add_argument("--compare", nargs="+", metavar="NAME",
                   help="NAME: compare a run with its group's #1 (default: latest fusedqkv run of the group); "
                   "A B: one table of two records of one implementation under different timers (per-workload "
                   "latency ratios B/A and their geomean)")
    r.add_argument("--cite", metavar="NAME", help="print a citation line of a run: name, record digest, observed "
                   "date, store path")
    r.add_argument("--stack-version", help="import of traces: the evaluation stack's version, when the traces do "
                   "not name it (e.g. v1.0, or the evaluator's commit)")
    r.add_argument("--solution", metavar="SOLUTION_JSON", help="import of traces: the solution.json the traces "
                   "name (its sources digest becomes the implementation digest)")
    r.add_argument("--json", action="store_true", help="print JSON")

    e = sub.add_parser("export-solution", help="write a SOL-ExecBench solution.json of fusedqkv")
    e.add_argument("--out", required=True, help="file to write (solution.json)")
    e.add_argument("--name", help="solution name")
    e.add_argument("--author", default="fusedqkv")
    e.add_argument("--check", action="store_true",
                   help="then run it from a temporary folder, in a subprocess where 'import fusedqkv' fails, "
                   "against the reference (CPU: the entry point and the Triton path under TRITON_INTERPRET=1)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device of the --check (cpu: reduced workloads; cuda: full size)")
    return ap


# ----------------------------------------------------------------------------- bench


REPRODUCE_CONFLICTS = (("workloads", "--workloads"), ("impls", "--impl"), ("reps", "--reps"), ("warmup", "--warmup"),
                       ("time_budget", "--time-budget"), ("quick", "--quick"), ("max_tokens", "--max-tokens"),
                       ("no_span", "--no-span"), ("measure_ceilings", "--measure-ceilings"), ("dtype", "--dtype"))


def _record_to_reproduce(a):
    """The record --reproduce names: a file, or a name in the run store."""
    from .bench import records

    p = Path(a.reproduce).expanduser()
    if p.is_file():
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise CliError(f"--reproduce {a.reproduce}: not a JSON record ({e})") from None
    else:
        rec = records.find_run(a.reproduce, a.store)
        if rec is None:
            raise CliError(f"--reproduce {a.reproduce}: no such file, and no run of that name in the run store "
                           f"{records.store_dir(a.store)}")
    errs = records.structure_errors(rec)
    if errs:
        raise CliError(f"--reproduce {a.reproduce}: not a KernelIndex record: missing or malformed {', '.join(errs)}")
    return rec


def _bench_config(a):
    from .bench import attest, harness

    if not a.reproduce:
        return None, harness.BenchConfig(
            device=a.device, workloads=_csv(a.workloads), implementations=_csv(a.impls), reps=a.reps,
            warmup=a.warmup, quick=a.quick, max_tokens=a.max_tokens, span=not a.no_span, span_source=a.span_clock,
            statistic=a.statistic, measure_ceilings=a.measure_ceilings, time_budget=a.time_budget,
            progress=not a.quiet, dtype=a.dtype)
    given = [flag for attr, flag in REPRODUCE_CONFLICTS if getattr(a, attr) not in (None, False)]
    given += [flag for flag, v, d in (("--device", a.device, "auto"), ("--statistic", a.statistic, "median"),
                                      ("--span-clock", a.span_clock, "auto")) if v != d]
    if given:
        raise CliError(f"--reproduce takes every setting from the record's protocol; drop {', '.join(given)}")
    rec = _record_to_reproduce(a)
    try:
        return rec, attest.reproduce_config(rec, progress=not a.quiet)
    except harness.BenchError as e:
        raise CliError(str(e)) from None


def cmd_bench(a) -> int:
    from .bench import attest, harness, records, report, trust

    original, cfg = _bench_config(a)
    try:
        plan = harness.plan_bench(cfg)  # every argument checked before --out or the store is touched
    except harness.BenchError as e:
        raise CliError(str(e)) from None
    out = _writable_dir(a.out)
    try:
        results = harness.run_bench(cfg, plan)
    except harness.BenchError as e:
        raise CliError(str(e)) from None
    recs = harness.build_records(results)
    main_impl = "fusedqkv" if "fusedqkv" in recs else next(iter(recs))
    if original is not None:
        main_impl = original["run"]["metadata"]["labels"]["implementation"]
    manifest = recs[main_impl]
    if original is not None:  # metadata: outside every digest; 'runs' shows it beside the run
        manifest["run"]["metadata"]["annotations"]["reproductionOf"] = original["run"]["metadata"]["name"]
    rank_lines = []
    store = records.store_dir(a.store)
    if not a.no_store:
        try:
            for rec in recs.values():
                records.save_run(rec, a.store)
        except OSError as e:
            raise CliError(f"run store {store}: not writable ({e.strerror or e})") from None
        grp = records.group_of(manifest)
        ranked = records.groups(records.load_runs(a.store)).get(grp, [])
        names = [x["run"]["metadata"]["name"] for x in ranked]
        results["rank_in_group"] = {}
        for n, rec in recs.items():
            nm = rec["run"]["metadata"]["name"]
            if nm in names:
                results["rank_in_group"][n] = {"rank": names.index(nm) + 1, "of": len(names)}
                rank_lines.append(f"{n} #{names.index(nm) + 1}/{len(names)}"
                                  + (" (flagged: ranked after any unflagged run)" if records.is_flagged(rec) else ""))
    where = (records.run_path(manifest["run"]["metadata"]["name"], a.store) if not a.no_store
             else "not in a run store (--no-store)")
    att = None
    if original is not None:
        att = attest.make_attestation(original, manifest)
        (out / "attestation.json").write_text(json.dumps(att, indent=1, sort_keys=True))
        if not a.no_store:
            try:
                records.save_attestation(att, a.store)
            except OSError as e:
                raise CliError(f"run store {store}: not writable ({e.strerror or e})") from None
    paths = report.write_report(results, recs, manifest, out, group_rank=rank_lines,
                                citation=records.citation(manifest, where), attestation=att)

    s = results["summary"]
    label = "CPU run (reduced workloads)" if results["cpu_run"] else results["hardware"]
    print(f"{results['definition']} on {label}: {results['primary_timer']} {results['statistic']}, "
          f"{len(results['workloads'])} workloads" + (f", inputs in {plan.dtype}" if plan.dtype else ""))
    print(f"{'impl':<11s} {'SOL score':>9s} {'latency ms':>11s} {'speedup':>8s} {'geomean':>8s} {'faster':>7s} "
          f"{'correct':>8s}  flags")
    flagged = []
    for n in report._impls(results):
        x = s[n]
        f = _fmt_or_dash
        t = x.get("trust")
        if t and t["flagged"]:
            flagged.append(f"{n} ({trust.describe(t)})")
        print(f"{n:<11s} {f(x['sol_score'], '{:9.4f}'):>9s} {f(x['latency_ms'], '{:11.4f}'):>11s} "
              f"{f(x['avg_speedup'], '{:7.3f}x'):>8s} {f(x['geomean_speedup'], '{:7.3f}x'):>8s} "
              f"{x['fast_1_count']:>3d}/{x['fast_1_total']:<3d} "
              f"{('n/a' if x['role'] == 'bound' else str(x['correct_count']) + '/' + str(x['total'])):>8s}  "
              f"{'-' if not t else ('FLAGGED' if t['flagged'] else 'none')}")
    g = report.floor_ratio_geomean(results)
    if g is not None:
        fl = results.get("floor_flags") or {}
        print(f"geomean fusedqkv / two-GEMM floor: {g:.3f}"
              + (f" -- floor_unsteady on {', '.join(fl)}: the floor timed slower than the kernel it bounds there"
                 if fl else ""))
    if rank_lines:
        print("rank in comparison group: " + "; ".join(rank_lines))
    if att is not None:
        print(f"reproduction of {original['run']['metadata']['name']}: {attest.describe(att)}")
    files = sorted(p.name for p in paths.values() if p.is_file())
    rec_files = ", ".join(f"{n}.json" for n in sorted(recs))
    stored = (f"run store {store} (+{len(recs)} record{'s' if len(recs) != 1 else ''}"
              + (", 1 attestation" if att is not None else "") + ")") if not a.no_store else \
        "not added to a run store (--no-store)"
    print(f"wrote {', '.join(files)}, records/ ({rec_files}) to {out}; {stored}")
    if flagged or results.get("bound_flags"):
        print("fusedqkv: warning: these timings cannot be trusted -- flagged: " + "; ".join(flagged)
              + ". See the report's Flags section; 'fusedqkv runs' ranks flagged runs last.", file=sys.stderr)
    if results["failed_claims"]:
        print(f"fusedqkv: correctness check failed for: {', '.join(results['failed_claims'])}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    if att is not None and att["spec"]["verdict"] != "agrees":
        return EXIT_CHECK_FAILED
    return EXIT_OK


# ----------------------------------------------------------------------------- runs


def cmd_runs(a) -> int:
    from .bench import records

    if a.action is not None:
        if a.action != "import":
            raise CliError(f"runs: unknown action {a.action!r}; expected: runs import FILE")
        if not a.file:
            raise CliError("runs import: expected FILE: the traces.jsonl of NVIDIA's evaluator, or a KernelIndex "
                           "record (manifest.json)")
        for flag, v in (("--compare", a.compare), ("--cite", a.cite), ("--group", a.group)):
            if v:
                raise CliError(f"runs import: {flag} does not apply to an import")
        return cmd_runs_import(a)
    for flag, v in (("--stack-version", a.stack_version), ("--solution", a.solution)):
        if v:
            raise CliError(f"{flag}: only with 'runs import TRACES.jsonl'")
    runs = records.load_runs(a.store)
    if not runs:
        raise CliError(f"no runs in the run store {records.store_dir(a.store)}")
    by_name = {r["run"]["metadata"]["name"]: r for r in runs}
    if a.cite:
        if a.cite not in by_name:
            raise CliError(f"--cite {a.cite}: no run of that name in the run store {records.store_dir(a.store)}")
        print(records.citation(by_name[a.cite], records.run_path(a.cite, a.store)))
        return EXIT_OK
    if a.compare and len(a.compare) > 2:
        raise CliError(f"--compare: expected one run name (against its group's #1) or two (A B: one table across "
                       f"clocks), got {len(a.compare)}")
    if a.compare and len(a.compare) == 2:
        return _runs_cross_clock(a, by_name)
    grouped = records.groups(runs)
    compare_name = a.compare[0] if a.compare else None
    if a.group and a.group != "all":
        if a.group not in grouped:
            raise CliError(f"unknown comparison group {a.group!r}; known: {', '.join(sorted(grouped))}")
        keys = [a.group]
    elif a.group == "all":
        keys = sorted(grouped)
    elif compare_name in by_name:  # the group of the run to compare
        keys = [records.group_of(by_name[compare_name])]
    else:
        latest = max(runs, key=lambda r: (str(r["run"]["spec"]["observedAt"]), r["run"]["metadata"]["name"]))
        keys = [records.group_of(latest)]
    if compare_name and compare_name not in by_name:
        raise CliError(f"--compare {compare_name}: no run of that name in the run store {records.store_dir(a.store)}")
    attestations = records.load_attestations(a.store)
    out = []
    for g in keys:
        ranked = grouped[g]
        target = None
        if compare_name:
            target = next((r for r in ranked if r["run"]["metadata"]["name"] == compare_name), None)
            if target is None and len(keys) == 1:
                other = records.group_of(by_name[compare_name])
                raise CliError(f"--compare {compare_name}: it is in comparison group {other}, not {g}: records "
                               f"compare only within one group (same {records.group_rule(ranked[0])}); use "
                               f"--group {other}, or --compare A B for one table across clocks")
        else:
            ours = [r for r in ranked if r["run"]["metadata"]["labels"].get("implementation") == "fusedqkv"]
            if ours:
                target = max(ours, key=lambda r: r["run"]["spec"]["observedAt"])
        cmp_ = records.compare(target, ranked[0]) if target is not None else None
        out.append({"group": g, "runs": ranked, "compare": cmp_})
    if a.json:
        print(json.dumps([{"group": o["group"], "runs": [r["run"] for r in o["runs"]], "compare": o["compare"],
                           "verification": {r["run"]["metadata"]["name"]: records.verify(r)["status"] for r in o["runs"]},
                           "attestations": {r["run"]["metadata"]["name"]: attestations.get(r["run"]["metadata"]["name"], [])
                                            for r in o["runs"]}}
                          for o in out], indent=1))
        return EXIT_OK
    for o in out:
        _print_group(o, attestations)
    return EXIT_OK


def _print_group(o: dict, attestations: dict) -> None:
    from .bench import attest, records

    r0 = o["runs"][0]
    run0 = r0["run"]
    harness = records._path(r0, "protocol.spec.harness")
    print(f"comparison group {o['group']}: {records.definition_of(r0)} on {records.hardware_of(r0)}"
          + (" (CPU run)" if run0["metadata"]["labels"].get("cpuRun") == "true" else "")
          + (f", {harness['name']} {harness['version']} (timer {records.timer_of(r0)})" if harness else "")
          + f", protocol {run0['spec']['protocolDigest'][:19]}, workloads {run0['spec']['workloadDigest'][:19]}")
    width = max(len("name"), *(len(r["run"]["metadata"]["name"]) for r in o["runs"]))
    iw = max(len("impl"), 9, *(len(records.implementation_of(r)) for r in o["runs"]))
    print(f"{'#':>3s} {'name':<{width}s} {'impl':<{iw}s} {'status':<9s} {'flags':<7s} {'SOL score':>9s} "
          f"{'latency ms':>10s} {'speedup':>8s} {'faster':>6s} {'impl digest':<19s} digests")
    unverified = 0
    f = _fmt_or_dash
    for i, r in enumerate(o["runs"], 1):
        sp, m = r["run"]["spec"], r["run"]["spec"]["sourceNative"]["metrics"]
        tr = sp.get("trust")
        flag = "-" if tr is None else ("FLAGGED" if tr.get("flagged") else "none")
        v = records.verify(r)["status"]
        unverified += v == "unverified"
        name = r["run"]["metadata"]["name"]
        print(f"{i:>3d} {name:<{width}s} {records.implementation_of(r):<{iw}s} "
              f"{sp['status']:<9s} {flag:<7s} {f(m['sol_score'], '{:9.4f}'):>9s} {f(m['latency_ms'], '{:10.4f}'):>10s} "
              f"{f(m['avg_speedup'], '{:7.3f}x'):>8s} {m['fast_1_count']:>2}/{m['fast_1_total']:<3} "
              f"{sp['implementationDigest'][:19]} {'UNVERIFIED' if v == 'unverified' else v}")
        of = (r["run"]["metadata"].get("annotations") or {}).get("reproductionOf")
        if of:
            print(f"{'':>3s}   a reproduction of {of}")
        for att in attestations.get(name, []):
            mark = "" if att["spec"]["subject"]["recordDigest"] == records.record_digest(r) else \
                " [attests another version of this record: digests differ]"
            print(f"{'':>3s}   attested: {attest.describe(att)}{mark}")
        failed = sp["sourceNative"].get("failedWorkloads") or []
        missing = sp["sourceNative"].get("missingWorkloads") or []
        if failed or missing:
            print(f"{'':>3s}   failed: {', '.join(failed + [w + ' (missing)' for w in missing])}")
    fl = [r for r in o["runs"] if records.is_flagged(r)]
    if fl:
        print(f"{len(fl)} flagged run(s) ranked after the unflagged ones: some of their rows cannot be trusted "
              "(a score outside [0, 1], an untrusted SOL bound, noisy or contended timings; see their reports)")
    if unverified:
        print(f"{unverified} unverified record(s): published records whose digests cannot be recomputed from "
              "their contents (stored as published; their figures are the publisher's)")
    c = o["compare"]
    if c:
        if c["run"] == c["best"]:
            print(f"{c['run']} is #1 of its group" + (" (every run of the group is flagged)"
                                                       if c["flagged"]["best"] else ""))
        else:
            ms = c["metrics"]
            d = ms["sol_score"]["delta"]
            print(f"{c['run']}{' (flagged)' if c['flagged']['run'] else ''} vs #1 {c['best']}: SOL score {ms['sol_score']['run']} vs {ms['sol_score']['best']}"
                  + (f" ({d:+.4f})" if d is not None else "")
                  + (f", mean latency x{c['latency_ratio_vs_best']:.3f} of #1" if c["latency_ratio_vs_best"] else ""))
    print()


def _runs_cross_clock(a, by_name: dict) -> int:
    from .bench import records

    for n in a.compare:
        if n not in by_name:
            raise CliError(f"--compare {n}: no run of that name in the run store {records.store_dir(a.store)}")
    ra, rb = (by_name[n] for n in a.compare)
    try:
        t = records.cross_clock(ra, rb)
    except records.CompareError as e:
        raise CliError(f"--compare: {e}") from None
    if a.json:
        print(json.dumps(t, indent=1))
        return EXIT_OK
    ta, tb = t["timers"]["a"], t["timers"]["b"]
    print(f"A = {t['a']} ({records.timer_of(ra)})")
    print(f"B = {t['b']} ({records.timer_of(rb)})")
    if t["same_group"]:
        print("same comparison group: one protocol, so the ratios are run-to-run differences, not clocks")
    else:
        print(f"cross-group: A is in {t['groups']['a']}, B in {t['groups']['b']} (timers {ta[0]} and {tb[0]}): "
              "a table across clocks of one definition and GPU type, not a ranking")
    same = t["same_implementation"]
    print("implementation: " + {True: "the same", False: "DIFFERENT -- the ratios mix code and clock",
                                None: "not established"}[same] + f" ({t['implementation_basis']})")
    cols = ([("workload", 16), ("tokens", 6)] + [(f"A {x} ms", 0) for x in ta] + [(f"B {y} ms", 0) for y in tb]
            + [(k, 0) for k in t["geomean"]])
    cols = [(c, max(w, len(c))) for c, w in cols]
    print("  ".join(f"{c:>{w}s}" for c, w in cols))
    f = _fmt_or_dash
    for r in t["rows"]:
        vals = ([r["workload"] or r["uuid"][:8], str(r["tokens"])] + [f(r["a"][x], "{:.4f}") for x in ta]
                + [f(r["b"][y], "{:.4f}") for y in tb] + [f(r["ratios"][k], "{:.3f}") for k in t["geomean"]])
        print("  ".join(f"{v:>{w}s}" for v, (_, w) in zip(vals, cols)))
    geo = ["geomean", ""] + [""] * (len(ta) + len(tb)) + [f(v, "{:.3f}") for v in t["geomean"].values()]
    print("  ".join(f"{v:>{w}s}" for v, (_, w) in zip(geo, cols)))
    print(f"{len(t['rows'])} workloads in common"
          + (f"; only in A: {', '.join(t['only_a'])}" if t["only_a"] else "")
          + (f"; only in B: {', '.join(t['only_b'])}" if t["only_b"] else ""))
    return EXIT_OK


def cmd_runs_import(a) -> int:
    from .bench import attest, importer, records

    try:
        kind, obj = importer.read_source(a.file)
    except importer.RecordImportError as e:
        raise CliError(f"runs import {e}") from None
    sha, when = importer.file_sha256(a.file), attest.now()
    if kind == "traces":
        sol = None
        if a.solution:
            try:
                sol = json.loads(Path(a.solution).expanduser().read_text())
                if not isinstance(sol, dict) or "sources" not in sol:
                    raise ValueError("no sources")
            except (OSError, ValueError) as e:
                raise CliError(f"--solution {a.solution}: expected a SOL-ExecBench solution.json ({e})") from None
        try:
            rec = importer.record_from_traces(obj, a.stack_version, sol)
        except importer.RecordImportError as e:
            raise CliError(str(e)) from None
        v = records.verify(rec)
        origin = "evaluator traces"
    else:
        for flag, val in (("--stack-version", a.stack_version), ("--solution", a.solution)):
            if val:
                raise CliError(f"{flag}: for traces only; {a.file} is a KernelIndex record")
        try:
            v = importer.check_manifest(obj, a.file)
        except importer.RecordImportError as e:
            mismatch = "digest mismatch" in str(e)
            raise CliError(f"runs import {e}", EXIT_CHECK_FAILED if mismatch else EXIT_USAGE) from None
        rec = obj
        origin = "fusedqkv record" if v["form"] == "fusedqkv" else "external"
    stored = importer.imported(rec, origin, v, str(Path(a.file).expanduser().resolve()), sha, when)
    name = rec["run"]["metadata"]["name"]
    path = records.run_path(name, a.store)
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            same = records.record_digest(old) == records.record_digest(stored)
        except (OSError, ValueError, KeyError):
            same = False
        if not same:
            raise CliError(f"runs import: a different record named {name} is already in the run store ({path})",
                           EXIT_CHECK_FAILED)
        print(f"{name} is already in the run store ({path})")
        return EXIT_OK
    try:
        records.save_run(stored, a.store)
    except OSError as e:
        raise CliError(f"run store {records.store_dir(a.store)}: not writable ({e.strerror or e})") from None
    if a.json:
        print(json.dumps({"name": name, "path": str(path), "origin": origin, "verification": v,
                          "comparisonGroup": records.group_of(rec)}, indent=1))
        return EXIT_OK
    spec, m = rec["run"]["spec"], rec["run"]["spec"]["sourceNative"]["metrics"]
    f = _fmt_or_dash
    print(f"imported {name} ({origin}; digests {v['status']}) into {path}")
    print(f"  comparison group {records.group_of(rec)} (same {records.group_rule(rec)})")
    print(f"  {records.definition_of(rec)} on {records.hardware_of(rec)}, timer {records.timer_of(rec)}: status "
          f"{spec['status']}, mean latency {f(m['latency_ms'], '{:.4f}')} ms, SOL score {f(m['sol_score'], '{:.4f}')}, "
          f"speed-up {f(m['avg_speedup'], '{:.3f}x')}, faster {m['fast_1_count']}/{m['fast_1_total']}")
    sn = spec["sourceNative"]
    if sn.get("solSource"):
        print(f"  SOL: {sn['solSource']}")
    for note in sn.get("notes") or []:
        print(f"  {note}")
    if v["status"] == "unverified":
        print(f"  unverified: {v['reason']}")
    return EXIT_OK


# ----------------------------------------------------------------------------- export


def cmd_export(a) -> int:
    from .bench import harness, solution

    dev = None
    if a.check:
        try:
            dev = harness.resolve_device(a.device)
        except harness.BenchError as e:
            raise CliError(str(e)) from None
    p = Path(a.out).expanduser()
    if p.parent and not p.parent.exists():
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"--out {a.out}: cannot create its folder ({e.strerror or e})") from None
    try:
        sol = solution.build_solution(name=a.name, author=a.author)
    except solution.ExportError as e:  # loud: every offence, one per line
        print("fusedqkv: error: export-solution: the package cannot be shipped self-contained:", file=sys.stderr)
        for line in str(e).splitlines():
            print(f"  {line}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    try:
        p.write_text(json.dumps(sol, indent=1))
    except OSError as e:
        raise CliError(f"--out {a.out}: not writable ({e.strerror or e})") from None
    print(f"wrote {p}: {sol['name']} ({len(sol['sources'])} sources, entry {sol['spec']['entry_point']}, "
          f"sources {solution.sources_digest(sol)[:19]})")
    for s in sol["sources"]:
        print(f"  {s['path']}")
    if a.check:
        print(f"check: the exported sources in a subprocess where 'import fusedqkv' raises ({dev.type})")
        try:
            res = solution.check_solution(sol, device=dev.type)
        except solution.IsolationError as e:
            print(f"fusedqkv: error: export-solution --check: {e}", file=sys.stderr)
            return EXIT_CHECK_FAILED
        for r in res:
            line = f"  {r['workload']} ({r['tokens']} tokens), {r['path']}: {'passed' if r['passed'] else 'FAILED'}"
            print(line + ("" if r["passed"] else f" -- {solution.describe_failure(r)}"))
        if not all(r["passed"] for r in res):
            return EXIT_CHECK_FAILED
    return EXIT_OK


def main(argv=None) -> int:
    from .bench.problem import PackNotFoundError

    ap = _parser()
    a = ap.parse_args(argv)
    if a.cmd is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if a.cmd == "bench":
            return cmd_bench(a)
        if a.cmd == "runs":
            return cmd_runs(a)
        if a.cmd == "export-solution":
            return cmd_export(a)
    except CliError as e:
        return _err(str(e), e.code)
    except PackNotFoundError as e:  # $FUSEDQKV_SOL_EXECBENCH without the pack (bench, export-solution --check)
        return _err(str(e), EXIT_USAGE)
    except KeyboardInterrupt:
        return _err("interrupted", 130)
    except BrokenPipeError:  # output piped into head & co.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
