"""benchmarks/sol_execbench_eval.{sh,py}: the parts of the evaluator recipe that run without a GPU
(the evaluator itself runs on the device)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_benchmark

from fusedqkv.bench import problem

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sol_execbench_eval.sh"


def _helper():
    return load_benchmark("sol_execbench_eval")


@pytest.fixture(scope="module")
def pack():
    p = problem.official_pack_dir()
    if p is None:
        pytest.skip("official pack not present")
    return p


def _trace(w, status, lat=None, ref=None):
    perf = None if lat is None else {"latency_ms": lat, "reference_latency_ms": ref, "speedup_factor": ref / lat}
    return {"definition": "091", "solution": "sol", "workload": {"uuid": w["uuid"], "axes": w["axes"]},
            "evaluation": {"status": status, "log": "line1\nTiming failed: x" if status != "PASSED" else "",
                           "correctness": {"max_absolute_error": 1e-3, "max_relative_error": 1e-2},
                           "performance": perf}}


def test_table_from_traces_floor_and_bench(pack, tmp_path):
    h = _helper()
    wls = [json.loads(x) for x in (pack / "workload.jsonl").read_text().splitlines() if x.strip()]
    chosen = [wls[5], wls[2]]  # out of order: the table follows the problem's order
    traces = [_trace(chosen[0], "PASSED", 0.2, 2.0), _trace(chosen[1], "PASSED", 0.05, 0.4)]
    floor = {"rows": [{"uuid": chosen[0]["uuid"], "floor_ms": 0.16}, {"uuid": chosen[1]["uuid"], "floor_ms": 0.04}]}
    bench = {"workloads": [{"uuid": c["uuid"], "impls": {
        "fusedqkv": {"status": "ok", "timings": {"kernel_span": {"median": lat * 1.02, "source": "cupti"},
                                                 "cuda_events": {"median": lat * 1.3}}},
        "gemm_floor": {"status": "ok", "timings": {"kernel_span": {"median": 0.1}, "cuda_events": {"median": 0.12}}}}}
        for c, lat in zip(chosen, (0.2, 0.05))]}
    (tmp_path / "traces.jsonl").write_text("\n".join(json.dumps(t) for t in traces) + "\n")
    (tmp_path / "floor.json").write_text(json.dumps(floor))
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    rc = h.main(["table", "--problem", str(pack), "--traces", str(tmp_path / "traces.jsonl"), "--floor",
                 str(tmp_path / "floor.json"), "--bench", str(tmp_path / "bench.json"), "--out", str(tmp_path / "t.json")])
    assert rc == 0
    t = json.loads((tmp_path / "t.json").read_text())
    assert [r["index"] for r in t["rows"]] == [2, 5]
    r2, r5 = t["rows"]
    assert r5["status"] == "PASSED" and r5["latency_ms"] == 0.2 and r5["reference_latency_ms"] == 2.0
    assert r5["speedup"] == pytest.approx(10.0) and r5["fused_over_floor"] == pytest.approx(1.25)
    assert r5["bench_fusedqkv_span_ms"] == pytest.approx(0.204) and r5["bench_span_source"] == "cupti"
    s = t["summary"]
    assert s["passed"] == 2 and s["geomean_speedup"] == pytest.approx(math.sqrt(10 * 8))
    assert s["geomean_fused_over_floor"] == pytest.approx(1.25)
    assert s["geomean_bench_span_over_evaluator"] == pytest.approx(1.02)
    # a failed row: exit status 1, its log kept; merge of two parts
    (tmp_path / "bad.jsonl").write_text(json.dumps(_trace(wls[0], "RUNTIME_ERROR")) + "\n")
    assert h.main(["table", "--problem", str(pack), "--traces", str(tmp_path / "bad.jsonl"),
                   "--out", str(tmp_path / "bad.json")]) == 1
    bad = json.loads((tmp_path / "bad.json").read_text())
    assert bad["rows"][0]["log_tail"].endswith("Timing failed: x") and bad["summary"]["geomean_speedup"] is None
    assert h.main(["merge", "--out", str(tmp_path / "m.json"), str(tmp_path / "bad.json"), str(tmp_path / "t.json")]) == 1
    m = json.loads((tmp_path / "m.json").read_text())
    assert [r["index"] for r in m["rows"]] == [0, 2, 5] and m["summary"]["passed"] == 2


def test_problem_subset_and_cut(pack, tmp_path):
    h = _helper()
    assert h.main(["problem", "--problem", str(pack), "--dest", str(tmp_path / "p"), "--workloads", "2,13-14",
                   "--max-tokens", "8"]) == 0
    wls = [json.loads(x) for x in (tmp_path / "p" / "workload.jsonl").read_text().splitlines() if x.strip()]
    assert len(wls) == 3 and all(w["axes"]["batch_size"] * w["axes"]["seq_len"] <= 8 for w in wls)
    assert (tmp_path / "p" / "definition.json").read_text() == (pack / "definition.json").read_text()
    with pytest.raises(SystemExit, match="outside 0..15"):
        h.main(["problem", "--problem", str(pack), "--dest", str(tmp_path / "q"), "--workloads", "16"])


def test_script_refuses_bad_arguments(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--problem", str(tmp_path / "none"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no definition.json" in r.stderr
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Device command" in r.stdout and "--wheels .whl" in r.stdout


def test_helper_imports_no_fusedqkv():
    """The helper runs where fusedqkv must not be importable."""
    text = (ROOT / "benchmarks" / "sol_execbench_eval.py").read_text()
    assert "import fusedqkv" not in text and "from fusedqkv" not in text
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sol_execbench_eval.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "floor" in r.stdout
