"""The CLI fails politely: unknown workload / implementation names, an unwritable output
folder, --device cuda without a GPU, an empty run store -- one line on stderr naming the
problem, a non-zero exit status, no traceback, nothing benchmarked."""

import os
import re
import subprocess
import sys

import pytest
import torch

from fusedqkv import cli


def _file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


CASES = [
    ("unknown_workload", lambda t: ["bench", "--device", "cpu", "--workloads", "w99_nope", "--out", str(t / "o")],
     r"unknown workload 'w99_nope'; known: w00_"),
    ("unknown_impl", lambda t: ["bench", "--device", "cpu", "--impl", "fastest", "--out", str(t / "o")],
     r"unknown implementation 'fastest'; known: fusedqkv"),
    ("out_below_a_file", lambda t: ["bench", "--device", "cpu", "--out", str(_file(t) / "sub")],
     r"--out .*a_file/sub: not a writable folder"),
    ("out_is_a_file", lambda t: ["bench", "--device", "cpu", "--out", str(_file(t))],
     r"--out .*a_file: not a writable folder"),
    ("export_out_below_a_file", lambda t: ["export-solution", "--out", str(_file(t) / "sub" / "solution.json")],
     r"--out .*: cannot create its folder|not writable"),
    ("runs_empty_store", lambda t: ["runs", "--store", str(t / "empty_store")], r"no runs in the run store"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_cli_error_one_line_nonzero(case, tmp_path, capsys):
    cid, argv, pattern = case
    rc = cli.main(argv(tmp_path))
    err = capsys.readouterr().err
    assert rc != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fusedqkv: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_device_cuda_without_gpu(tmp_path, capsys):
    rc = cli.main(["bench", "--device", "cuda", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err and "Traceback" not in err
    assert err.startswith("fusedqkv: error: --device cuda: no CUDA GPU is available"), err
    assert not (tmp_path / "o" / "report.md").exists()


@pytest.mark.parametrize("argv", [["bogus"], ["bench", "--device", "tpu"], ["bench", "--reps", "many"]], ids=str)
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err


def test_cli_subprocess_no_traceback(tmp_path):
    """Through the real entry point (python -m fusedqkv): exit status and stderr."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if not torch.cuda.is_available() else os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    p = subprocess.run([sys.executable, "-m", "fusedqkv", "bench", "--device", "cpu", "--workloads", "nope",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "unknown workload 'nope'" in p.stderr
