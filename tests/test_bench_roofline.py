"""SOL arithmetic: roofline work, datasheet ceilings, SOL score and run-level aggregates."""

import math

import pytest

from fusedqkv.bench import problem, roofline


def test_sol_score_fixed_points():
    # at the bound 1, at the baseline 0.5, twice as far from the bound as the baseline -> 1/3
    assert roofline.sol_score(1.0, 1.0, 3.0) == pytest.approx(1.0)
    assert roofline.sol_score(3.0, 1.0, 3.0) == pytest.approx(0.5)
    assert roofline.sol_score(5.0, 1.0, 3.0) == pytest.approx(1 / 3)
    assert roofline.sol_score(2.0, 1.0, 3.0) == pytest.approx(1 / 1.5)


def test_sol_score_undefined():
    assert roofline.sol_score(2.0, 3.0, 3.0) is None  # baseline at the bound
    assert roofline.sol_score(2.0, 3.0, 2.5) is None  # baseline beyond the bound
    assert roofline.sol_score(None, 1.0, 2.0) is None
    assert roofline.sol_score(float("nan"), 1.0, 2.0) is None


def test_aggregate_scores_speedups_and_fast_count():
    times = [1.0, 4.0, None]  # third workload failed correctness
    base = [2.0, 2.0, 2.0]
    sols = [0.5, 0.5, 0.5]
    agg = roofline.aggregate(times, base, sols)
    s0 = 1 / (1 + 0.5 / 1.5)
    s1 = 1 / (1 + 3.5 / 1.5)
    assert agg["sol_scores"] == pytest.approx([s0, s1, 0.0])
    assert agg["sol_score"] == pytest.approx((s0 + s1) / 3)
    assert agg["avg_speedup"] == pytest.approx((2.0 + 0.5) / 2)
    assert agg["geomean_speedup"] == pytest.approx(1.0)
    assert (agg["fast_1_count"], agg["fast_1_total"]) == (1, 3)


def test_geomean():
    assert roofline.geomean([1, 4, 16]) == pytest.approx(4.0)
    assert roofline.geomean([]) is None


def test_work_of_a_workload_by_hand():
    defn = problem.load_definition()
    axes = {"batch_size": 2, "seq_len": 3}
    m, n, k, d = 6, 6144, 4096, 128
    assert roofline.workload_flops(defn, axes) == 4 * m * n * k
    inputs = (m * 32 * d) * 2 + (m * 8 * d) * 2 * 2 + m * k * 2 + 2 * (m * d * 2) + n * k * 2 + 2 * d * 2 \
        + (m * 32 * d) * 2 + (m * 8 * d) * 2 + m * 32 * 2 + m * 8 * 2
    outputs = m * k * 2 + 2 * (m * d * 2) + n * k * 2 + 2 * d * 2
    assert roofline.workload_bytes(defn, axes) == inputs + outputs


def test_datasheet_table():
    for name, key in (("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA B200", "B200"),
                      ("NVIDIA H100 PCIe", "H100 PCIE")):
        c = roofline.datasheet_ceilings(name)
        assert c is roofline.DATASHEET[key] and c.source == "datasheet"
    assert roofline.datasheet_ceilings("NVIDIA H200").bytes_per_s > roofline.datasheet_ceilings("NVIDIA H100").bytes_per_s
    assert roofline.datasheet_ceilings("Some Other GPU") is None


def test_roofline_bound_and_b200_figures_same_order():
    defn = problem.load_definition()
    b200 = roofline.datasheet_ceilings("NVIDIA B200")
    for w in defn.workloads:
        rl = roofline.roofline(defn, w.axes, b200)
        assert rl["sol_ms"] == max(rl["t_compute_ms"], rl["t_memory_ms"])
        # the dataset's own B200 SOL is within a small factor of our analytic bound
        assert 0.25 < w.b200_sol_ms / rl["sol_ms"] < 4, (w.name, w.b200_sol_ms, rl["sol_ms"])
    big = roofline.roofline(defn, {"batch_size": 64, "seq_len": 128}, b200)
    assert big["bound"] == "compute"


def test_measured_ceilings_cpu():
    c = roofline.measure_ceilings("cpu", "cpu")
    assert c.source == "measured" and c.flops_per_s > 1e8 and c.bytes_per_s > 1e8
    assert math.isfinite(roofline.sol_time_ms(1e9, 1e6, c))
