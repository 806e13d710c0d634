"""Report of a bench run: results.json, manifest.json, report.md, a self-contained
report.html (the plot embedded as base64; nothing fetched from the network) and latency.png."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

from . import trust

ORDER = ("fusedqkv", "compile", "eager", "gemm_floor")


def _f(x, fmt="{:.4f}", none="—"):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return fmt.format(x)


def si(x, unit: str) -> str:
    """A rate with an SI prefix and 4 significant digits: a CPU's 0.0134 TFLOP/s is 13.4 GFLOP/s."""
    if x is None or not math.isfinite(x):
        return "—"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.4g} {prefix}{unit}"
    return f"{x:.4g} {unit}"


def _impls(results):
    names = list(results["implementations"])
    return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


def _run_label(results) -> str:
    if results["cpu_run"]:
        return f"CPU run (reduced workloads) on {results['hardware']}"
    return f"GPU run on {results['hardware']}"


# ----------------------------------------------------------------------------- plot


def latency_plot(results: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = latency_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_figure(results: dict):
    """Latency per workload and implementation (the primary statistic; bars: p20-p80 of the
    repetitions), the SOL bound, and -- only when there are any -- failed and flagged points,
    each with its legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["workloads"]
    names = _impls(results)
    primary = results["primary_timer"]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows) + 3), 5))
    markers = {"fusedqkv": "o", "eager": "s", "compile": "^", "gemm_floor": "v"}
    plotted = [r["sol_ms"] for r in rows if r.get("sol_ms")]
    bad, flagged = [], []
    for n in names:
        pts = []
        for i, r in zip(x, rows):
            xi = r["impls"][n]
            y = xi.get("latency_ms")
            if not y:
                continue
            t = xi.get("timings", {}).get(primary, {})
            lo, hi = t.get("p20", y), t.get("p80", y)
            pts.append((i, y, max(0.0, y - lo), max(0.0, hi - y)))
            plotted += [lo, hi, y]
            if xi.get("correct") is False:
                bad.append((i, y))
            if xi.get("flags"):
                flagged.append((i, y))
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[p[2] for p in pts], [p[3] for p in pts]],
                        marker=markers.get(n, "x"), linestyle="-", capsize=2, label=n)
    ax.plot(x, [r["sol_ms"] for r in rows], color="black", linestyle="--", marker="_", label="SOL bound")
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="x", color="red", s=60, zorder=5,
                   label="failed correctness")
    if flagged:
        ax.scatter([b[0] for b in flagged], [b[1] for b in flagged], marker="o", facecolors="none",
                   edgecolors="purple", s=160, linewidths=1.5, zorder=6, label="flagged (cannot be trusted)")
    ax.set_yscale("log")
    pos = [v for v in plotted if v and v > 0]
    if pos:  # room above the top point and below the bottom one (log axis: a factor)
        ax.set_ylim(min(pos) / 1.6, max(pos) * 1.6)
    ax.set_xticks(x)
    ax.set_xticklabels([r["workload"] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_xlabel("workload" + (" (reduced for the CPU run)" if results["cpu_run"] else ""))
    ax.set_ylabel(f"latency, ms ({primary} {results['statistic']}; bars p20-p80; log)")
    ax.set_title(f"{results['definition']} — {_run_label(results)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = names + ["SOL bound", "failed correctness", "flagged (cannot be trusted)"]
    pairs = sorted(zip(handles, labels), key=lambda hl: order.index(hl[1]) if hl[1] in order else len(order))
    ax.legend([h for h, _ in pairs], [lb for _, lb in pairs], fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- tables


def summary_table(results: dict, recs: dict) -> list:
    """Rows: implementation, status, SOL score, latency, speed-ups, N faster, correct, digest."""
    out = []
    for n in _impls(results):
        s = results["summary"][n]
        r = recs.get(n)
        out.append({
            "implementation": n, "role": s["role"],
            "status": r["run"]["spec"]["status"] if r else "bound",
            "sol_score": _f(s["sol_score"]), "latency_ms": _f(s["latency_ms"]),
            "avg_speedup": _f(s["avg_speedup"], "{:.3f}x"), "geomean_speedup": _f(s["geomean_speedup"], "{:.3f}x"),
            "faster": f"{s['fast_1_count']}/{s['fast_1_total']}",
            "correct": "n/a" if s["role"] == "bound" else f"{s['correct_count']}/{s['total']}",
            "digest": (r["run"]["spec"]["implementationDigest"][:19] if r else s["implementationDigest"][:19]),
            "flags": trust.describe(s["trust"]) if s.get("trust") else "n/a",
        })
    return out


TIMER_LABEL = {"kernel_span": "span ms", "cuda_events": "events ms", "cpu_wall": "wall ms"}


def workload_table(results: dict) -> list:
    """One row per workload, one number per cell: per implementation its primary latency,
    CUDA events (when the primary is the span), on a CPU run the spread of the repetitions
    ((p80 - p20) / median), the correctness check, the SOL score S and, where any row of the
    implementation is flagged, its flags; fusedqkv / floor when both ran; the dataset's B200 figures."""
    stat, primary = results["statistic"], results["primary_timer"]
    flagged_impls = {n: any(r["impls"][n].get("flags") for r in results["workloads"]) for n in _impls(results)}
    rows = []
    for r in results["workloads"]:
        d = {"workload": r["workload"], "tokens": r["tokens"], "sol ms": _f(r["sol_ms"]),
             "bound": r["roofline"]["bound"]}
        for n in _impls(results):
            x = r["impls"][n]
            t = x.get("timings", {})
            ok = x["status"] == "ok"
            d[f"{n} {TIMER_LABEL.get(primary, primary)}"] = _f(x.get("latency_ms")) if ok else "—"
            if primary == "kernel_span":
                d[f"{n} events ms"] = _f(t.get("cuda_events", {}).get(stat)) if ok else "—"
            if results["cpu_run"]:
                d[f"{n} spread"] = _f(x.get("spread"), "{:.0%}") if ok else "—"
            if x["role"] != "bound":
                d[f"{n} check"] = ({True: "ok", False: "FAIL", None: "—"}[x.get("correct")] if ok
                                   else f"ERROR: {x.get('error', '')[:60]}")
                d[f"{n} S"] = _f(x.get("sol_score"), "{:.3f}") if ok else "—"
                if flagged_impls.get(n):
                    d[f"{n} flags"] = ", ".join(x.get("flags", [])) or "—"
            elif not ok:
                d[f"{n} check"] = f"ERROR: {x.get('error', '')[:60]}"
        fq, fl = (r["impls"].get(k, {}).get("latency_ms") for k in ("fusedqkv", "gemm_floor"))
        if "gemm_floor" in r["impls"] and "fusedqkv" in r["impls"]:
            unsteady = "floor_unsteady" in r["impls"]["gemm_floor"].get("flags", [])
            d["fusedqkv / floor"] = (_f(fq / fl, "{:.3f}") + (" (floor unsteady)" if unsteady else "")
                                     if (fq and fl) else "—")
            if any("floor_unsteady" in x["impls"]["gemm_floor"].get("flags", []) for x in results["workloads"]):
                d["gemm_floor flags"] = ", ".join(r["impls"]["gemm_floor"].get("flags", [])) or "—"
        if r.get("b200"):
            d["b200 sol ms"] = _f(r["b200"]["sol_ms"])
            d["b200 baseline ms"] = _f(r["b200"]["baseline_ms"])
        rows.append(d)
    return rows


def floor_ratio_geomean(results: dict) -> float | None:
    """Geomean over the workloads of fusedqkv's latency / the two-GEMM floor's (same timer)."""
    xs = []
    for r in results["workloads"]:
        fq, fl = (r["impls"].get(k, {}).get("latency_ms") for k in ("fusedqkv", "gemm_floor"))
        if not (fq and fl):
            return None
        xs.append(fq / fl)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _columns(rows: list) -> list:
    """Union of the rows' keys, in first-seen order."""
    keys: list = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    return keys


def _md_table(rows: list) -> str:
    if not rows:
        return ""
    keys = _columns(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")).replace("|", "/") for k in keys) + " |")
    return "\n".join(lines)


_NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?(e[-+]?\d+)?x?$")


def _html_table(rows: list) -> str:
    if not rows:
        return ""
    keys = _columns(rows)
    h = ("<div class='scroll'><table><thead><tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys)
         + "</tr></thead><tbody>")
    for r in rows:
        cells = []
        for k in keys:
            v = str(r.get(k, ""))
            cls = ' class="fail"' if ("FAIL" in v or "ERROR" in v) else (' class="num"' if _NUMBER.match(v) else "")
            cells.append(f"<td{cls}>{html.escape(v)}</td>")
        h += "<tr>" + "".join(cells) + "</tr>"
    return h + "</tbody></table></div>"


def _repetitions_text(results: dict) -> str:
    reps, warm = results["reps"], results["warmup"]
    if isinstance(reps, dict):
        ns = [x["timings"][results["primary_timer"]]["n"] for r in results["workloads"] for x in r["impls"].values()
              if x.get("timings")]
        n = (f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}") if ns else "?"
        text = (f"{n} repetitions (adaptive: {reps['budgetS']:g} s of calls per implementation and workload, "
                f"at least {reps['minimum']})")
    else:
        text = f"{reps} repetitions"
    if isinstance(warm, dict):
        return text + f" (warm-up until 3 calls agree within {warm['withinFraction']:.0%}, at most {warm['capS']:g} s)"
    return text + f" (warm-up {warm})"


def _trust_line(results: dict) -> str:
    parts = []
    for n in _impls(results):
        t = results["summary"][n].get("trust")
        if t and t["flagged"]:
            parts.append(f"{n} {trust.describe(t)}")
    if not parts:
        return "Flags: none (every score in [0, 1]; bound and timings trusted)"
    return "**FLAGGED — these timings cannot be trusted**: " + "; ".join(parts) + " (see Flags)"


def _header_lines(results: dict, manifest: dict, group_rank: list, citation=None, attestation=None) -> list:
    spec = manifest["run"]["spec"]
    c = results["ceilings"]
    lines = [
        f"Run: {_run_label(results)}" + (" — **CPU run: reduced workloads, wall clock, no L2 flush; not comparable with GPU figures**" if results["cpu_run"] else ""),
        _trust_line(results),
        f"Record: `{manifest['run']['metadata']['name']}` — status {spec['status']}, observed {spec['observedAt']}",
        f"Primary measurement: {results['primary_timer']} {results['statistic']} of {_repetitions_text(results)}; "
        f"SOL from {results['protocol']['sol']['ceilings']}: "
        f"{si(c['flops_per_s'], 'FLOP/s')}, {si(c['bytes_per_s'], 'B/s')}",
        f"Reference (oracle and baseline): {results['reference_label']}",
        f"Comparison group: `{manifest['run']['metadata']['labels']['comparisonGroup']}`",
        f"protocolDigest `{spec['protocolDigest']}`",
        f"workloadDigest `{spec['workloadDigest']}`",
        f"environmentDigest `{spec['environmentDigest']}`",
        f"implementationDigest `{spec['implementationDigest']}`",
    ]
    g = floor_ratio_geomean(results)
    if g is not None:
        fl = results.get("floor_flags") or {}
        lines.append(f"Geomean fusedqkv / two-GEMM floor: {g:.3f} ({results['primary_timer']} {results['statistic']})"
                     + (f" — **floor_unsteady** on {', '.join(fl)}: the floor timed slower than the kernel it "
                        "bounds, so those ratios are no bound" if fl else ""))
    if group_rank:
        lines.append("Rank in comparison group: " + "; ".join(group_rank))
    if citation:
        lines.append(f"Cite: `{citation}`")
    if attestation:
        a = attestation["spec"]
        lines.append(f"Reproduction of `{a['subject']['name']}` ({a['subject']['recordDigest'][:19]}): "
                     + ("agrees" if a["verdict"] == "agrees" else "**disagrees**")
                     + f" within the rule ({a['rule']['latency']}; {a['rule']['status']}; {a['rule']['digests']})"
                     + (": " + "; ".join(a["discrepancies"]) if a["discrepancies"] else ""))
    return lines


def _flag_rules(results: dict) -> list:
    """The Flags section: what each flag means and the thresholds in force."""
    cpu = results["cpu_run"]
    lines = ["S in [0, 1] needs T_sol <= T and T_sol < T_b; a row outside that, or whose bound or timings "
             "cannot be trusted, is flagged (its score is kept as computed, never clipped), and a run with a "
             "flagged row is flagged: `fusedqkv runs` ranks it after every unflagged run."]
    lines += [f"`{k}`: {v}" for k, v in trust.FLAGS.items()
              if cpu or k in ("below_sol", "bound_not_below_baseline", "bound_unsteady", "floor_unsteady")]
    if not cpu:
        lines.append("GPU run: device clocks; the spread of the repetitions and host load are recorded, not flagged.")
    if results.get("bound_flags"):
        lines.append("This run's SOL bound: " + ", ".join(results["bound_flags"]) + " (measured ceilings in results.json)")
    return lines


_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*")


def _inline_html(text: str) -> str:
    """The markdown of a header line as HTML: `code` spans and **bold**, everything else escaped."""
    out = html.escape(text)
    out = _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", out)
    return _BOLD.sub(lambda m: f"<b>{m.group(1)}</b>", out)


def write_report(results: dict, recs: dict, manifest: dict, out_dir: Path, group_rank=None, citation=None,
                 attestation=None) -> dict:
    """Writes results.json, manifest.json, records/*.json, report.md, report.html, latency.png.
    ``citation``: the record's citation line (``records.citation``); ``attestation``: the verdict of
    a reproduction (``attest.make_attestation``), both shown in the header."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    paths["results.json"] = out_dir / "results.json"
    paths["results.json"].write_text(json.dumps({**results, "records": recs}, indent=1, default=str))
    paths["manifest.json"] = out_dir / "manifest.json"
    paths["manifest.json"].write_text(json.dumps(manifest, indent=1, sort_keys=True))
    rec_dir = out_dir / "records"
    rec_dir.mkdir(exist_ok=True)
    for n, r in recs.items():
        (rec_dir / f"{n}.json").write_text(json.dumps(r, indent=1, sort_keys=True))
    paths["latency.png"] = latency_plot(results, out_dir / "latency.png")

    group_rank = group_rank or []
    head = _header_lines(results, manifest, group_rank, citation, attestation)
    summ, wl = summary_table(results, recs), workload_table(results)
    title = f"fusedqkv bench — {results['definition']}" + (" — CPU run" if results["cpu_run"] else "")
    env_json = json.dumps(results["environment"], indent=1, sort_keys=True)
    proto_json = json.dumps(results["protocol"], indent=1, sort_keys=True)
    failures = []
    for r in results["workloads"]:
        for n, x in r["impls"].items():
            for c in x.get("checks", []):
                if not c["passed"]:
                    failures.append({"workload": r["workload"], "implementation": n, "output": c["name"],
                                     "matched": f"{c['matched_ratio']:.4%}", "max_abs_err": _f(c["max_abs_err"], "{:.4g}"),
                                     "reason": c["reason"]})
            if x["status"] != "ok":
                failures.append({"workload": r["workload"], "implementation": n, "output": "-", "matched": "-",
                                 "max_abs_err": "-", "reason": x.get("error", "")})

    md = [f"# {title}", ""] + [f"- {l}" for l in head] + [
        "", "## Summary (run level)", "",
        "SOL score S = 1/(1 + (T − T_sol)/(T_b − T_sol)), T_b = eager reference of this run; a workload "
        "that fails correctness scores 0. Speed-up = T_b / T (mean of ratios and geomean); faster = T < T_b.", "",
        _md_table(summ), "", "## Per workload", "",
        f"Per implementation: latency in ms ({results['primary_timer']} {results['statistic']}" +
        ("; CUDA events beside it" if results["primary_timer"] == "kernel_span" else "") +
        "), correctness (official policy) and SOL score S; `sol ms` is the roofline bound." +
        (" B200 figures are the dataset's, as figures." if not results["cpu_run"] else ""), "",
        _md_table(wl), "", "## Correctness failures", "",
        _md_table(failures) if failures else "None.", "",
        "## Flags", ""] + [f"- {l}" for l in _flag_rules(results)] + [
        "", "![latency](latency.png)", "", "## Protocol", "", "```json", proto_json, "```", "",
        "## Environment", "", "```json", env_json, "```", ""]
    paths["report.md"] = out_dir / "report.md"
    paths["report.md"].write_text("\n".join(md))

    png64 = base64.b64encode(paths["latency.png"].read_bytes()).decode()
    # the plot scales down to the page; wide tables scroll inside their own box
    css = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
           "margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}"
           "td.num{text-align:right;font-variant-numeric:tabular-nums}"
           "th{background:#f0f0f0}td.fail{background:#fdd}code,pre{background:#f6f6f6}"
           "pre{white-space:pre-wrap;overflow-wrap:anywhere}.scroll{max-width:100%;overflow-x:auto}"
           "img.plot{display:block;max-width:100%;height:auto}"
           ".cpu{background:#fff3cd;padding:.5em;border:1px solid #e0c060}"
           ".flagged{background:#fdd;padding:.5em;border:1px solid #d66}summary{cursor:pointer}")
    h = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
         f"<style>{css}</style></head><body><h1>{html.escape(title)}</h1>"]
    if results["cpu_run"]:
        h.append("<p class='cpu'><b>CPU run</b>: reduced workloads, wall clock, no L2 flush; "
                 "not comparable with GPU figures.</p>")
    if any((results["summary"][n].get("trust") or {}).get("flagged") for n in results["summary"]
           if results["summary"][n]["role"] != "bound"):
        h.append("<p class='flagged'><b>Flagged</b>: some rows of this run cannot be trusted (see Flags); "
                 "<code>fusedqkv runs</code> ranks it after every unflagged run.</p>")
    h.append("<ul>" + "".join(f"<li>{_inline_html(l)}</li>" for l in head) + "</ul>")
    h.append("<h2>Summary (run level)</h2>" + _html_table(summ))
    h.append("<h2>Per workload</h2>" + _html_table(wl))
    h.append("<h2>Correctness failures</h2>" + (_html_table(failures) if failures else "<p>None.</p>"))
    h.append("<h2>Flags</h2><ul>" + "".join(f"<li>{_inline_html(l)}</li>" for l in _flag_rules(results)) + "</ul>")
    h.append(f"<h2>Latency against the SOL bound</h2><img class='plot' alt='latency' "
             f"src='data:image/png;base64,{png64}'/>")
    h.append("<h2>Manifest</h2><details><summary>The KernelIndex record of this run (also in "
             "<a href='manifest.json'>manifest.json</a>)</summary>"
             f"<pre>{html.escape(json.dumps(manifest, indent=1, sort_keys=True))}</pre></details>")
    h.append("</body></html>")
    paths["report.html"] = out_dir / "report.html"
    paths["report.html"].write_text("".join(h))
    return paths
