"""The 091 plans' kept dQKV workspace on a GPU: one buffer per (device, stream), shared by every
plan on that stream (the call with out= and the call without are two plans of one shape), grown
to the largest dQKV, and results unchanged by the sharing."""

import pytest
import torch

import _oracle
import fusedqkv

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _kept_dqkv(stream: int) -> int:
    """Bytes of the kept dQKV buffer of this device and stream (0: none), from cache_info()."""
    for b in fusedqkv.cache_info()["buffers"]:
        if b["kind"] == "dqkv" and b["device"] == torch.cuda.current_device() and b["stream"] == stream:
            return b["bytes"]
    return 0


def _inputs(b, hq, hkv, s, d, hidden, seed=0):
    return [t.cuda() if isinstance(t, torch.Tensor) else t
            for t in _oracle.make_inputs(b, hq, hkv, s, d, hidden=hidden, seed=seed)]


@cuda
def test_plans_on_one_stream_share_the_kept_workspace():
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    fusedqkv.clear_caches()  # the stream's buffer starts empty, whatever ran before in this process
    small, large = _inputs(1, 4, 2, 40, 64, 256, seed=1), _inputs(1, 4, 2, 96, 64, 256, seed=2)
    first = bw(*small)  # the plan without out=: allocates the stream's buffer
    out = tuple(torch.empty_like(t) for t in first)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    bw(*small, out=out)  # another plan, same stream: no workspace of its own
    torch.cuda.synchronize()
    dqkv_bytes = 40 * (4 + 2 * 2) * 64 * 2
    grown = torch.cuda.memory_allocated() - before
    # what a plan may keep besides (the stage's per-stream ticket, a few hundred bytes) is
    # smaller than a dQKV of its own
    assert grown < dqkv_bytes, (grown, dqkv_bytes)
    assert all(torch.equal(a, b) for a, b in zip(first, out))
    # a larger dQKV grows the shared buffer; the smaller plans then use the grown one, same results
    stream = torch.cuda.current_stream().cuda_stream
    n_small = _kept_dqkv(stream)
    assert n_small >= dqkv_bytes
    ref_large = bw(*large, backend="torch")
    got_large = bw(*large)
    assert _kept_dqkv(stream) > n_small
    again = bw(*small, out=tuple(torch.empty_like(t) for t in first))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # the Triton path and the torch path agree to the test suite's usual tolerance
    for a, b in zip(got_large, ref_large):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@cuda
def test_each_stream_has_its_own_buffer():
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    args = _inputs(1, 4, 2, 40, 64, 256, seed=3)
    ref = bw(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = bw(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert _kept_dqkv(side.cuda_stream) > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
