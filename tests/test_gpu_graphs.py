"""The fused block under CUDA graphs (GPU): ``torch.compile(mode="reduce-overhead")`` of a model
using the block and of an ``apply_to``-patched HF Qwen3 model, ``make_graphed_callables``,
several graphs captured in either order and replayed interleaved, graphs sharing a pool, replay
after unrelated allocations and after ``clear_caches()``, and no fusedqkv buffer kept from a
capture. Results are compared with eager calls."""

import copy

import pytest
import torch

import _oracle
import fusedqkv
from _scripts import load_benchmark

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HID, HQ, HKV, D = 256, 4, 2, 64


def _rope(b, s, d, dt, offset=0):
    ang = (torch.arange(s)[None, :, None] + offset) / 10000 ** (torch.arange(d)[None, None] % (d // 2) / (d // 2))
    return ang.cos().expand(b, s, d).to("cuda", dt), ang.sin().expand(b, s, d).to("cuda", dt)


_Model = load_benchmark("bench_graphs").Model  # the repro's model: block + SDPA + o_proj, 3 layers


# zero_grad(set_to_none=True), PyTorch's default: under reduce-overhead, gradients accumulated into
# the previous step's .grad (set_to_none=False) read a backward graph's output after the next
# replay overwrote it -- torch 2.11 refuses that for any model, a plain-PyTorch block included
# (benchmarks/NOTES.md, session 10)
def _train(model, step_fn, xs, cos, sin):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for x in xs:
        loss = step_fn(x, cos, sin)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _model_and_data(b=2, s=128, steps=8):
    torch.manual_seed(0)
    model = _Model(hid=HID, hq=HQ, hkv=HKV, d=D).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, s, HID, generator=g).cuda().to(torch.bfloat16) for _ in range(steps)]
    return model, xs, *_rope(b, s, D, torch.bfloat16)


def _close_losses(a, b):
    # bf16 training: the two runs differ only in rounding noise of a few ulp per step
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 2e-2 * abs(y) + 1e-4, (a, b)


@cuda
def test_reduce_overhead_compile_trains_like_eager():
    model, xs, cos, sin = _model_and_data()
    eager = copy.deepcopy(model)
    ref = _train(eager, eager, xs, cos, sin)
    compiled = torch.compile(model, mode="reduce-overhead")
    got = _train(model, compiled, xs, cos, sin)
    _close_losses(got, ref)


@cuda
def test_make_graphed_callables_trains_like_eager():
    model, xs, cos, sin = _model_and_data()
    eager = copy.deepcopy(model)
    ref = _train(eager, eager, xs, cos, sin)
    graphed = torch.cuda.make_graphed_callables(model, (xs[0].clone(), cos, sin))
    got = _train(model, graphed, xs, cos, sin)
    _close_losses(got, ref)


@cuda
def test_reduce_overhead_on_a_patched_hf_qwen3():
    pytest.importorskip("transformers")
    import _hf_models as H

    ref = H.build("qwen3", False, dtype=torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    assert fusedqkv.apply_to(model) == 2
    ids = torch.randint(3, H.VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def run(m, fn):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        out = []
        for _ in range(8):
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss))
        return out

    _close_losses(run(model, torch.compile(model, mode="reduce-overhead")), run(ref, ref))


def _capture(step):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    return graph, side


def _graph(step, pool=None):
    graph, _ = _capture(step)
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


def _steps():
    """Three captured workloads and their inputs: the 091 backward, the training block's
    fwd+bwd, and a plain PyTorch block (no fusedqkv)."""
    args = [t.cuda() if isinstance(t, torch.Tensor) else t
            for t in _oracle.make_inputs(1, HQ, HKV, 96, D, hidden=HID, seed=7)]
    bwd = lambda: fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 80, HID, generator=g).cuda().bfloat16().requires_grad_()
    block = fusedqkv.GQAQKVRoPEQKNorm(HID, HQ, HKV, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = _rope(2, 80, D, torch.bfloat16, offset=5)
    grads = [torch.randn(2, h, 80, D, generator=g).cuda().bfloat16() for h in (HQ, HKV, HKV)]
    params = [x, *block.parameters()]

    def train():
        return torch.autograd.grad(block(x, cos, sin), params, grads)

    w = torch.randn(HID, HID, generator=g).cuda().bfloat16()
    plain = lambda: torch.relu(x.detach() @ w)  # noqa: E731
    keep = (args, x, block, cos, sin, grads, w)  # a graph reads its inputs where it captured them
    return {"bwd091": bwd, "train": train, "plain": plain}, keep


def _tensors(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same(outs, eager):
    outs, eager = _tensors(outs), _tensors(eager)
    assert len(outs) == len(eager)
    for o, e in zip(outs, eager):
        assert torch.equal(o, e)


@cuda
@pytest.mark.parametrize("order", [("bwd091", "train", "plain"), ("plain", "train", "bwd091"),
                                   ("train", "plain", "bwd091")])
def test_several_graphs_any_capture_order_replayed_interleaved(order):
    steps, keep = _steps()
    eager = {name: [t.clone() for t in _tensors(step())] for name, step in steps.items()}
    graphs = {name: _graph(steps[name]) for name in order}
    for name in ("train", "bwd091", "plain", "bwd091", "train"):
        graphs[name][0].replay()
    torch.cuda.synchronize()
    for name, (_, out) in graphs.items():
        _same(out, eager[name])
    del keep


@cuda
def test_graphs_sharing_a_pool_and_replay_after_allocations_and_clear():
    steps, keep = _steps()
    eager = {name: [t.clone() for t in _tensors(step())] for name, step in steps.items() if name != "plain"}
    g1, out1 = _graph(steps["bwd091"])
    g2, out2 = _graph(steps["train"], pool=g1.pool())
    junk = [torch.empty(1 << 20, device="cuda") for _ in range(8)]  # unrelated allocations in between
    fusedqkv.clear_caches()  # kept buffers dropped: a graph must not depend on them
    junk += [torch.ones(1 << 20, device="cuda") for _ in range(8)]
    g2.replay()
    g1.replay()
    torch.cuda.synchronize()
    _same(out1, eager["bwd091"])
    _same(out2, eager["train"])
    del junk, keep


@cuda
def test_capture_keeps_no_fusedqkv_buffer():
    """Buffers fusedqkv keeps per stream are never created during a capture: a capture on a new
    stream leaves the kept buffers exactly as they were."""
    steps, keep = _steps()
    for step in steps.values():
        step()
    torch.cuda.synchronize()
    graph, side = _capture(steps["bwd091"])  # warm-up on the side stream: its kept buffers exist now
    torch.cuda.synchronize()
    before = fusedqkv.cache_info()["buffers"]
    with torch.cuda.graph(graph):  # captured on a stream fusedqkv has not seen
        steps["bwd091"]()
        steps["train"]()
    assert fusedqkv.cache_info()["buffers"] == before
    del keep


@cuda
def test_clear_caches_gives_the_memory_back():
    args = [t.cuda() if isinstance(t, torch.Tensor) else t
            for t in _oracle.make_inputs(1, HQ, HKV, 96, D, hidden=HID, seed=8)]
    ref = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    torch.cuda.synchronize()
    info = fusedqkv.cache_info()
    assert info["bytes"] > 0 and sum(c["plans"] for c in info["plans"].values()) > 0
    before = torch.cuda.memory_allocated()
    fusedqkv.clear_caches()
    assert torch.cuda.memory_allocated() <= before - info["bytes"]
    after = fusedqkv.cache_info()
    assert after["bytes"] == 0 and after["buffers"] == [] and all(c["plans"] == 0 for c in after["plans"].values())
    _same(fusedqkv.gqa_qkv_rope_qk_norm_backward(*args), ref)  # and the next call rebuilds what it needs


@cuda
def test_compiled_blocks_of_several_eps_in_one_process_inductor():
    """test_forward_autograd's case on the GPU through inductor: from the second compile on eps is symbolic."""
    from test_forward_autograd import compiled_blocks_of_several_eps

    compiled_blocks_of_several_eps("cuda", torch.bfloat16, "inductor")
