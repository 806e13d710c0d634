"""`fusedqkv export-solution`: a SOL-ExecBench solution.json that runs from its own sources."""

import inspect
import json
import tempfile

from fusedqkv import cli
from fusedqkv.bench import problem, solution


def test_solution_fields():
    sol = solution.build_solution()
    assert {"name", "definition", "description", "author", "spec", "sources"} <= set(sol)
    assert sol["definition"] == problem.DEFAULT_DEFINITION
    spec = sol["spec"]
    assert spec["language"] == "triton" and spec["languages"] == ["triton"]
    assert spec["destination_passing_style"] is True and spec["target_hardware"]
    path, fn = spec["entry_point"].split("::")
    paths = [s["path"] for s in sol["sources"]]
    assert path in paths and len(paths) == len(set(paths))
    assert all(s["content"] and not s["path"].startswith("/") and ".." not in s["path"] for s in sol["sources"])
    assert any(p.endswith("kernels/rope_qk_norm.py") for p in paths)


def test_entry_point_signature_matches_definition():
    sol = solution.build_solution()
    defn = problem.load_definition()
    with tempfile.TemporaryDirectory() as tmp:
        run = solution.load_entry(sol, tmp)
        assert list(inspect.signature(run).parameters) == list(defn.inputs) + list(defn.outputs)


def test_exported_solution_runs_and_passes(tmp_path, capsys):
    out = tmp_path / "solution.json"
    assert cli.main(["export-solution", "--out", str(out)]) == 0
    sol = json.loads(out.read_text())
    res = solution.check_solution(sol, device="cpu", max_tokens=16, workloads=(2,))
    assert res and all(r["passed"] and r["returned_none"] for r in res)


def test_broken_solution_fails_the_check():
    sol = solution.build_solution()
    for s in sol["sources"]:
        if s["path"] == "main.py":  # writes nothing: outputs stay NaN
            s["content"] = s["content"].replace("    gqa_qkv_rope_qk_norm_backward(\n", "    0 and gqa_qkv_rope_qk_norm_backward(\n")
    res = solution.check_solution(sol, device="cpu", max_tokens=16, workloads=(2,))
    assert not res[0]["passed"]
