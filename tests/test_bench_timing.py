"""The evaluator-style timing pieces that run without a GPU: fresh argument addresses every
iteration, the launch-window attribution of device activity, the flush grouping."""

import pytest
import torch

from fusedqkv.bench import timing
from fusedqkv.bench.timing import DeviceActivity as A


def test_shifted_args_fresh_address_same_values_same_strides():
    base = torch.randn(4, 6, dtype=torch.bfloat16)
    inputs = [base, base.t(), torch.randn(5)[:1].expand(3, 7), 1e-6, torch.arange(12, dtype=torch.int64).view(3, 4)]
    outputs = [torch.empty(3, 5, dtype=torch.float32)]
    args = timing.ShiftedArgs(inputs, outputs, calls=4)
    seen = []
    for k in range(4):
        got = args()
        assert len(got) == len(inputs) + len(outputs)
        assert got[3] == 1e-6
        for g, src in zip(got, inputs):
            if isinstance(src, torch.Tensor):
                assert g.shape == src.shape and g.stride() == src.stride() and g.dtype == src.dtype
                assert torch.equal(g, src)
                assert g.data_ptr() % 16 == 0
        out = got[-1]
        assert out.shape == (3, 5) and torch.equal(out, torch.zeros(3, 5))
        out.fill_(7.0)  # dirty it: the next call must hand out a zeroed one again
        seen.append([g.data_ptr() for g in got if isinstance(g, torch.Tensor)])
    for a, b in zip(seen, seen[1:]):  # every tensor moved by 256 bytes from one call to the next
        assert [y - x for x, y in zip(a, b)] == [timing.SHIFT_BYTES] * len(a)
    with pytest.raises(RuntimeError, match="4 calls were planned"):
        args()


def test_shifted_args_pool_is_small():
    t = torch.randn(1000)
    args = timing.ShiftedArgs([t], [], calls=10)
    pool = args.entries[0][1]
    assert pool.numel() == 1000 + 9 * (timing.SHIFT_BYTES // 4)
    b = torch.randn(8)[:1].expand(1000, 8)  # stride 0: only the stored elements are pooled
    assert timing.ShiftedArgs([b], [], calls=2).entries[0][1].numel() == 1 + 64


def test_attribution_by_launch_window():
    """Activities belong to the window their launch fell in; other launches (the flush, the
    argument copies) are outside every window; one launch may carry several activities."""
    windows = [(100, 200), (1000, 1100)]
    launches = [(90, 1), (110, 2), (150, 3), (990, 4), (1010, 5), (1200, 6)]
    acts = [A("flush", 300, 400, 1), A("k1", 410, 450, 2), A("memset", 455, 460, 3), A("k2", 462, 500, 3),
            A("flush", 1300, 1400, 4), A("k1", 1405, 1450, 5), A("late", 1500, 1600, 6), A("orphan", 430, 440, 99)]
    calls = timing.attribute_to_windows(windows, launches, acts)
    assert [[a.name for a in c] for c in calls] == [["k1", "memset", "k2"], ["k1"]]
    assert [timing.span_ms(c) for c in calls] == [pytest.approx(90e-6), pytest.approx(45e-6)]


def test_group_at_flush_skips_the_copy_stream_and_the_prelude():
    acts = [A("copy", 0, 5, stream=9), A("l2_flush_kernel", 10, 20, stream=7), A("k1", 21, 30, stream=7),
            A("k2", 31, 40, stream=7), A("copy", 41, 45, stream=9), A("l2_flush_kernel", 50, 60, stream=7),
            A("k1", 61, 70, stream=7), A("k2", 71, 90, stream=7), A("l2_flush_kernel", 100, 110, stream=7)]
    calls = timing.group_at_flush(list(reversed(acts)), skip_streams={9})
    assert [[a.name for a in c] for c in calls] == [["k1", "k2"], ["k1", "k2"], []]


def test_spans_reject_missing_or_changing_kernels():
    ok = [[A("k1", 0, 10), A("k2", 12, 30)], [A("k1", 100, 111), A("k2", 112, 140)]]
    st = timing._spans(ok, 2, "cupti")
    assert st.samples_ms == [pytest.approx(30e-6), pytest.approx(40e-6)] and st.activities_per_call == [2, 2]
    with pytest.raises(timing.TimingError, match="device activity for 1 of 2 calls"):
        timing._spans([ok[0], []], 2, "cupti")
    with pytest.raises(timing.TimingError, match="ran different kernels"):
        timing._spans([ok[0], [A("k1", 0, 1), A("k3", 2, 3)]], 2, "cupti")


def test_span_source_is_checked():
    with pytest.raises(ValueError, match="source: expected auto, cupti or profiler"):
        timing.time_call_span(lambda: None, [], source="nvtx")


def test_rotated_orders_give_every_implementation_every_predecessor():
    names = ["eager", "compile", "fusedqkv"]
    orders = timing.rotated_orders(names, 6)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names * 2
    # over the whole sequence of calls, each implementation directly follows each other one
    seq = [n for o in orders for n in o]
    pairs = {(a, b) for a, b in zip(seq, seq[1:])}
    assert {(a, b) for a in names for b in names if a != b} <= pairs
    assert timing.rotated_orders([], 3) == []


def test_time_steady_rotates_and_attributes_samples():
    """Back-to-back stretches: every callable timed once per round in the rotated order, the calls
    counted, each stretch's clock samples (less the first, which may predate the load) its own."""
    calls = {"a": 0, "b": 0}
    log = []

    class FakeSampler:
        def __init__(self):
            self.n = 0

        def drain(self):
            self.n += 1
            # one drain before each stretch (discarded), one after it: the samples of the callable
            return [(1000.0 + self.n, 600.0), (1500.0 + self.n, 690.0), (1490.0 + self.n, 691.0)]

    def make(name, cost_s):
        def fn():
            calls[name] += 1
            if not log or log[-1] != name:
                log.append(name)
            t = timing.time.perf_counter() + cost_s
            while timing.time.perf_counter() < t:
                pass
        return fn

    out = timing.time_steady({"a": make("a", 2e-4), "b": make("b", 1e-4)}, seconds=0.02, rounds=2,
                             sync=lambda: log.append("|"), sampler=FakeSampler(), skip_samples=1)
    # per stretch: a first call, a sync, the back-to-back calls, a sync; rounds a, b then b, a
    assert log == [n for name in "abba" for n in (name, "|", name, "|")]
    assert set(out) == {"a", "b"}
    for name, cost_ms in (("a", 0.2), ("b", 0.1)):
        r = out[name]
        assert len(r["ms"]) == 2 and all(cost_ms * 0.9 < ms < cost_ms * 5 for ms in r["ms"]), r
        assert len(r["mhz"]) == 4 and len(r["watts"]) == 4 and min(r["mhz"]) > 1400
    assert calls["a"] >= 2 * 8 and calls["b"] >= 2 * 8


def test_clock_sampler_names_the_gpu_as_nvidia_smi_does(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-8f2a")
    assert timing.ClockSampler.smi_id(0) == "3" and timing.ClockSampler.smi_id(1) == "GPU-8f2a"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert timing.ClockSampler.smi_id(1) == "1"


def test_clock_sampler_parses_nvidia_smi_lines():
    lines = ["1980, 512.30\n", "[N/A], 80.1\n", "1410, 692.55\n", "garbage\n", ""]
    assert timing.ClockSampler.parse(lines) == [(1980.0, 512.3), (1410.0, 692.55)]
    if not timing.ClockSampler(ms=50).available:  # no nvidia-smi: nothing sampled, nothing to close
        s = timing.ClockSampler()
        assert s.drain() == [] and not s.available
        s.close()


def test_steady_medians():
    raw = {"a": dict(ms=[1.0, 3.0, 2.0], mhz=[1400.0, 1500.0], watts=[690.0, 692.0]),
           "b": dict(ms=[4.0], mhz=[], watts=[])}
    out = timing.steady_medians(raw)
    assert out["a"] == dict(ms=2.0, mhz=1450.0, watts=691.0, samples=2)
    assert out["b"]["ms"] == 4.0 and out["b"]["samples"] == 0 and out["b"]["mhz"] != out["b"]["mhz"]  # NaN
