"""benchmarks/bench_floor.py's logic on the CPU: the --smoke run (tiny shapes, wall clock, no
graphs; no timing value) with --steady writes both regimes' ratios for every mode."""

import json
import sys

from _scripts import load_benchmark


def test_bench_floor_smoke_with_steady(tmp_path, monkeypatch):
    bf = load_benchmark("bench_floor")
    monkeypatch.setattr(sys, "argv", ["bench_floor.py", "--smoke", "--rows", "0", "--reps", "2", "--steady", "0.02",
                                      "--out", str(tmp_path)])
    assert bf.main() == 0
    rows = json.loads((tmp_path / "bench_floor.json").read_text())["rows"]
    assert len(rows) == 1
    r = rows[0]
    for mode in bf.MODES:
        for key in ("fused_over_floor", "compile_over_floor", "steady_fused_over_floor", "steady_compile_over_floor"):
            assert r[mode][key] > 0, (mode, key)
    assert set(r["steady"]) == {f"{p}/{m}" for p in bf.PROVIDERS for m in bf.MODES}
    assert all(v["ms"] > 0 for v in r["steady"].values())
