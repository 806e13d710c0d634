"""``fusedqkv`` command line: ``bench``, ``runs``, ``export-solution``.

Errors a user can cause (unknown names, an unwritable --out, --device cuda without a
GPU, an empty run store) print one line on stderr and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    pass



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

    r = sub.add_parser("runs", help="list the runs of a comparison group ranked by SOL score (flagged runs last)")
    r.add_argument("--store", help="run store folder")
    r.add_argument("--group", help="comparison group key (default: the group of the latest run; 'all' for every group)")
    r.add_argument("--compare", help="run name to compare with the group's #1 (default: latest fusedqkv run of the group)")
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


def cmd_bench(a) -> int:
    from .bench import harness, records, report, trust

    cfg = harness.BenchConfig(device=a.device, workloads=_csv(a.workloads), implementations=_csv(a.impls),
                              reps=a.reps, warmup=a.warmup, quick=a.quick, max_tokens=a.max_tokens,
                              span=not a.no_span, span_source=a.span_clock, statistic=a.statistic,
                              measure_ceilings=a.measure_ceilings, time_budget=a.time_budget,
                              progress=not a.quiet)
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
    manifest = recs[main_impl]
    rank_lines = []
    if not a.no_store:
        try:
            for rec in recs.values():
                records.save_run(rec, a.store)
        except OSError as e:
            raise CliError(f"run store {records.store_dir(a.store)}: not writable ({e.strerror or e})") from None
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
    paths = report.write_report(results, recs, manifest, out, group_rank=rank_lines)

    s = results["summary"]
    label = "CPU run (reduced workloads)" if results["cpu_run"] else results["hardware"]
    print(f"{results['definition']} on {label}: {results['primary_timer']} {results['statistic']}, "
          f"{len(results['workloads'])} workloads")
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
        print(f"geomean fusedqkv / two-GEMM floor: {g:.3f}")
    if rank_lines:
        print("rank in comparison group: " + "; ".join(rank_lines))
    print(f"wrote {', '.join(sorted(p.name for p in paths.values()))} to {out}")
    if flagged or results.get("bound_flags"):
        print("fusedqkv: warning: these timings cannot be trusted -- flagged: " + "; ".join(flagged)
              + ". See the report's Flags section; 'fusedqkv runs' ranks flagged runs last.", file=sys.stderr)
    if results["failed_claims"]:
        print(f"fusedqkv: correctness check failed for: {', '.join(results['failed_claims'])}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


# ----------------------------------------------------------------------------- runs


def cmd_runs(a) -> int:
    from .bench import records

    runs = records.load_runs(a.store)
    if not runs:
        raise CliError(f"no runs in the run store {records.store_dir(a.store)}")
    grouped = records.groups(runs)
    if a.group and a.group != "all":
        if a.group not in grouped:
            raise CliError(f"unknown comparison group {a.group!r}; known: {', '.join(sorted(grouped))}")
        keys = [a.group]
    elif a.group == "all":
        keys = sorted(grouped)
    else:
        latest = max(runs, key=lambda r: (r["run"]["spec"]["observedAt"], r["run"]["metadata"]["name"]))
        keys = [records.group_of(latest)]
    out = []
    for g in keys:
        ranked = grouped[g]
        target = None
        if a.compare:
            target = next((r for r in ranked if r["run"]["metadata"]["name"] == a.compare), None)
            if target is None and len(keys) == 1:
                raise CliError(f"run {a.compare!r} is not in comparison group {g}")
        else:
            ours = [r for r in ranked if r["run"]["metadata"]["labels"].get("implementation") == "fusedqkv"]
            if ours:
                target = max(ours, key=lambda r: r["run"]["spec"]["observedAt"])
        cmp_ = records.compare(target, ranked[0]) if target is not None else None
        out.append({"group": g, "runs": ranked, "compare": cmp_})
    if a.json:
        print(json.dumps([{"group": o["group"], "runs": [r["run"] for r in o["runs"]], "compare": o["compare"]}
                          for o in out], indent=1))
        return EXIT_OK
    for o in out:
        r0 = o["runs"][0]["run"]
        print(f"comparison group {o['group']}: {r0['spec']['sourceNative']['benchmark']} on "
              f"{r0['metadata']['labels']['hardware']}"
              + (" (CPU run)" if r0["metadata"]["labels"].get("cpuRun") == "true" else "")
              + f", protocol {r0['spec']['protocolDigest'][:19]}, workloads {r0['spec']['workloadDigest'][:19]}")
        width = max(len("name"), *(len(r["run"]["metadata"]["name"]) for r in o["runs"]))
        print(f"{'#':>3s} {'name':<{width}s} {'impl':<9s} {'status':<9s} {'flags':<7s} {'SOL score':>9s} "
              f"{'latency ms':>10s} {'speedup':>8s} {'faster':>6s} {'impl digest':<19s}")
        for i, r in enumerate(o["runs"], 1):
            sp, m = r["run"]["spec"], r["run"]["spec"]["sourceNative"]["metrics"]
            f = _fmt_or_dash
            tr = sp.get("trust")
            flag = "-" if tr is None else ("FLAGGED" if tr.get("flagged") else "none")
            print(f"{i:>3d} {r['run']['metadata']['name']:<{width}s} "
                  f"{r['run']['metadata']['labels']['implementation']:<9s} "
                  f"{sp['status']:<9s} {flag:<7s} {f(m['sol_score'], '{:9.4f}'):>9s} {f(m['latency_ms'], '{:10.4f}'):>10s} "
                  f"{f(m['avg_speedup'], '{:7.3f}x'):>8s} {m['fast_1_count']:>2}/{m['fast_1_total']:<3} "
                  f"{sp['implementationDigest'][:19]}")
        fl = [r for r in o["runs"] if records.is_flagged(r)]
        if fl:
            print(f"{len(fl)} flagged run(s) ranked after the unflagged ones: some of their rows cannot be trusted "
                  "(a score outside [0, 1], an untrusted SOL bound, noisy or contended timings; see their reports)")
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
        return _err(str(e))
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
