"""The raw launch on a GPU (fusedqkv.ops.internals): active on the device's Triton and torch, no
FastPathWarning, and bitwise the results of the JIT path. After ``clear_caches()`` each plan's
first call launches every kernel through Triton's JIT; later calls go raw, with the same tensors
and with moved ones (descriptors encoded again). The 091 shapes take each product route (the
Triton TMA chain, the hybrid, cuBLAS) and the stage with and without TMA descriptors."""

import warnings

import pytest
import torch

import _oracle
import fusedqkv
from fusedqkv.ops import internals

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda(args):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in args]


def _moved(args):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in args]


@cuda
@pytest.mark.parametrize("b, hq, hkv, s, d, hidden", [
    (1, 16, 4, 64, 128, 2048),  # the TMA chain, the stage with descriptors
    (1, 16, 4, 1000, 128, 2048),  # the hybrid
    (2, 16, 4, 1500, 128, 2048),  # cuBLAS
    (1, 8, 8, 33, 80, 512),  # head_dim 80: the stage without descriptors
    (1, 32, 8, 7, 128, 4096),
])
def test_091_raw_launches_equal_the_jit_path(b, hq, hkv, s, d, hidden):
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    args = _cuda(_oracle.make_inputs(b, hq, hkv, s, d, hidden=hidden, seed=s))
    fusedqkv.clear_caches()
    before = internals.fast_path_info()["bound_launches"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        jit = bw(*args)
        raw = bw(*args)
        moved = bw(*_moved(args))
    info = internals.fast_path_info()
    assert info["active"], info
    assert info["abi"] in (internals.MODULE_ABI, internals.SHARED_ABI)
    assert info["bound_launches"] > before
    for name, a, r, m in zip(("dX", "dcos", "dsin", "dW", "dwq", "dwk"), jit, raw, moved):
        assert torch.equal(a, r), name
        assert torch.equal(a, m), name


def _block_three_ways(fp8=None, after_first=None):
    """A training block's fwd+bwd after ``clear_caches()``: through the JIT, raw, raw with a moved input
    (a FastPathWarning an error): each call's outputs and gradients. ``after_first()`` runs after the first."""
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(1024, 16, 4, 64, dtype=torch.bfloat16, fp8=fp8).cuda()
    ang = torch.randn(1, 100, 64, device="cuda")
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    x0 = torch.randn(2, 100, 1024, device="cuda", dtype=torch.bfloat16)
    fusedqkv.clear_caches()
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        for step in range(3):  # the JIT, raw, raw with a moved input
            x = (x0.clone() if step == 2 else x0.detach()).requires_grad_(True)  # a fresh leaf, same memory
            block.zero_grad(set_to_none=True)
            q, k, v = block(x, cos, sin)
            (q.float().square().sum() + k.float().sum() + v.float().sum()).backward()
            results.append([q.detach(), k.detach(), v.detach(), x.grad] + [p.grad for p in block.parameters()])
            if step == 0 and after_first is not None:
                after_first()
    return results


@cuda
def test_training_block_raw_launches_equal_the_jit_path():
    results = _block_three_ways()
    assert internals.fast_path_info()["active"]
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], later))


@cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_fp8_block_cast_launches_go_raw_and_equal_the_jit_path(recipe):
    """The FP8 casts' launches (``fp8._LAUNCH``, no plan holds them): the first fwd+bwd through the JIT,
    then each signature bound, raw launches bitwise the JIT's, with the same and with moved inputs."""
    from fusedqkv.ops import fp8

    built = []
    results = _block_three_ways(recipe, lambda: built.append(fp8._LAUNCH.info()["builds"]))
    info = fp8._LAUNCH.info()
    assert info["plans"] > 0 and info["builds"] == built[0], info  # no signature built again
    assert info["bound"] == info["plans"], info
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], later))


@cuda
def test_torch_func_transforms_are_refused_on_the_gpu():
    """torch.func.grad and vmap over the block's eager GPU path (a plan cached and bound first): the
    refusal that names torch.func, never a launch with a transform's wrapped tensors; the 091 entry too."""
    from fusedqkv.ops.internals import FUNC_TRANSFORMS_REFUSED

    torch.manual_seed(0)
    m = fusedqkv.GQAQKVRoPEQKNorm(512, 8, 2, 64, dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 16, 512, device="cuda", dtype=torch.bfloat16)
    ang = torch.randn(2, 16, 64, device="cuda")
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    for _ in range(2):
        m(x, cos, sin)[0].float().sum().backward()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, t):
        return torch.func.functional_call(m, p, (t, cos, sin))[0].float().sum()

    for call in (lambda: torch.func.grad(loss)(params, x), lambda: torch.func.grad(loss, argnums=1)(params, x),
                 lambda: torch.func.vmap(lambda t: m(t[None], cos[:1], sin[:1])[0])(x)):
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == FUNC_TRANSFORMS_REFUSED
    args = _cuda(_oracle.make_inputs(1, 16, 4, 64, 128, hidden=2048, seed=3))
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        stacked = args[0].expand(2, *args[0].shape)
        torch.func.vmap(lambda a: fusedqkv.gqa_qkv_rope_qk_norm_backward(a, *args[1:])[0])(stacked)
