"""Helpers of ``benchmarks/sol_execbench_eval.sh`` (NVIDIA's evaluator on our exported solution).

Standalone: imports neither fusedqkv (it runs where fusedqkv must not be importable) nor, at
module level, the evaluator; the subcommands that time use the evaluator's own code
(``sol_execbench.core.bench.timing.time_runnable``) from the carried source tree.

  install  --wheels DIR --site DIR          carried wheels into a --target folder (skips the CUDA
                                            Python bindings when the interpreter already has them)
  problem  --problem DIR --dest DIR [--workloads 0,3,8-15] [--max-tokens N]
                                            a copy of the problem pack with a subset of workloads
                                            (--max-tokens: cut seq_len, for CPU dry runs)
  floor    --problem DIR --out FILE         the two-GEMM floor (dX = dQKV.W, dW = dQKV^T.X) per
                                            workload, timed by the evaluator's time_runnable
  table    --problem DIR --traces FILE [--floor FILE] [--bench FILE] --out FILE
                                            the evaluator's per-workload table (+ floor, + our
                                            `fusedqkv bench` of the same session) as JSON; prints it
  merge    --out FILE TABLE.json...         one table from the tables of split runs
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# the CUDA Python bindings: installed only where the interpreter lacks them (torch's cu13
# wheels bring them; a second copy first on sys.path would shadow the one torch was built with)
CUDA_BINDING_DISTS = ("cuda_bindings", "cuda_pathfinder")


def _dist(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower()


def cmd_install(a) -> int:
    wheels = sorted(Path(a.wheels).glob("*.whl"))
    if not wheels:
        print(f"install: no wheels in {a.wheels}", file=sys.stderr)
        return 2
    have_bindings = subprocess.run([sys.executable, "-c", "import cuda.bindings"], capture_output=True).returncode == 0
    chosen = [w for w in wheels if not (have_bindings and _dist(w) in CUDA_BINDING_DISTS)]
    skipped = sorted(set(wheels) - set(chosen))
    if skipped:
        print(f"install: the interpreter has cuda.bindings; not installing {', '.join(w.name for w in skipped)}")
    site = Path(a.site)
    site.mkdir(parents=True, exist_ok=True)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, chosen)])
        if r.returncode:
            return r.returncode
    else:  # plain wheels (no scripts, no .data): unpacking is installing
        for w in chosen:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
    print(f"install: {len(chosen)} wheels into {site} ({'pip' if has_pip else 'unzip'})")
    return 0


def _workload_spec(spec: str | None, n: int) -> list:
    if not spec or spec == "all":
        return list(range(n))
    out = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise SystemExit(f"--workloads: indices {bad} outside 0..{n - 1}")
    return out


def _workloads(problem: Path) -> list:
    return [json.loads(line) for line in (problem / "workload.jsonl").read_text().splitlines() if line.strip()]


def cmd_problem(a) -> int:
    src, dest = Path(a.problem), Path(a.dest)
    wls = _workloads(src)
    keep = _workload_spec(a.workloads, len(wls))
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "workload.jsonl":
            shutil.copyfile(f, dest / f.name)
    lines = []
    for i in keep:
        w = dict(wls[i])
        if a.max_tokens:
            b = w["axes"]["batch_size"]
            w["axes"] = {**w["axes"], "batch_size": min(b, a.max_tokens),
                         "seq_len": max(1, min(w["axes"]["seq_len"], a.max_tokens // min(b, a.max_tokens)))}
        lines.append(json.dumps(w))
    (dest / "workload.jsonl").write_text("\n".join(lines) + "\n")
    print(f"problem: {len(lines)} of {len(wls)} workloads in {dest}" + (f" (cut to {a.max_tokens} tokens)"
                                                                       if a.max_tokens else ""))
    return 0


def _const_axes(defn: dict) -> dict:
    return {k: v["value"] for k, v in defn["axes"].items() if v.get("type") == "const"}


def cmd_floor(a) -> int:
    import torch
    from sol_execbench.core.bench.config import BenchmarkConfig
    from sol_execbench.core.bench.timing import time_runnable

    problem = Path(a.problem)
    defn = json.loads((problem / "definition.json").read_text())
    c = _const_axes(defn)
    hidden, qkv = c["hidden_size"], c["qkv_size"]
    cfg = BenchmarkConfig()
    dev = "cuda:0"
    rows = []
    for i, w in enumerate(_workloads(problem)):
        m = w["axes"]["batch_size"] * w["axes"]["seq_len"]
        g = torch.Generator(device=dev).manual_seed(i)
        dqkv = torch.randn(m, qkv, device=dev, dtype=torch.bfloat16, generator=g)
        wt = (torch.randn(qkv, hidden, device=dev, generator=g) / math.sqrt(hidden)).to(torch.bfloat16)
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        gx = torch.empty(m, hidden, device=dev, dtype=torch.bfloat16)
        gw = torch.empty(qkv, hidden, device=dev, dtype=torch.bfloat16)

        def floor(dqkv, wt, x, gx, gw):
            torch.mm(dqkv, wt, out=gx)
            torch.mm(dqkv.t(), x, out=gw)

        ms = time_runnable(floor, [dqkv, wt, x], [gx, gw], dev, warmup=cfg.warmup_runs, rep=cfg.iterations)
        rows.append({"uuid": w["uuid"], "axes": w["axes"], "tokens": m, "floor_ms": ms})
        print(f"floor {i:2d} b{w['axes']['batch_size']} s{w['axes']['seq_len']}: {ms * 1e3:8.1f} us", flush=True)
        del dqkv, wt, x, gx, gw
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"timer": "sol_execbench time_runnable (CUPTI span, median)",
                                       "warmup": cfg.warmup_runs, "iterations": cfg.iterations, "rows": rows},
                                      indent=1))
    return 0


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _bench_rows(path: str | None) -> dict:
    """uuid -> our `fusedqkv bench` figures (results.json of the same session)."""
    if not path or not Path(path).is_file():
        return {}
    res = json.loads(Path(path).read_text())
    out = {}
    for r in res["workloads"]:
        d = {}
        for n in ("fusedqkv", "gemm_floor", "eager"):
            x = r["impls"].get(n)
            if not x or x.get("status") != "ok":
                continue
            t = x.get("timings", {})
            d[f"bench_{n}_span_ms"] = t.get("kernel_span", {}).get("median")
            d[f"bench_{n}_events_ms"] = t.get("cuda_events", {}).get("median")
        src = r["impls"].get("fusedqkv", {}).get("timings", {}).get("kernel_span", {}).get("source")
        d["bench_span_source"] = src
        out[r["uuid"]] = d
    return out


def build_table(problem: Path, traces: list, floor: dict | None, bench: dict) -> dict:
    order = {w["uuid"]: i for i, w in enumerate(_workloads(problem))}
    fl = {r["uuid"]: r["floor_ms"] for r in (floor or {}).get("rows", [])}
    rows = []
    for t in traces:
        w, ev = t["workload"], t.get("evaluation") or {}
        perf, corr = ev.get("performance") or {}, ev.get("correctness") or {}
        row = {"index": order.get(w["uuid"]), "uuid": w["uuid"], "batch_size": w["axes"]["batch_size"],
               "seq_len": w["axes"]["seq_len"], "tokens": w["axes"]["batch_size"] * w["axes"]["seq_len"],
               "status": ev.get("status"), "latency_ms": perf.get("latency_ms"),
               "reference_latency_ms": perf.get("reference_latency_ms"), "speedup": perf.get("speedup_factor"),
               "max_abs_err": corr.get("max_absolute_error"), "max_rel_err": corr.get("max_relative_error")}
        if w["uuid"] in fl:
            row["floor_ms"] = fl[w["uuid"]]
            row["fused_over_floor"] = row["latency_ms"] / row["floor_ms"] if row["latency_ms"] else None
        row.update(bench.get(w["uuid"], {}))
        if row.get("bench_fusedqkv_span_ms") and row["latency_ms"]:
            row["bench_span_over_evaluator"] = row["bench_fusedqkv_span_ms"] / row["latency_ms"]
        if ev.get("status") != "PASSED":
            row["log_tail"] = "\n".join((ev.get("log") or "").strip().splitlines()[-6:])
        rows.append(row)
    rows.sort(key=lambda r: (r["index"] is None, r["index"]))
    return {"solution": traces[0]["solution"] if traces else None, "rows": rows, "summary": summarize(rows)}


def summarize(rows: list) -> dict:
    passed = [r for r in rows if r["status"] == "PASSED"]
    s = {"passed": len(passed), "total": len(rows),
         "geomean_speedup": _geomean([r["speedup"] for r in passed]) if len(passed) == len(rows) else None,
         "mean_latency_ms": (sum(r["latency_ms"] for r in passed) / len(passed)) if passed else None}
    if rows and all(r.get("fused_over_floor") for r in rows):
        s["geomean_fused_over_floor"] = _geomean([r["fused_over_floor"] for r in rows])
    if rows and all(r.get("bench_span_over_evaluator") for r in rows):
        s["geomean_bench_span_over_evaluator"] = _geomean([r["bench_span_over_evaluator"] for r in rows])
    return s


def _fmt(x, f="{:.4f}"):
    return "-" if x is None else f.format(x)


def print_table(t: dict) -> None:
    cols = [("#", "index", "{:d}"), ("b", "batch_size", "{:d}"), ("s", "seq_len", "{:d}"), ("status", "status", "{}"),
            ("lat ms", "latency_ms", "{:.4f}"), ("ref ms", "reference_latency_ms", "{:.4f}"),
            ("speedup", "speedup", "{:.2f}x"), ("floor ms", "floor_ms", "{:.4f}"),
            ("/floor", "fused_over_floor", "{:.3f}"), ("bench span", "bench_fusedqkv_span_ms", "{:.4f}"),
            ("bench ev", "bench_fusedqkv_events_ms", "{:.4f}"), ("bench/eval", "bench_span_over_evaluator", "{:.3f}")]
    cols = [c for c in cols if any(r.get(c[1]) is not None for r in t["rows"])]
    cells = [[c[0] for c in cols]] + [[_fmt(r.get(k), f) for _, k, f in cols] for r in t["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    s = t["summary"]
    print(f"solution {t['solution']}: {s['passed']}/{s['total']} PASSED; geomean speed-up "
          f"{_fmt(s['geomean_speedup'], '{:.2f}x')}; geomean fused/floor {_fmt(s.get('geomean_fused_over_floor'), '{:.3f}')}"
          + (f"; geomean bench span / evaluator {s['geomean_bench_span_over_evaluator']:.3f}"
             if s.get("geomean_bench_span_over_evaluator") else ""))
    for r in t["rows"]:
        if r.get("log_tail"):
            print(f"--- workload {r['index']} {r['status']}:\n{r['log_tail']}")


def cmd_table(a) -> int:
    traces = [json.loads(line) for line in Path(a.traces).read_text().splitlines() if line.strip()]
    floor = json.loads(Path(a.floor).read_text()) if a.floor and Path(a.floor).is_file() else None
    t = build_table(Path(a.problem), traces, floor, _bench_rows(a.bench))
    Path(a.out).write_text(json.dumps(t, indent=1))
    print_table(t)
    return 0 if t["rows"] and t["summary"]["passed"] == t["summary"]["total"] else 1


def cmd_merge(a) -> int:
    tables = [json.loads(Path(p).read_text()) for p in a.tables]
    rows = sorted((r for t in tables for r in t["rows"]), key=lambda r: (r["index"] is None, r["index"]))
    t = {"solution": tables[0]["solution"], "rows": rows, "summary": summarize(rows), "parts": a.tables}
    Path(a.out).write_text(json.dumps(t, indent=1))
    print_table(t)
    return 0 if t["summary"]["passed"] == t["summary"]["total"] else 1


def cmd_cupti_dirs(a) -> int:
    """Folders holding the libcupti that torch ships (for LD_LIBRARY_PATH), one per line."""
    import torch

    base = Path(torch.__file__).resolve().parents[1]
    dirs = sorted({str(Path(p).parent) for p in glob.glob(str(base / "nvidia" / "**" / "libcupti.so*"),
                                                            recursive=True)})
    print("\n".join(dirs))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--wheels", required=True)
    p.add_argument("--site", required=True)
    p = sub.add_parser("problem")
    p.add_argument("--problem", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--workloads")
    p.add_argument("--max-tokens", type=int)
    p = sub.add_parser("floor")
    p.add_argument("--problem", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("table")
    p.add_argument("--problem", required=True)
    p.add_argument("--traces", required=True)
    p.add_argument("--floor")
    p.add_argument("--bench")
    p.add_argument("--out", required=True)
    p = sub.add_parser("merge")
    p.add_argument("--out", required=True)
    p.add_argument("tables", nargs="+")
    sub.add_parser("cupti-dirs")
    a = ap.parse_args(argv)
    return {"install": cmd_install, "problem": cmd_problem, "floor": cmd_floor, "table": cmd_table,
            "merge": cmd_merge, "cupti-dirs": cmd_cupti_dirs}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
