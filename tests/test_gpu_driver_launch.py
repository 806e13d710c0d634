"""The driver launch on a GPU (issue 36): on Triton 3.6 bound launches call cuLaunchKernelEx through
ctypes with their own parameter buffer (fusedqkv.ops.internals). Bitwise the results of Triton's
launcher (FUSEDQKV_RAW_LAUNCH=triton) for the 091 backward and the training block; a kernel with a
host TMA descriptor launched raw with the building tensors, moved ones, moved back, inside a CUDA
graph (replayed over new data) and with a launch hook registered (Triton's launcher then calls it);
a failed launch raises naming the driver's error."""

import warnings

import pytest
import torch
import triton
import triton.language as tl

import _oracle
import fusedqkv
from fusedqkv.ops import internals
from fusedqkv.ops.launch import BoundLaunch, Desc, Table

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
driver = pytest.mark.skipif(not internals._in_range(triton.__version__, internals.DRIVER_LAUNCH_SUPPORTED),
                            reason=f"the driver launch is proven on Triton "
                                   f"{internals._range_text(internals.DRIVER_LAUNCH_SUPPORTED)}")


@pytest.fixture
def launch_mode(monkeypatch):
    """``set(mode)``: later bound launches take ``mode`` (the plans cleared so they bind again)."""
    def set_mode(mode):
        monkeypatch.setattr(internals, "LAUNCH_MODE", mode)
        fusedqkv.clear_caches()

    yield set_mode
    fusedqkv.clear_caches()


@cuda
@driver
@pytest.mark.parametrize("b, hq, hkv, s, d, hidden", [
    (1, 16, 4, 64, 128, 2048),  # the TMA chain, the stage with descriptors
    (1, 16, 4, 1000, 128, 2048),  # the hybrid
    (1, 8, 8, 33, 80, 512),  # the stage without descriptors
])
def test_091_through_the_driver_equals_tritons_launcher(launch_mode, b, hq, hkv, s, d, hidden):
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    args = [t.cuda() if isinstance(t, torch.Tensor) else t
            for t in _oracle.make_inputs(b, hq, hkv, s, d, hidden=hidden, seed=s)]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        for mode in ("triton", "ctypes"):
            launch_mode(mode)
            before = internals.fast_path_info()["driver_launches"]
            bw(*args)  # the JIT, binding
            results[mode] = [bw(*args), bw(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])]
            bound = internals.fast_path_info()["driver_launches"] - before
            assert (bound > 0) == (mode == "ctypes"), (mode, bound)
    assert internals.fast_path_info()["active"]
    for a, c in zip(results["triton"], results["ctypes"]):
        for name, x, y in zip(("dX", "dcos", "dsin", "dW", "dwq", "dwk"), a, c):
            assert torch.equal(x, y), name


@cuda
@driver
def test_training_block_through_the_driver_equals_tritons_launcher(launch_mode):
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(1024, 16, 4, 64, dtype=torch.bfloat16).cuda()
    ang = torch.randn(1, 100, 64, device="cuda")
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    x0 = torch.randn(2, 100, 1024, device="cuda", dtype=torch.bfloat16)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        for mode in ("triton", "ctypes"):
            launch_mode(mode)
            for _ in range(2):  # the JIT, then raw
                x = x0.detach().clone().requires_grad_(True)
                block.zero_grad(set_to_none=True)
                q, k, v = block(x, cos, sin)
                (q.float().square().sum() + k.float().sum() + v.float().sum()).backward()
            results[mode] = [q.detach(), k.detach(), v.detach(), x.grad] + [p.grad for p in block.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results["triton"], results["ctypes"]))


@triton.jit
def _scale_rows(x_desc, y_ptr, n, stride_y, scale, BLOCK: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    x = x_desc.load([pid * BLOCK, 0]).to(tl.float32)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, COLS)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x * scale, mask=rows[:, None] < n)


@cuda
@driver
def test_a_descriptor_kernel_through_the_driver_eager_moved_in_a_graph_and_hooked(launch_mode):
    launch_mode("ctypes")
    x = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    y = torch.zeros(64, 32, device="cuda")
    table = Table()
    px, py = table.add("x", x), table.add("y", y)
    bl = BoundLaunch(_scale_rows, (4,), [Desc(px, [16, 32]), py, 64, 32, 2.0], dict(BLOCK=16, COLS=32))
    stream = torch.cuda.current_stream().cuda_stream
    bl.launch([x, y], None, stream)  # the JIT, binding
    assert bl.bound and bl.via_driver

    def run(xt, yt):
        ptrs = [xt.data_ptr(), yt.data_ptr()]
        bl.encode(ptrs)
        bl.launch(None, ptrs, torch.cuda.current_stream().cuda_stream)

    y.zero_()
    run(x, y)
    torch.cuda.synchronize()
    assert torch.equal(y, x.float() * 2)
    x2, y2 = torch.randn_like(x), torch.zeros_like(y)
    run(x2, y2)  # a moved descriptor and pointer
    y.zero_()
    run(x, y)  # moved back: the remembered map
    torch.cuda.synchronize()
    assert torch.equal(y2, x2.float() * 2) and torch.equal(y, x.float() * 2)
    # captured: the graph reads the addresses captured, the data at replay
    x3, y3 = torch.randn_like(x), torch.zeros_like(y)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(x3, y3)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(x3, y3)
    x3.copy_(torch.randn_like(x3))
    y3.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y3, x3.float() * 2)
    # a launch hook: Triton's launcher makes the launch and calls it
    calls = []
    hook = lambda metadata: calls.append(metadata)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        y.zero_()
        run(x, y)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(calls) == 1 and torch.equal(y, x.float() * 2)


@cuda
@driver
def test_a_failed_driver_launch_names_the_error():
    failed = internals._launch_failed(internals._cuda(), "a_kernel")
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx of a_kernel failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        failed(1, None, None, None)
