"""KernelIndex records: digest stability and sensitivity, manifest structure, run store and ranking."""

import copy
import json

import pytest
import torch

from fusedqkv.bench import records

PROTOCOL = {"kind": "BenchmarkProtocol", "repetitions": 5, "warmup": 1, "timer": "cpu_wall",
            "correctness": {"requiredMatchedRatio": 0.99}}
WORKLOADS = {"definition": "d", "workloads": [{"index": 2, "axes": {"batch_size": 1, "seq_len": 64}}]}


def _record(impl="fusedqkv", score=0.6, lat=1.0, observed="2026-01-01T00:00:00Z", protocol=None, env=None,
            sources=None):
    env = env or records.environment("cpu")
    return records.make_record(
        definition="091_x", implementation=impl, impl_label=impl, protocol=protocol or PROTOCOL,
        workloads=WORKLOADS, env=env, implementation_sources=sources or {"files": {impl: "0" * 64}},
        metrics={"sol_score": score, "latency_ms": lat, "avg_speedup": 1.5, "fast_1_count": 3, "fast_1_total": 4},
        latency_ms_mean=lat, latency_ms_median=lat, primary_statistic="mean", status="Succeeded",
        observed_at=observed, cpu_run=True)


def test_digest_is_canonical_and_sensitive():
    a = {"b": 1, "a": [1, 2, {"y": 2, "x": 1}]}
    b = json.loads('{"a": [1, 2, {"x": 1, "y": 2}], "b": 1}')
    assert records.digest(a) == records.digest(b)
    assert records.digest(a).startswith("sha256:") and len(records.digest(a)) == 7 + 64
    c = copy.deepcopy(a)
    c["a"][2]["x"] = 2
    assert records.digest(c) != records.digest(a)
    assert records.digest({**PROTOCOL, "repetitions": 6}) != records.digest(PROTOCOL)


def test_source_tree_digest_stable_and_sensitive(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "ops").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("x = 1\n")
    (tmp_path / "ops" / "o.py").write_text("y = 2\n")
    d1 = records.digest(records.source_tree(root=tmp_path))
    assert d1 == records.digest(records.source_tree(root=tmp_path))
    (tmp_path / "kernels" / "k.py").write_text("x = 3\n")
    d2 = records.digest(records.source_tree(root=tmp_path))
    assert d2 != d1
    (tmp_path / "ops" / "new.py").write_text("")
    assert records.digest(records.source_tree(root=tmp_path)) != d2


def test_package_source_tree_covers_kernels_and_ops():
    tree = records.source_tree()
    assert any(k.startswith("kernels/") for k in tree) and any(k.startswith("ops/") for k in tree)
    assert "ops/backward_091.py" in tree


def test_environment_digest_stable():
    assert records.digest(records.environment("cpu")) == records.digest(records.environment("cpu"))
    env = records.environment("cpu")
    assert env["kind"] == "ExecutionEnvironment" and env["deviceType"] == "cpu"
    assert env["software"]["torch"] == torch.__version__


def test_manifest_structure():
    rec = _record()
    assert records.validate_record(rec) == []
    run = rec["run"]
    assert run["apiVersion"] == "kernelindex.dev/v1alpha1" and run["kind"] == "BenchmarkRun"
    assert set(run["metadata"]) >= {"name", "title", "labels"}
    spec = run["spec"]
    assert isinstance(spec["timing"]["latencyNs"]["mean"], int) and spec["timing"]["latencyNs"]["mean"] == 1_000_000
    assert spec["timing"]["primaryStatistic"] == "mean"
    assert set(spec["sourceNative"]["metrics"]) == {"sol_score", "latency_ms", "avg_speedup", "fast_1_count",
                                                    "fast_1_total"}
    assert spec["protocolDigest"] == records.digest(PROTOCOL)
    assert spec["workloadDigest"] == records.digest(WORKLOADS)
    assert rec["protocol"]["kind"] == "BenchmarkProtocol" and rec["environment"]["kind"] == "ExecutionEnvironment"
    assert "CPU run" in run["metadata"]["title"] and run["metadata"]["labels"]["cpuRun"] == "true"


def test_validate_record_flags_problems():
    rec = _record()
    bad = copy.deepcopy(rec)
    del bad["run"]["spec"]["sourceNative"]["metrics"]["fast_1_total"]
    assert "run.spec.sourceNative.metrics.fast_1_total" in records.validate_record(bad)
    bad = copy.deepcopy(rec)
    bad["protocol"]["repetitions"] = 99  # tampered: digest no longer matches
    assert "protocolDigest does not match protocol" in records.validate_record(bad)
    bad = copy.deepcopy(rec)
    bad["run"]["spec"]["implementationDigest"] = "md5:abc"
    assert "run.spec.implementationDigest format" in records.validate_record(bad)


def test_same_inputs_same_digests_different_code_different_digest():
    a, b = _record(observed="2026-01-01T00:00:00Z"), _record(observed="2026-01-02T00:00:00Z")
    for k in ("protocolDigest", "workloadDigest", "environmentDigest", "implementationDigest"):
        assert a["run"]["spec"][k] == b["run"]["spec"][k]
    assert a["run"]["metadata"]["name"] != b["run"]["metadata"]["name"]
    c = _record(sources={"files": {"fusedqkv": "1" * 64}})
    assert c["run"]["spec"]["implementationDigest"] != a["run"]["spec"]["implementationDigest"]
    assert records.group_of(c) == records.group_of(a)  # same group: a code change is compared, not separated


def test_groups_split_by_protocol_and_device():
    a = _record()
    p = _record(protocol={**PROTOCOL, "repetitions": 7})
    env = records.environment("cpu")
    env["hardwareName"] = "NVIDIA H200"
    g = _record(env=env)
    assert len({records.group_of(a), records.group_of(p), records.group_of(g)}) == 3


def test_ranking_and_compare(tmp_path):
    store = str(tmp_path / "store")
    r1 = _record("eager", score=0.5, lat=2.0, observed="2026-01-01T00:00:01Z")
    r2 = _record("fusedqkv", score=0.8, lat=1.0, observed="2026-01-01T00:00:02Z")
    r3 = _record("compile", score=None, lat=1.5, observed="2026-01-01T00:00:03Z")
    r4 = _record("fusedqkv", score=0.6, lat=1.2, observed="2026-01-01T00:00:04Z",
                 sources={"files": {"x": "2" * 64}})
    for r in (r1, r2, r3, r4):
        records.save_run(r, store)
    (tmp_path / "store" / "junk.json").write_text("{not json")
    runs = records.load_runs(store)
    assert len(runs) == 4
    grouped = records.groups(runs)
    assert len(grouped) == 1
    ranked = next(iter(grouped.values()))
    assert [r["run"]["metadata"]["labels"]["implementation"] for r in ranked] == ["fusedqkv", "fusedqkv", "eager",
                                                                                "compile"]
    assert ranked[0]["run"]["metadata"]["name"] == r2["run"]["metadata"]["name"]
    cmp_ = records.compare(r4, ranked[0])
    assert cmp_["metrics"]["sol_score"]["delta"] == pytest.approx(-0.2)
    assert cmp_["latency_ratio_vs_best"] == pytest.approx(1.2)
    assert cmp_["same_implementation"] is False


def test_store_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(records.STORE_ENV, str(tmp_path / "s"))
    assert records.store_dir() == tmp_path / "s"
    assert records.store_dir(str(tmp_path / "t")) == tmp_path / "t"
