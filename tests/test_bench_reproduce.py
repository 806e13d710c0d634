"""`fusedqkv bench --reproduce`: a CPU record rerun under its protocol, its attestation shown by
`runs`; what cannot be rerun refused with the reason; a record `bench` wrote, tampered with,
reported on import; the citation in the report. The smallest CPU runs: one workload cut to one
token, inputs in float32 (no bf16 matmul on the CPU), one repetition."""

import contextlib
import io
import json
import re

import pytest
import torch

from fusedqkv import cli
from fusedqkv.bench import records

pytestmark = pytest.mark.serial  # times the CPU: alone under pytest-xdist (conftest)

FP32 = ["--device", "cpu", "--quick", "--workloads", "11", "--max-tokens", "1", "--reps", "1", "--warmup", "0",
        "--dtype", "float32", "--quiet"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    base = tmp_path_factory.mktemp("repro")
    store = base / "store"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["bench", *FP32, "--out", str(base / "run"), "--store", str(store)])
    assert rc == 0
    man = json.loads((base / "run" / "manifest.json").read_text())
    return base, store, man, out.getvalue()


def test_a_float32_cpu_run_records_its_dtype(recorded):
    _, _, man, _ = recorded
    assert man["protocol"]["inputDtype"] == "float32"
    assert man["run"]["spec"]["sourceNative"]["workloadSet"]["dtype"] == "float32"
    assert "float32 matmul" in man["protocol"]["sol"]["ceilings"]
    assert records.verify(man)["status"] == "verified"
    assert all(c == "matches" for c in records.verify(man)["checks"].values())


def test_the_final_line_names_records_and_the_run_store(recorded):
    base, store, _, out = recorded
    last = out.strip().splitlines()[-1]
    assert last.startswith("wrote ") and "records/ (eager.json, fusedqkv.json)" in last
    assert f"to {base / 'run'}; run store {store} (+2 records)" in last


def test_reproduce_writes_an_attestation_that_runs_shows(recorded, tmp_path, capsys):
    base, store, man, _ = recorded
    name = man["run"]["metadata"]["name"]
    rc = cli.main(["bench", "--reproduce", name, "--store", str(store), "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    att = json.loads((tmp_path / "o" / "attestation.json").read_text())
    spec = att["spec"]
    assert rc == (0 if spec["verdict"] == "agrees" else 1)
    assert spec["subject"] == {"name": name, "recordDigest": records.record_digest(man),
                               "observedAt": man["run"]["spec"]["observedAt"]}
    # the same protocol, workloads, environment and code: only timings may differ
    assert not [d for d in spec["discrepancies"] if "Digest differs" in d], spec["discrepancies"]
    assert spec["rule"]["tolerance"] == 1.5 and "within a factor 1.5" in spec["rule"]["latency"]
    assert (spec["verdict"] == "agrees") == (not spec["discrepancies"])
    (row,) = spec["perWorkload"]
    assert row["workload"] == "w11_b1_s1" and row["within"] == (1 / 1.5 <= row["ratio"] <= 1.5)
    assert f"reproduction of {name}: " in out
    stored = list((store / records.ATTESTATIONS).glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text()) == att
    repro = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert spec["reproduction"]["recordDigest"] == records.record_digest(repro)

    assert cli.main(["runs", "--store", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(k for k, ln in enumerate(lines) if re.match(rf"\s+\d+ {re.escape(name)} ", ln))
    assert lines[i + 1].strip().startswith("attested: " + ("agrees" if spec["verdict"] == "agrees" else "DISAGREES"))
    assert repro["run"]["metadata"]["name"] in lines[i + 1]
    j = next(k for k, ln in enumerate(lines) if re.match(rf"\s+\d+ {re.escape(repro['run']['metadata']['name'])} ", ln))
    assert lines[j + 1].strip() == f"a reproduction of {name}"
    assert cli.main(["runs", "--store", str(store), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js[0]["attestations"][name] == [att]


def _save(store, rec):
    records.save_run(rec, str(store))
    return rec["run"]["metadata"]["name"]


def _variant(man, protocol=None, env=None, sources=None, observed="2026-01-01T00:00:00Z"):
    """The recorded run's record with another protocol, environment or code (digests and group recomputed)."""
    sn = man["run"]["spec"]["sourceNative"]
    return records.make_record(
        definition=man["run"]["metadata"]["labels"]["definition"], implementation="fusedqkv", impl_label="x",
        protocol={**man["protocol"], **(protocol or {})}, workloads=sn["workloadSet"],
        env={**man["environment"], **(env or {})}, implementation_sources=sources or sn["implementationSources"],
        metrics=sn["metrics"], latency_ms_mean=1.0, latency_ms_median=1.0, primary_statistic="median",
        status="Succeeded", observed_at=observed, cpu_run=True, per_workload=sn["workloads"])


def _refused(capsys, argv, pattern):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == cli.EXIT_USAGE and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]


def test_reproduce_refuses_what_this_machine_cannot_rerun(recorded, tmp_path, capsys):
    _, _, man, _ = recorded
    store = tmp_path / "store"
    out = ["--store", str(store), "--out", str(tmp_path / "o")]
    other_cpu = _save(store, _variant(man, env={"hardwareName": "CPU: Some Other Processor"}))
    _refused(capsys, ["bench", "--reproduce", other_cpu, *out],
             r"--reproduce: .* ran on CPU: Some Other Processor; this machine is CPU: .*: a reproduction needs the "
             r"same CPU model")
    if not torch.cuda.is_available():
        gpu = _variant(man, protocol={"deviceType": "cuda"}, env={"hardwareName": "NVIDIA H200", "deviceType": "cuda"},
                       observed="2026-01-02T00:00:00Z")
        (tmp_path / "gpu.json").write_text(json.dumps(gpu))
        _refused(capsys, ["bench", "--reproduce", str(tmp_path / "gpu.json"), *out],
                 r"ran on NVIDIA H200 \(a GPU\); this machine has no CUDA GPU: a reproduction runs on the record's "
                 r"GPU type")
    code = _variant(man, sources={"files": {"ops/old.py": "0" * 64}}, observed="2026-01-03T00:00:00Z")
    _refused(capsys, ["bench", "--reproduce", _save(store, code), *out],
             r"this checkout's fusedqkv \(implementation digest sha256:\w+\) is not the record's .*check out the "
             r"commit that wrote it")
    _refused(capsys, ["bench", "--reproduce", "no-such-run", *out], r"--reproduce no-such-run: no such file, and no run")
    _refused(capsys, ["bench", "--reproduce", other_cpu, "--reps", "3", *out],
             r"--reproduce takes every setting from the record's protocol; drop --reps")
    assert not (tmp_path / "o").exists()


def test_reproduce_refuses_an_evaluator_record(tmp_path, capsys):
    from fusedqkv.bench import importer

    trace = {"definition": "091_fused_gqa_qkv_rope_qk_norm_backward", "solution": "s_0123abcd",
             "workload": {"uuid": "4d355dab-7cb1-5bc9-bc10-7e1811743288", "axes": {"batch_size": 32, "seq_len": 256}},
             "evaluation": {"status": "PASSED", "environment": {"hardware": "NVIDIA H200", "libs": {}},
                            "timestamp": "2026-12-01T23:46:31",
                            "performance": {"latency_ms": 1.0, "reference_latency_ms": 4.0, "speedup_factor": 4.0}}}
    rec = importer.record_from_traces([trace], "v1.0")
    (tmp_path / "r.json").write_text(json.dumps(rec))
    _refused(capsys, ["bench", "--reproduce", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")],
             r"--reproduce: .* was measured by SOL-ExecBench evaluation stack v1.0 \(timer harness_reported\), not "
             r"by fusedqkv bench")


def test_a_tampered_bench_record_is_a_digest_mismatch_on_import(recorded, tmp_path, capsys):
    base, _, man, _ = recorded
    assert cli.main(["runs", "import", str(base / "run" / "manifest.json"), "--store", str(tmp_path / "ok")]) == 0
    assert "(fusedqkv record; digests verified)" in capsys.readouterr().out
    bad = json.loads((base / "run" / "manifest.json").read_text())
    bad["protocol"]["warmup"] = 7  # one protocol field changed
    (tmp_path / "tampered.json").write_text(json.dumps(bad))
    rc = cli.main(["runs", "import", str(tmp_path / "tampered.json"), "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip()
    assert rc == cli.EXIT_CHECK_FAILED and "\n" not in err and "Traceback" not in err
    assert "digest mismatch" in err and "protocolDigest does not match protocol" in err
    assert not (tmp_path / "s").exists()  # never stored
    bad = json.loads((base / "run" / "manifest.json").read_text())
    bad["run"]["spec"]["sourceNative"]["workloadSet"]["maxTokens"] = 64
    (tmp_path / "tampered.json").write_text(json.dumps(bad))
    assert cli.main(["runs", "import", str(tmp_path / "tampered.json"), "--store", str(tmp_path / "s")]) == 1
    assert "workloadDigest does not match its workload set" in capsys.readouterr().err


def test_the_report_cites_the_record_as_runs_cite_does(recorded, capsys):
    base, store, man, _ = recorded
    name = man["run"]["metadata"]["name"]
    assert cli.main(["runs", "--store", str(store), "--cite", name]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"{name}, {records.record_digest(man)}, observed {man['run']['spec']['observedAt'][:10]}, " \
                   f"{store / (name + '.json')}"
    assert f"Cite: `{line}`" in (base / "run" / "report.md").read_text()
