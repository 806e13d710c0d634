"""`fusedqkv runs import` of NVIDIA's evaluator's traces and of a published KernelIndex record,
`runs --compare A B` across clocks and `runs --cite`, on the shared files (skipped without them).
Nothing here benchmarks: records only."""

import copy
import json
import math
import re

import pytest

from fusedqkv import cli
from fusedqkv.bench import harness, problem, records, solution

SHARED = problem.shared_dir("records")
TRACES = SHARED / "h200-official-traces-2026-12-02.jsonl" if SHARED else None
SEED = SHARED / "sol-submission-1519.kernelindex.json" if SHARED else None
needs_shared = pytest.mark.skipif(not (TRACES and TRACES.is_file() and SEED.is_file()),
                                  reason="../shared/records not present")


def _lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _import(store, path, *extra):
    return cli.main(["runs", "import", str(path), "--store", str(store), *extra])


def _one_line_error(capsys, argv, pattern, code=cli.EXIT_USAGE):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert lines[0].startswith("fusedqkv: error: ") and re.search(pattern, lines[0]), lines[0]


def _only(store):
    (rec,) = records.load_runs(str(store))
    return rec


@needs_shared
def test_traces_import_is_a_valid_record_with_the_files_figures(tmp_path, capsys):
    store = tmp_path / "store"
    assert _import(store, TRACES, "--stack-version", "v1.0") == 0
    out = capsys.readouterr().out
    rec = _only(store)
    assert records.validate_record(rec) == [] and records.verify(rec)["status"] == "verified"
    # recomputed here from the file, independently of the importer
    rows = _lines(TRACES)
    lat = [r["evaluation"]["performance"]["latency_ms"] for r in rows]
    faster = sum(1 for r in rows if r["evaluation"]["performance"]["reference_latency_ms"]
                 > r["evaluation"]["performance"]["latency_ms"])
    spec = rec["run"]["spec"]
    m = spec["sourceNative"]["metrics"]
    assert m["latency_ms"] == pytest.approx(sum(lat) / len(lat), rel=1e-12)
    assert spec["timing"]["latencyNs"]["mean"] == round(sum(lat) / len(lat) * 1e6)
    assert m["fast_1_count"] == faster and m["fast_1_total"] == len(rows) == 16
    speedups = [r["evaluation"]["performance"]["speedup_factor"] for r in rows]
    assert m["avg_speedup"] == pytest.approx(sum(speedups) / len(speedups))
    assert 0 < m["sol_score"] <= 1 and "H200" in spec["sourceNative"]["solSource"]
    assert spec["status"] == "passed" and spec["timing"]["primaryStatistic"] == "mean"
    p = rec["protocol"]["spec"]
    assert p["harness"] == {"name": "SOL-ExecBench evaluation stack", "version": "v1.0"}
    assert p["measurement"]["timer"] == "harness_reported" and p["correctness"]["comparator"] == "sol_execbench_eval"
    env = rec["environment"]["spec"]
    assert env["hardware"]["product"] == "NVIDIA H200"
    assert env["software"]["libraries"]["torch"] == rows[0]["evaluation"]["environment"]["libs"]["torch"]
    assert records.group_of(rec).endswith("nvidia-h200.sol-execbench-evaluation-stack-v1-0")
    assert rec["imported"]["origin"] == "evaluator traces" and rec["imported"]["verification"]["status"] == "verified"
    assert "digests verified" in out and "harness_reported" in out
    # the same file again: already there, nothing new
    assert _import(store, TRACES, "--stack-version", "v1.0") == 0
    assert "already in the run store" in capsys.readouterr().out and len(records.load_runs(str(store))) == 1


@needs_shared
def test_a_failed_or_missing_workload_fails_the_run_and_is_named(tmp_path, capsys):
    rows = _lines(TRACES)
    rows[3]["evaluation"]["status"] = "INCORRECT_NUMERICAL"
    dropped = rows.pop(5)
    f = tmp_path / "traces.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _import(tmp_path / "s", f, "--stack-version", "v1.0") == 0
    rec = _only(tmp_path / "s")
    spec = rec["run"]["spec"]
    defn = problem.load_definition()
    bad = next(w.name for w in defn.workloads if w.uuid == rows[3]["workload"]["uuid"])
    gone = next(w.name for w in defn.workloads if w.uuid == dropped["workload"]["uuid"])
    assert spec["status"] == "failed"
    assert spec["sourceNative"]["failedWorkloads"] == [f"{bad} (INCORRECT_NUMERICAL)"]
    assert spec["sourceNative"]["missingWorkloads"] == [gone]
    assert spec["sourceNative"]["metrics"]["fast_1_total"] == 15
    capsys.readouterr()
    assert cli.main(["runs", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"failed: {bad} (INCORRECT_NUMERICAL), {gone} (missing)" in out


@needs_shared
def test_traces_with_their_solution_json_take_its_digest(tmp_path, capsys):
    name = _lines(TRACES)[0]["solution"]
    sol = {"name": name, "definition": problem.DEFAULT_DEFINITION,
           "sources": [{"path": "main.py", "content": "def run(*a):\n    pass\n"}]}
    (tmp_path / "solution.json").write_text(json.dumps(sol))
    assert _import(tmp_path / "s", TRACES, "--stack-version", "v1.0", "--solution", str(tmp_path / "solution.json")) == 0
    rec = _only(tmp_path / "s")
    assert rec["run"]["spec"]["implementationDigest"] == solution.sources_digest(sol)
    assert records.verify(rec)["status"] == "verified"
    (tmp_path / "other.json").write_text(json.dumps({**sol, "name": "another_solution"}))
    _one_line_error(capsys, ["runs", "import", str(TRACES), "--store", str(tmp_path / "t"), "--stack-version", "v1",
                             "--solution", str(tmp_path / "other.json")], r"--solution: its name 'another_solution'")
    _one_line_error(capsys, ["runs", "import", str(TRACES), "--store", str(tmp_path / "t")],
                    r"--stack-version: the traces do not name the evaluation stack's version")
    assert not (tmp_path / "t").exists()


@needs_shared
def test_seed_manifest_is_an_unverified_external_record_in_its_own_group(tmp_path, capsys):
    store = tmp_path / "store"
    assert _import(store, SEED) == 0
    out = capsys.readouterr().out
    assert "external; digests unverified" in out and "unverified:" in out
    assert _import(store, TRACES, "--stack-version", "v1.0") == 0
    seed = next(r for r in records.load_runs(str(store)) if r["run"]["metadata"]["name"] == "sol-submission-1519")
    published = json.loads(SEED.read_text())
    assert {k: seed[k] for k in ("run", "protocol", "environment")} == published  # stored as published
    assert records.verify(seed)["status"] == "unverified" and seed["imported"]["origin"] == "external"
    assert records.digest(published["protocol"]) != published["run"]["spec"]["protocolDigest"]
    groups = records.groups(records.load_runs(str(store)))
    assert len(groups) == 2  # the B200 v1.0 leaderboard run and the H200 evaluator run apart
    assert records.group_of(seed) == "091-fused-gqa-qkv-rope-qk-norm-backward.nvidia-b200.sol-execbench-evaluation-stack-v1-0"
    capsys.readouterr()
    assert cli.main(["runs", "--store", str(store), "--group", records.group_of(seed)]) == 0
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if "sol-submission-1519" in ln)
    assert "UNVERIFIED" in row and "0.5245" in row and "11/16" in row
    assert "1 unverified record(s)" in text and "NVIDIA B200" in text and "v1.0" in text
    assert cli.main(["runs", "--store", str(store), "--group", "all", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert {g["group"]: g["verification"] for g in js}[records.group_of(seed)] == {"sol-submission-1519": "unverified"}
    # one run compared with the #1 of another group: refused, saying why
    other = next(g for g in groups if g != records.group_of(seed))
    _one_line_error(capsys, ["runs", "--store", str(store), "--group", other, "--compare", "sol-submission-1519"],
                    r"it is in comparison group .*nvidia-b200.* not .*records compare only within one group "
                    r"\(same definition, GPU type and SOL-ExecBench evaluation stack v1.0\)")


@needs_shared
def test_manifest_missing_fields_are_named(tmp_path, capsys):
    bad = json.loads(SEED.read_text())
    del bad["run"]["spec"]["sourceNative"]["metrics"]["fast_1_total"]
    del bad["run"]["spec"]["observedAt"]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    _one_line_error(capsys, ["runs", "import", str(f), "--store", str(tmp_path / "s")],
                    r"not a KernelIndex record: missing or malformed run.spec.observedAt, "
                    r"run.spec.sourceNative.metrics.fast_1_total")
    bad = json.loads(SEED.read_text())
    del bad["environment"]["spec"]["hardware"]
    f.write_text(json.dumps(bad))
    _one_line_error(capsys, ["runs", "import", str(f), "--store", str(tmp_path / "s")],
                    r"missing or malformed environment.spec.hardware.product")
    assert not (tmp_path / "s").exists()


def _bench_like(traces, factors, events_factors, solution_digest, hw="NVIDIA H200"):
    """A record of `fusedqkv bench`'s shape on the traces' workloads: span = evaluator / factor,
    events = evaluator / events factor (made up here, so the table's ratios are known)."""
    import torch

    defn = problem.load_definition()
    by_uuid = {w.uuid: w for w in defn.workloads}
    per = []
    for t, f, g in zip(traces, factors, events_factors):
        lat = t["evaluation"]["performance"]["latency_ms"]
        w = by_uuid[t["workload"]["uuid"]]
        per.append({"workload": w.name, "uuid": w.uuid, "axes": dict(w.axes), "status": "ok", "correct": True,
                    "latency_ms": {"median": lat / f, "mean": lat / f, "n": 50},
                    "otherTimers": {"cuda_events": {"median": lat / g, "mean": lat / g}}})
    proto = harness.protocol_for(torch.device("cuda"), 50, 10, "kernel_span", ["kernel_span", "cuda_events"],
                                 "median", "datasheet (NVIDIA H200 SXM)", defn.name, "cupti")
    env = {"kind": "ExecutionEnvironment", "deviceType": "cuda", "hardwareName": hw, "gpu": {"name": hw}}
    ws = {"definition": defn.name, "deviceReduced": False, "maxTokens": None,
          "workloads": [w.to_json() for w in defn.workloads]}
    lat = sum(p["latency_ms"]["median"] for p in per) / len(per)
    return records.make_record(
        definition=defn.name, implementation="fusedqkv", impl_label="fusedqkv", protocol=proto, workloads=ws,
        env=env, implementation_sources={"files": {"x": "0" * 64}},
        metrics={"sol_score": 0.9, "latency_ms": lat, "avg_speedup": 5.0, "fast_1_count": 16, "fast_1_total": 16},
        latency_ms_mean=lat, latency_ms_median=lat, primary_statistic="median", status="Succeeded",
        observed_at="2026-12-02T00:00:00Z", cpu_run=False, per_workload=per, solution_digest=solution_digest)


@needs_shared
def test_compare_across_clocks_prints_the_per_workload_table(tmp_path, capsys):
    store = tmp_path / "store"
    assert _import(store, TRACES, "--stack-version", "v1.0") == 0
    traces = _lines(TRACES)
    ev = _only(store)
    suffix = re.search(r"_([0-9a-f]{8})$", traces[0]["solution"]).group(1)
    factors = [0.90 + 0.01 * i for i in range(16)]
    ev_factors = [0.937 + 0.002 * (i % 3) for i in range(16)]
    ours = _bench_like(traces, factors, ev_factors, "sha256:" + suffix + "0" * 56)
    records.save_run(ours, str(store))
    a, b = ours["run"]["metadata"]["name"], ev["run"]["metadata"]["name"]
    capsys.readouterr()
    assert cli.main(["runs", "--store", str(store), "--compare", a, b]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("cross-group:") for ln in out)
    assert any(ln.startswith("implementation: the same") for ln in out)
    head = next(i for i, ln in enumerate(out) if "harness_reported/kernel_span" in ln)
    cols = out[head].split()
    table = out[head + 1:head + 17]
    by_name = {w.uuid: w.name for w in problem.load_definition().workloads}
    for t, f, g, ln in zip(traces, factors, ev_factors, table):
        cells = ln.split()
        assert cells[0] == by_name[t["workload"]["uuid"]]
        assert float(cells[-2]) == pytest.approx(f, abs=6e-4)  # B/A = evaluator / (evaluator / f)
        assert float(cells[-1]) == pytest.approx(g, abs=6e-4)
        assert float(cells[4]) == pytest.approx(t["evaluation"]["performance"]["latency_ms"], abs=6e-5)
    geo = out[head + 17].split()
    assert geo[0] == "geomean" and cols[-1] == "harness_reported/cuda_events"
    assert float(geo[-2]) == pytest.approx(math.exp(sum(map(math.log, factors)) / 16), abs=6e-4)
    assert float(geo[-1]) == pytest.approx(math.exp(sum(map(math.log, ev_factors)) / 16), abs=6e-4)
    assert "16 workloads in common" in out[head + 18]


@needs_shared
def test_compare_refuses_what_cannot_share_a_table(tmp_path, capsys):
    store = tmp_path / "store"
    assert _import(store, TRACES, "--stack-version", "v1.0") == 0
    assert _import(store, SEED) == 0
    ev = next(r for r in records.load_runs(str(store)) if r["run"]["metadata"]["name"] != "sol-submission-1519")
    name = ev["run"]["metadata"]["name"]
    capsys.readouterr()
    _one_line_error(capsys, ["runs", "--store", str(store), "--compare", "sol-submission-1519", name],
                    r"--compare: sol-submission-1519 ran on NVIDIA B200, .* on NVIDIA H200: records compare only "
                    r"within one GPU type")
    b200 = _bench_like(_lines(TRACES), [1.0] * 16, [1.0] * 16, None, hw="NVIDIA B200")
    records.save_run(b200, str(store))
    _one_line_error(capsys, ["runs", "--store", str(store), "--compare", b200["run"]["metadata"]["name"],
                             "sol-submission-1519"], r"sol-submission-1519 has no per-workload latencies")
    _one_line_error(capsys, ["runs", "--store", str(store), "--compare", name, "nope"], r"--compare nope: no run")
    _one_line_error(capsys, ["runs", "--store", str(store), "--compare", "a", "b", "c"],
                    r"--compare: expected one run name .* or two .* got 3")


@needs_shared
def test_cite_prints_name_digest_date_and_path(tmp_path, capsys):
    store = tmp_path / "store"
    assert _import(store, SEED) == 0
    capsys.readouterr()
    assert cli.main(["runs", "--store", str(store), "--cite", "sol-submission-1519"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    digest = records.record_digest(json.loads(SEED.read_text()))
    path = store / "sol-submission-1519.json"
    assert line == f"sol-submission-1519, {digest}, observed 2026-04-23, {path}"
    assert path.is_file()
    _one_line_error(capsys, ["runs", "--store", str(store), "--cite", "nope"], r"--cite nope: no run of that name")


@pytest.mark.parametrize("make, argv, pattern", [
    (None, lambda t: ["runs", "import", str(t / "absent.jsonl")], r"runs import .*absent.jsonl: cannot read"),
    (lambda t: (t / "x.jsonl").write_text('not json\n{"a": 1}\n'), lambda t: ["runs", "import", str(t / "x.jsonl")],
     r"x.jsonl: expected a KernelIndex record .* or traces.jsonl"),
    (lambda t: (t / "x.jsonl").write_text('{"workload": {}, "evaluation": {}}\n{"b": 2}\n'),
     lambda t: ["runs", "import", str(t / "x.jsonl")], r"line 2: expected an evaluator trace"),
    (lambda t: (t / "x.json").write_text('{"kind": "thing"}'), lambda t: ["runs", "import", str(t / "x.json")],
     r"expected a KernelIndex record .* got a JSON object with keys kind"),
    (None, lambda t: ["runs", "import"], r"runs import: expected FILE"),
    (None, lambda t: ["runs", "export", "x"], r"runs: unknown action 'export'; expected: runs import FILE"),
    (None, lambda t: ["runs", "--stack-version", "v1"], r"--stack-version: only with 'runs import TRACES.jsonl'"),
], ids=["absent", "not-json", "not-a-trace", "neither", "no-file", "unknown-action", "stray-flag"])
def test_bad_input_is_one_line_naming_it(make, argv, pattern, tmp_path, capsys):
    if make:
        make(tmp_path)
    _one_line_error(capsys, [*argv(tmp_path), "--store", str(tmp_path / "s")], pattern)
    assert not (tmp_path / "s").exists()


def test_record_digest_ignores_the_stores_bookkeeping():
    rec = _bench_like([{"workload": {"uuid": w.uuid}, "evaluation": {"performance": {"latency_ms": 1.0}}}
                       for w in problem.load_definition().workloads], [1.0] * 16, [1.0] * 16, None)
    kept = copy.deepcopy(rec)
    kept["imported"] = {"origin": "x"}
    assert records.record_digest(kept) == records.record_digest(rec)
    kept["run"]["spec"]["sourceNative"]["metrics"]["sol_score"] = 0.1
    assert records.record_digest(kept) != records.record_digest(rec)
