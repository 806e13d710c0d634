"""The papercuts a new user hit: bad repetition counts, the reduced workload names a CPU run
prints, where the official pack comes from, `runs` with long names, and the HTML report."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from fusedqkv import cli
from fusedqkv.bench import harness, problem, records, report

# one test times the CPU (`serial`: alone under pytest-xdist, conftest); the others assert nothing on a timing

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--max-tokens", "8", "--reps", "1", "--warmup", "0", "--quiet", "--no-store"]


def _one_line_error(capsys, argv, pattern):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == cli.EXIT_USAGE and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("bad, pattern", [
    (["--reps", "0"], r"--reps: expected a whole number > 0, got 0"),
    (["--reps", "-3"], r"--reps: expected a whole number > 0, got -3"),
    (["--warmup", "-1"], r"--warmup: expected a whole number >= 0, got -1"),
    (["--time-budget", "0"], r"--time-budget: expected a number > 0, got 0"),
    (["--max-tokens", "0"], r"--max-tokens: expected a whole number > 0, got 0"),
    (["--workloads", "w00_b32_s300"], r"unknown workload 'w00_b32_s300'"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_bad_arguments_leave_out_and_store_untouched(bad, pattern, tmp_path, capsys):
    """`--quick --workloads 0 --reps 0` used to run 3 repetitions and overwrite runs/latest."""
    out = tmp_path / "latest"
    out.mkdir()
    (out / "report.md").write_text("the previous run")
    store = tmp_path / "store"
    _one_line_error(capsys, ["bench", "--device", "cpu", "--quick", "--workloads", "0", *bad, "--out", str(out),
                             "--store", str(store)], pattern)
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert (out / "report.md").read_text() == "the previous run"
    assert not store.exists()
    new = tmp_path / "new"
    _one_line_error(capsys, ["bench", "--device", "cpu", *bad, "--out", str(new)], pattern)
    assert not new.exists()  # not even created


def test_the_names_a_cpu_run_prints_are_accepted_back():
    defn = problem.load_definition()
    cpu = harness.resolve_device("cpu")
    for quick in (False, True):
        printed, cap = harness.resolve_workloads(defn, None, cpu, quick=quick, max_tokens=None)
        again, cap2 = harness.resolve_workloads(defn, [w.name for w in printed], cpu, quick=quick, max_tokens=None)
        assert [w.name for w in again] == [w.name for w in printed] and cap2 == cap
        assert [w.axes for w in again] == [w.axes for w in printed]
    # the example of the issue: the full CPU run prints w00_b32_s4 (w00_b32_s256 cut to 128 tokens)
    (w,), _ = harness.resolve_workloads(defn, ["w00_b32_s4"], cpu, quick=False, max_tokens=None)
    assert w.index == 0 and w.axes == {"batch_size": 32, "seq_len": 4}
    # a reduced name keeps the size it names, also under another cap
    (w,), _ = harness.resolve_workloads(defn, ["w00_b32_s4"], cpu, quick=True, max_tokens=None)
    assert w.axes == {"batch_size": 32, "seq_len": 4}
    for bad in ("w00_b32_s300", "w00_b16_s8", "w99_b1_s1"):  # not a reduction of that workload
        with pytest.raises(harness.BenchError, match=f"unknown workload '{bad}'"):
            harness.resolve_workloads(defn, [bad], cpu, quick=False, max_tokens=None)


def test_reduced_name_round_trip_through_the_cli(tmp_path):
    out = tmp_path / "o"
    assert cli.main(["bench", *TINY, "--workloads", "w13_b2_s1", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [w["workload"] for w in res["workloads"]] == ["w13_b2_s1"]


def test_readme_says_what_the_official_pack_is():
    text = (ROOT / "README.md").read_text()
    sec = text[text.index("## `fusedqkv bench`"):text.index("## Layout")]
    assert "FUSEDQKV_SOL_EXECBENCH" in sec and "official pack" in sec
    assert "definition.json" in sec and "../shared/sol-execbench" in sec


def test_missing_pack_label_says_how_to_point_at_it(monkeypatch):
    monkeypatch.setattr(problem, "official_pack_dir", lambda name=problem.DEFAULT_DEFINITION: None)
    _, label = problem.reference_impl()
    assert "official pack not found" in label and "FUSEDQKV_SOL_EXECBENCH" in label


def _fake_pack(root: Path) -> Path:
    pack = root / "sol-execbench" / problem.DEFAULT_DEFINITION
    pack.mkdir(parents=True)
    (pack / "definition.json").write_text(json.dumps({"name": problem.DEFAULT_DEFINITION, "reference": ""}))
    return pack


@pytest.mark.parametrize("given", ["sol-execbench", "pack", "shared"])
def test_the_pack_variable_takes_each_layout(tmp_path, monkeypatch, given):
    """$FUSEDQKV_SOL_EXECBENCH may name the folder holding the pack (SOL-ExecBench's layout), the pack
    itself, or a shared folder holding sol-execbench/ (what the device scripts carry): one lookup for
    the library and the benchmarks."""
    pack = _fake_pack(tmp_path / "shared")
    folder = {"sol-execbench": pack.parent, "pack": pack, "shared": tmp_path / "shared"}[given]
    monkeypatch.setenv(problem.PACK_ENV, str(folder))
    assert problem.official_pack_dir() == pack
    assert problem.pack_in(folder) == pack


def test_a_pack_variable_without_the_pack_is_refused_by_name(tmp_path, monkeypatch, capsys):
    """Set to a folder without the pack, the variable is an error naming it (not passed over for
    ../shared's pack or the eager re-implementation); `fusedqkv bench` says so in one line before --out is
    touched, and `export-solution --check` (whose check reads the pack) in one line too. A pack of another
    problem at that path is not taken for 091's."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "definition.json").write_text(json.dumps({"name": "090_something_else"}))
    for folder in (tmp_path / "empty", other):
        monkeypatch.setenv(problem.PACK_ENV, str(folder))
        with pytest.raises(ValueError, match=rf"FUSEDQKV_SOL_EXECBENCH={re.escape(str(folder))}: no "
                                             rf"{problem.DEFAULT_DEFINITION}/definition.json there"):
            problem.official_pack_dir()
    out = tmp_path / "out"
    _one_line_error(capsys, ["bench", *TINY, "--out", str(out)], r"^.*FUSEDQKV_SOL_EXECBENCH=.*other: no 091_")
    assert not out.exists()
    sol = tmp_path / "sol.json"  # export-solution --check reads the pack too: the same one line, no traceback
    _one_line_error(capsys, ["export-solution", "--out", str(sol), "--check"], r"FUSEDQKV_SOL_EXECBENCH=.*other")


def _record(name_suffix, observed):
    rec = records.make_record(
        definition="091_fused_gqa_qkv_rope_qk_norm_backward", implementation="fusedqkv", impl_label="x",
        protocol={"kind": "BenchmarkProtocol"}, workloads={"w": 1}, env=records.environment("cpu"),
        implementation_sources={"f": name_suffix},
        metrics={"sol_score": 0.6, "latency_ms": 1.0, "avg_speedup": 1.2, "fast_1_count": 1, "fast_1_total": 2},
        latency_ms_mean=1.0, latency_ms_median=1.0, primary_statistic="median", status="Succeeded",
        observed_at=observed, cpu_run=True)
    rec["run"]["metadata"]["name"] += name_suffix
    return rec


def test_runs_keeps_its_columns_aligned_with_long_names(tmp_path, capsys):
    store = str(tmp_path / "store")
    for suffix, t in (("", "2026-01-01T00:00:00Z"), ("-" + "x" * 40, "2026-01-02T00:00:00Z")):
        records.save_run(_record(suffix, t), store)
    capsys.readouterr()
    assert cli.main(["runs", "--store", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("# "))
    table = lines[head:head + 3]
    assert max(len(r.split()[1]) for r in table[1:]) > 100  # the long name is there, whole
    for col, value in (("impl", "fusedqkv"), ("status", "Succeeded"), ("SOL score", "0.6000")):
        starts = {re.search(rf"(?<= ){re.escape(value)}(?= )", ln).start() for ln in table[1:]}
        assert len(starts) == 1, (col, table)
        c = table[0].index(col)
        s = starts.pop()
        assert abs(s - c) <= 9, (col, table)  # under its header (right-aligned numbers end under it)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    assert cli.main(["bench", *TINY, "--workloads", "11", "--out", str(out)]) == 0
    return out


def test_html_renders_code_spans_and_folds_the_manifest(tiny_report):
    page = (tiny_report / "report.html").read_text()
    ul = page[page.index("<ul>"):page.index("</ul>")]
    assert "`" not in ul and "**" not in ul
    assert re.search(r"Record: <code>091-[^<]+</code>", ul)
    assert "<code>sha256:" in ul
    i = page.index("<h2>Manifest</h2>")
    tail = page[i:]
    assert tail.index("<details>") < tail.index("<pre>") < tail.index("</details>")
    assert "href='manifest.json'" in tail


def test_plot_legend_and_labels_match_what_it_shows(tiny_report):
    res = json.loads((tiny_report / "results.json").read_text())
    fig = report.latency_figure(res)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["fusedqkv", "eager"] and "SOL bound" in labels
    assert "failed correctness" not in labels and "red x" not in ax.get_title()  # nothing failed
    assert ("flagged (cannot be trusted)" in labels) == any(
        x.get("flags") for r in res["workloads"] for x in r["impls"].values())
    assert ax.get_xlabel().startswith("workload") and "latency" in ax.get_ylabel()
    top = max(x["timings"]["cpu_wall"]["p80"] for r in res["workloads"] for x in r["impls"].values())
    assert ax.get_ylim()[1] > top * 1.2  # the top point does not touch the frame
    # a failed row gets its red x and its legend entry
    bad = json.loads(json.dumps(res))
    bad["workloads"][0]["impls"]["fusedqkv"]["correct"] = False
    labels = [t.get_text() for t in report.latency_figure(bad).axes[0].get_legend().get_texts()]
    assert "failed correctness" in labels


def test_report_states_the_sol_ceilings_with_their_digits(tiny_report):
    """A CPU's measured ceiling read `0.0 TFLOP/s`: the figures now carry an SI prefix."""
    res = json.loads((tiny_report / "results.json").read_text())
    line = next(ln for ln in (tiny_report / "report.md").read_text().splitlines() if "SOL from" in ln)
    m = re.search(r": ([\d.]+) ([kMGTP]?)FLOP/s, ([\d.]+) ([kMGTP]?)B/s$", line)
    assert m, line
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    for value, prefix, exact in ((m[1], m[2], res["ceilings"]["flops_per_s"]), (m[3], m[4], res["ceilings"]["bytes_per_s"])):
        assert 1 <= float(value) < 1000, line  # the prefix that keeps the digits
        assert float(value) * scale[prefix] == pytest.approx(exact, rel=5e-4)
    assert report.si(1.34e10, "FLOP/s") == "13.4 GFLOP/s" and report.si(989.4e12, "FLOP/s") == "989.4 TFLOP/s"


FP32 = ["--device", "cpu", "--workloads", "11", "--max-tokens", "1", "--reps", "1", "--warmup", "0",
        "--dtype", "float32"]


@pytest.mark.serial  # the floor timed slower than the kernel
def test_a_floor_slower_than_the_kernel_is_flagged_unsteady(tmp_path, monkeypatch, capsys):
    """On the H200 a workload's two-GEMM floor came out slower than the fused kernel (0.711) with
    no flag. Here the floor is made slow on purpose."""
    import time

    real = harness.IMPLEMENTATIONS["gemm_floor"]

    def slow(ctx, args, ref_out):
        c = real.prepare(ctx, args, ref_out)
        return harness.Call(lambda *a: (time.sleep(0.25), harness._gemm_floor(*a))[1], c.inputs, c.outputs)

    monkeypatch.setitem(harness.IMPLEMENTATIONS, "gemm_floor", dataclasses.replace(real, prepare=slow))
    out = tmp_path / "o"
    assert cli.main(["bench", *FP32, "--impl", "fusedqkv,gemm_floor", "--quiet", "--no-store", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    (row,) = res["workloads"]
    assert row["impls"]["gemm_floor"]["latency_ms"] > row["impls"]["fusedqkv"]["latency_ms"]
    assert "floor_unsteady" in row["impls"]["gemm_floor"]["flags"]
    assert res["floor_flags"] == {"w11_b1_s1": row["impls"]["gemm_floor"]["flags"]}
    assert "floor_unsteady on w11_b1_s1: the floor timed slower than the kernel it bounds" in cap.out
    assert "gemm_floor (1/1 workloads: floor_unsteady 1" in cap.err
    md = (out / "report.md").read_text()
    assert "(floor unsteady)" in md and "**floor_unsteady** on w11_b1_s1" in md and "`floor_unsteady`:" in md
    # and the final line: the records folder, and no run store
    last = cap.out.strip().splitlines()[-1]
    assert "records/ (eager.json, fusedqkv.json)" in last and last.endswith("not added to a run store (--no-store)")


def test_compile_on_a_cpu_says_so_before_it_compiles(tmp_path, monkeypatch, capsys):
    """`--impl compile` on a CPU was silent for 40 s or more; now a note comes first (compile
    itself is stubbed here: the note is what is tested)."""
    import torch

    seen = []

    def fake_compile(fn, **kw):
        def first(*a):
            seen.append(capsys.readouterr().err)  # what the user had read when compiling would start
            return fn(*a)
        return first

    monkeypatch.setattr(torch, "compile", fake_compile)
    assert cli.main(["bench", *FP32, "--impl", "compile", "--no-store", "--out", str(tmp_path / "o")]) == 0
    assert seen and "compile: torch.compile of the reference compiles for this workload's shapes now" in seen[0]
    assert "40 s or more" in seen[0]
