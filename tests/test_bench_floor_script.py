"""benchmarks/bench_floor.py's logic on the CPU: the --smoke run (tiny shapes, wall clock, no
graphs; no timing value) with --steady writes both regimes' ratios for every mode.

The run is a process of its own, with Inductor's CPU kernels held to AVX2: on session 20's AVX-512 BF16
EPYC (torch 2.13 CPU), Inductor's AVX-512 kernels of the compiled reference's backward abort the
process ("double free or corruption", the same with d12cf22's fusedqkv: torch's, not ours) -- in the
full suite that killed a pytest-xdist worker and hung the run. The test checks bench_floor's logic,
not Inductor's instruction set."""

import json
import os
import subprocess
import sys

from _scripts import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_floor_smoke_with_steady(tmp_path):
    bf = load_benchmark("bench_floor")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]),
               ATEN_CPU_CAPABILITY="avx2")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_floor.py"), "--smoke", "--rows", "0",
                        "--reps", "2", "--steady", "0.02", "--out", str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_floor.json").read_text())["rows"]
    assert len(rows) == 1
    r = rows[0]
    for mode in bf.MODES:
        for key in ("fused_over_floor", "compile_over_floor", "steady_fused_over_floor", "steady_compile_over_floor"):
            assert r[mode][key] > 0, (mode, key)
    assert set(r["steady"]) == {f"{p}/{m}" for p in bf.PROVIDERS for m in bf.MODES}
    assert all(v["ms"] > 0 for v in r["steady"].values())
