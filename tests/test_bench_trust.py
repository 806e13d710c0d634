"""Rows that cannot be trusted are flagged, never clipped: the SOL score stays in [0, 1] or the
row carries a flag (by construction), flagged runs rank after unflagged ones, and the record
carries the flags and the spread of the repetitions."""

import json
import math
import random

import pytest
import torch

from fusedqkv import cli
from fusedqkv.bench import harness, records, roofline, timing, trust

# one test times the CPU (`serial`: alone under pytest-xdist, conftest); the run below has fixed timings


# ----------------------------------------------------------------------------- the rules


def test_score_in_range_or_flagged_by_construction():
    """Whatever T, T_sol and T_b are, a score outside [0, 1] comes with a flag."""
    rng = random.Random(0)
    seen_out_of_range = 0
    for _ in range(20000):
        t, ts, tb = (rng.choice([rng.uniform(0.01, 10), rng.uniform(0.9, 1.1)]) for _ in range(3))
        s = roofline.sol_score_formula(t, ts, tb)
        flags = trust.row_flags(t, ts, tb, None, None, cpu=False)
        assert trust.check_invariant(s, flags), (t, ts, tb, s, flags)
        if s is not None and not 0 <= s <= 1:
            seen_out_of_range += 1
        if t >= ts and tb > ts:  # the formula's own domain: no score flag
            assert not flags and 0 <= s <= 1
    assert seen_out_of_range > 1000  # the loop did exercise the out-of-range cases


def test_score_flags_name_the_cause():
    assert trust.score_flags(8.0, 10.0, 20.0) == ["below_sol"]
    assert trust.score_flags(15.0, 10.0, 9.0) == ["bound_not_below_baseline"]
    assert trust.score_flags(12.0, 10.0, 10.0) == ["bound_not_below_baseline"]
    assert trust.score_flags(10.0, 10.0, 20.0) == []  # at the bound: S = 1, fine
    assert roofline.sol_score_formula(8.0, 10.0, 20.0) == pytest.approx(1.25)  # kept, not clipped
    assert roofline.sol_score_formula(15.0, 10.0, 9.0) == pytest.approx(-0.25)
    assert roofline.sol_score_formula(9.0, 10.0, 9.0) == pytest.approx(0.5)  # the baseline itself
    assert roofline.sol_score_formula(9.0, 10.0, 10.0) is None


def _summary(median, p20=None, p80=None, host_wait=None, n=10):
    p20 = median if p20 is None else p20
    p80 = median if p80 is None else p80
    return {"n": n, "median": median, "mean": median, "min": p20, "max": p80, "p20": p20, "p80": p80,
            "host_wait": host_wait}


def test_timing_flags_cpu_only():
    noisy = _summary(10.0, 6.0, 12.0)  # (12 - 6) / 10 = 0.6 > 0.5
    busy = _summary(10.0, host_wait=0.3)
    quiet = _summary(10.0, 9.5, 10.5, host_wait=0.01)
    assert trust.spread(noisy) == pytest.approx(0.6)
    assert trust.timing_flags(noisy, cpu=True) == ["noisy"]
    assert trust.timing_flags(busy, cpu=True) == ["host_busy"]
    assert trust.timing_flags(quiet, cpu=True) == []
    # a GPU run times by device clocks: its spread is recorded, never flagged
    assert trust.timing_flags(noisy, cpu=False) == [] and trust.timing_flags(busy, cpu=False) == []
    # the baseline's timing flags every implementation of the row; the baseline's own row once
    assert trust.row_flags(12.0, 10.0, 20.0, quiet, busy, cpu=True) == ["baseline_host_busy"]
    assert trust.row_flags(20.0, 10.0, 20.0, busy, busy, cpu=True, is_baseline=True) == ["host_busy"]


def test_bound_flags_from_the_measurement_behind_each_ceiling():
    steady = {"matmul_ms": _summary(5.0, 4.9, 5.1), "copy_ms": _summary(4.0, 3.9, 4.1), "host_wait": 0.0}
    noisy_copy = {**steady, "copy_ms": _summary(4.0, 2.0, 6.0)}
    busy = {**steady, "host_wait": 0.4}
    c = lambda d: {"source": "measured", "detail": d}  # noqa: E731
    assert trust.bound_flags(c(steady), cpu=True) == []
    assert trust.bound_flags(c(noisy_copy), cpu=True) == ["bound_unsteady"]
    assert trust.bound_flags(c(busy), cpu=True) == ["bound_unsteady"]
    assert trust.bound_flags(c(busy), cpu=False) == []  # host wait is a CPU-run criterion
    # best of two: the FLOP/s from a steady measurement, the bytes/s from a noisy one -> flagged
    assert trust.bound_flags(c({"chosen": {"flops": steady, "bytes": noisy_copy}}), cpu=True) == ["bound_unsteady"]
    assert trust.bound_flags(c({"chosen": {"flops": noisy_copy, "bytes": steady}}), cpu=True) == []
    assert trust.bound_flags({"source": "datasheet", "detail": None}, cpu=False) == []


def test_best_ceilings_takes_the_faster_of_each():
    a = roofline.Ceilings("cpu", 2e11, 1e10, "measured", {"when": "start"})
    b = roofline.Ceilings("cpu", 1e11, 3e10, "measured", {"when": "end"})
    c = roofline.best_ceilings([a, b])
    assert (c.flops_per_s, c.bytes_per_s) == (2e11, 3e10)
    assert c.detail["flops_from"] == "start" and c.detail["bytes_from"] == "end"


def test_aggregate_keeps_out_of_range_values_and_leaves_undefined_out():
    agg = roofline.aggregate([8.0, 15.0, 12.0, None, 5.0], [20.0, 9.0, 20.0, 20.0, 10.0], [10.0] * 5)
    assert agg["sol_scores"][:4] == pytest.approx([1.25, -0.25, 1 / 1.2, 0.0])
    assert agg["sol_scores"][4] is None  # T_b == T_sol: no value, out of the mean (the row is flagged)
    assert agg["sol_score"] == pytest.approx((1.25 - 0.25 + 1 / 1.2 + 0.0) / 4)


def test_host_wait_reads_this_process():
    with timing.HostWait() as hw:
        sum(range(200000))
    if timing._run_delay_ns() is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    assert hw.fraction is not None and hw.fraction >= 0.0


@pytest.mark.serial  # repetitions within a time budget
def test_cpu_budget_timing_adapts():
    calls = []

    def fn():
        calls.append(1)

    ct = timing.time_cpu_budget(fn, budget_s=0.02, warmup=0)
    assert len(ct.samples_ms) >= timing.CPU_MIN_REPS and ct.warmup_calls == 0 and ct.warmup_stable is None
    assert len(ct.samples_ms) > 50  # a fast call gets many more repetitions than the minimum
    ct = timing.time_cpu_budget(fn, budget_s=0.02, reps=3, warmup=2)
    assert len(ct.samples_ms) == 3 and ct.warmup_calls == 2
    ct = timing.time_cpu_budget(lambda: None, budget_s=0.01)  # warm-up until 3 calls agree
    assert ct.warmup_calls >= 1 and ct.warmup_stable in (True, False)
    with pytest.raises(ValueError, match="budget_s"):
        timing.time_cpu_budget(fn, budget_s=0)


# ----------------------------------------------------------------------------- a run with a wrong bound


SOL_MS = 10.0
# per workload (fusedqkv, eager) median ms; the cases: T below the bound (S > 1), the
# bound slower than the baseline (eager's 0.000 although "ok", fusedqkv negative), a fine row
TIMES = [(8.0, 20.0), (15.0, 9.0), (12.0, 20.0)]


@pytest.fixture(scope="module")
def bad_bound_run():
    """A real harness run on three tiny CPU workloads whose timings and SOL bound are fixed, so
    that the out-of-range cases of the issue appear deterministically."""
    seq = [t for pair in TIMES for t in pair]

    def fake_time(call, device, reps, warmup, span, flusher, span_source="auto", budget_s=None):
        return {"cpu_wall": _summary(seq.pop(0), host_wait=0.0)}

    steady = {"when": "start", "matmul_ms": _summary(5.0), "copy_ms": _summary(4.0), "host_wait": 0.0}
    real_roofline = roofline.roofline
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "_time", fake_time)
        mp.setattr(roofline, "measure_ceilings",
                   lambda device, name, when="start", dtype=None: roofline.Ceilings(name, 1e12, 1e11, "measured",
                                                                                    {**steady, "when": when}))
        mp.setattr(roofline, "roofline", lambda defn, axes, ceil, dtype=None: {**real_roofline(defn, axes, ceil),
                                                                              "sol_ms": SOL_MS})
        cfg = harness.BenchConfig(device="cpu", workloads=["2", "11", "13"], max_tokens=2, progress=False)
        res = harness.run_bench(cfg)
    assert not seq
    return res


def test_out_of_range_rows_are_flagged_not_clipped(bad_bound_run):
    res = bad_bound_run
    rows = res["workloads"]
    fq = [r["impls"]["fusedqkv"] for r in rows]
    eg = [r["impls"]["eager"] for r in rows]
    assert fq[0]["sol_score"] == pytest.approx(1.25) and fq[0]["flags"] == ["below_sol"]
    assert fq[1]["sol_score"] == pytest.approx(-0.25) and fq[1]["flags"] == ["bound_not_below_baseline"]
    assert eg[1]["sol_score"] == pytest.approx(0.5) and eg[1]["flags"] == ["below_sol", "bound_not_below_baseline"]
    assert fq[2]["sol_score"] == pytest.approx(1 / 1.2) and fq[2]["flags"] == []
    for x in fq + eg:
        assert trust.check_invariant(x["sol_score"], x["flags"])
    t = res["summary"]["fusedqkv"]["trust"]
    assert t["flagged"] and t["flaggedWorkloads"] == 2 and t["flags"] == {"below_sol": 1, "bound_not_below_baseline": 1}
    assert res["summary"]["eager"]["sol_score"] == pytest.approx(0.5)  # no silent 0 for an "ok" row
    # the record carries the flags, and per workload the spread of the repetitions
    rec = harness.build_records(res)["fusedqkv"]
    assert records.validate_record(rec) == []
    spec = rec["run"]["spec"]
    assert spec["trust"]["flagged"] is True and rec["run"]["metadata"]["labels"]["flagged"] == "true"
    assert spec["trust"]["rules"]["noiseSpread"] == trust.NOISE_SPREAD
    per = spec["sourceNative"]["workloads"]
    assert [w["flags"] for w in per] == [["below_sol"], ["bound_not_below_baseline"], []]
    assert set(per[0]["latency_ms"]) >= {"min", "median", "max", "p20", "p80", "n"}


def test_report_shows_the_flags(bad_bound_run, tmp_path):
    from fusedqkv.bench import report

    res = bad_bound_run
    recs = harness.build_records(res)
    report.write_report(res, recs, recs["fusedqkv"], tmp_path)
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert "FLAGGED" in md and "below_sol" in md and "## Flags" in md
    assert "class='flagged'" in html and "below_sol" in html
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["run"]["spec"]["trust"]["flagged"] is True


def _store_run(store, res):
    for r in harness.build_records(res).values():
        records.save_run(r, store)
    return harness.build_records(res)["fusedqkv"]["run"]["metadata"]["name"]


def test_flagged_run_ranks_after_a_quiet_one(bad_bound_run, tmp_path, capsys):
    """The issue's case: the loaded run's score (0.7770) beat the quiet run's (0.6740). The
    flagged run goes below every unflagged run of its group, whatever its score."""
    res = bad_bound_run
    store = str(tmp_path / "store")
    loud = _store_run(store, res)
    quiet = json.loads(json.dumps(res))
    for r in quiet["workloads"]:
        for x in r["impls"].values():
            x["flags"] = []
    for n in ("fusedqkv", "eager"):
        quiet["summary"][n]["_sources"] = res["summary"][n]["_sources"]
        quiet["summary"][n]["trust"] = {**trust.summarize_flags([[]] * 3), "rules": trust.rules(True)}
    quiet["summary"]["fusedqkv"]["sol_score"] = 0.55  # lower than the flagged run's (0.61), above eager's
    quiet["observedAt"] = "2000-01-01T00:00:00Z"
    calm = _store_run(store, quiet)
    grouped = records.groups(records.load_runs(store))
    ranked = [r["run"]["metadata"]["name"] for r in next(iter(grouped.values()))]
    assert ranked.index(calm) < ranked.index(loud)
    capsys.readouterr()
    assert cli.main(["runs", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "FLAGGED" in out and "ranked after the unflagged ones" in out
    lines = [ln for ln in out.splitlines() if calm in ln or loud in ln]
    assert calm in lines[0] and loud in lines[-1]
    assert cli.main(["runs", "--store", store, "--json"]) == 0
    js = json.loads(capsys.readouterr().out)[0]
    # our latest run (the flagged one) against the group's #1 (the quiet one)
    assert js["compare"]["run"] == loud and js["compare"]["best"] == calm
    assert js["compare"]["flagged"] == {"run": True, "best": False}
    assert f"{loud} (flagged) vs #1 {calm}" in out


def test_old_records_without_flags_count_as_unflagged():
    rec = records.make_record(
        definition="d", implementation="fusedqkv", impl_label="x", protocol={"kind": "BenchmarkProtocol"},
        workloads={}, env=records.environment("cpu"), implementation_sources={}, metrics={"sol_score": 0.5},
        latency_ms_mean=1.0, latency_ms_median=1.0, primary_statistic="median", status="Succeeded",
        observed_at="2026-01-01T00:00:00Z", cpu_run=True)
    assert "trust" not in rec["run"]["spec"] and not records.is_flagged(rec)


def test_gpu_protocol_is_unchanged():
    """The flags judge results; they are not part of the GPU protocol, whose digest (hence the
    comparison group of H200 runs) is the one the harness gave before them."""
    proto = harness.protocol_for(torch.device("cuda"), 50, 10, "kernel_span", ["kernel_span", "cuda_events"],
                                 "median", "datasheet (NVIDIA H200 SXM)", "091_fused_gqa_qkv_rope_qk_norm_backward",
                                 "cupti")
    assert records.digest(proto) == "sha256:eaf52cfa510285d1c73858d9592ec031eebdf4f02471eccaace6e1c5bfde72d2"
    plan = harness.plan_bench(harness.BenchConfig(device="cpu", reps=7, warmup=0))
    assert plan.reps == 7 and plan.time_budget is None  # explicit repetitions: a fixed count, no budget
    assert math.isclose(trust.NOISE_SPREAD, 0.5) and math.isclose(trust.HOST_WAIT, 0.10)
