"""The CPU path's GEMMs run in fp32 on every CPU (ops.host_gemm): no half-precision GEMM reaches
torch during its calls, whose results keep the reference's rounding point (an fp32 sum rounded
once). torch's CPU bf16 GEMM is ~180x slower than fp32 without AVX-512 BF16 (_gemm_audit)."""

import _oracle
import pytest
import torch
from _gemm_audit import GemmCounter, HalfGemmError, layout

import fusedqkv
from fusedqkv.ops import host_gemm

HALF = [torch.bfloat16, torch.float16]


def test_the_counter_sees_half_gemms_and_their_layouts():
    a, w = torch.randn(4, 8).bfloat16(), torch.randn(8, 6).bfloat16()
    with GemmCounter() as c:
        a @ w  # NN: the layout that is slow without AVX-512 BF16
        a @ w.t().contiguous().t()  # NT (w column-major)
        torch.nn.functional.linear(a, w.t().contiguous())  # NT: x W^T
        torch.matmul(a.t().contiguous().t(), w)  # TN
    flops = 2 * 4 * 8 * 6
    assert dict(c.tally.flops) == {(torch.bfloat16, "NN"): flops, (torch.bfloat16, "NT"): 2 * flops,
                                   (torch.bfloat16, "TN"): flops}
    with pytest.raises(HalfGemmError, match="bfloat16 GEMM"):
        with GemmCounter(forbid_half=True):
            a @ w
    assert layout(torch.randn(3, 5)) == "N" and layout(torch.randn(5, 3).t()) == "T"
    assert layout(torch.randn(4, 6)[:, ::2]) == "S"


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_091_cpu_path_runs_no_half_gemm(dtype):
    args = _oracle.make_inputs(2, 4, 2, 5, 64, hidden=48, dtype=dtype, seed=3)
    with GemmCounter(forbid_half=True) as c:
        got = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    assert c.tally.flops[(torch.float32, "NN")] > 0 and c.tally.flops[(torch.float32, "TN")] > 0
    _oracle.assert_matches_oracle(got, _oracle.oracle_backward(*args))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_training_block_cpu_path_runs_no_half_gemm(dtype, bias):
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=16, bias=bias).to(dtype)
    x = torch.randn(2, 5, 48, dtype=dtype, requires_grad=True)
    ang = torch.randn(2, 5, 16)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    with GemmCounter(forbid_half=True) as c:
        q, k, v = block(x, cos, sin)
        (q.float().square().sum() + k.float().sum() + v.float().sum()).backward()
    assert c.tally.flops[(torch.float32, "NT")] > 0  # the forward: x W^T
    assert x.grad is not None and block.qkv_weight.grad is not None
    # the same block in fp32 throughout: the widened products differ from it only by the roundings
    ref = fusedqkv.ReferenceGQAQKVRoPEQKNorm(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=16, bias=bias)
    ref.load_state_dict({k_: t.float() for k_, t in block.state_dict().items()})
    x32 = x.detach().float().requires_grad_()
    q32, k32, v32 = ref(x32, cos.float(), sin.float())
    tol = 3 * torch.finfo(dtype).eps
    for got, want in ((q, q32), (k, k32), (v, v32)):
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol * float(want.detach().abs().max()))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_host_gemm_rounds_the_fp32_product_once(dtype):
    a, w, b = torch.randn(6, 40).to(dtype), torch.randn(40, 9).to(dtype), torch.randn(9).to(dtype)
    want = (a.float() @ w.float()).to(dtype)
    assert torch.equal(host_gemm.mm(a, w), want)
    out = torch.empty(9, 6, dtype=dtype).t()  # a strided destination
    host_gemm.mm(a, w, out=out)
    assert torch.equal(out, want)
    assert torch.equal(host_gemm.addmm(b, a, w), torch.addmm(b.float(), a.float(), w.float()).to(dtype))
    # fp32 operands go to torch as they are
    a32, w32 = a.float(), w.float()
    assert torch.equal(host_gemm.mm(a32, w32), torch.mm(a32, w32))
