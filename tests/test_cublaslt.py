"""Planned cuBLASLt matmuls (ops/cublaslt.py): the layout mapping on the CPU, the calls against
torch.mm on a GPU (every operand layout the plans use, both dtypes, odd sizes, padded rows, an
address off the 256-byte grid), bitwise repeatability, and the plans' use of them."""

import pytest
import torch

from fusedqkv.ops import config
from fusedqkv.ops import cublaslt as L

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_column_major_mapping():
    # row-major [r, c] with row stride ld: column-major [c, r], op N
    assert L._column_major((5, 7), (9, 1)) == (L._OP_N, 7, 5, 9)
    # a transposed view (unit row stride): column-major [r, c] of ld = column stride, op T
    assert L._column_major((5, 7), (1, 6)) == (L._OP_T, 5, 7, 6)
    # neither stride is 1: no view
    assert L._column_major((5, 7), (14, 2)) is None
    # a single column or row takes the row-major form with a leading dimension >= its extent
    assert L._column_major((5, 1), (3, 3))[0] == L._OP_N


def test_not_planned_off_gpu_or_for_other_dtypes():
    cfg = config.current()
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    assert L.lt_matmul(a, b, torch.empty(4, 3), cfg) is None
    assert L.lt_matmul(None, b, torch.empty(4, 3), cfg) is None
    with config.override(cublaslt=False) as off:
        assert L.lt_matmul(a, b, torch.empty(4, 3), off) is None


def _operand(shape, layout, dtype, pad=0, offset=0):
    """A [r, c] matrix stored row-major ("n"), as a transposed view ("t"), with ``pad`` extra
    elements per row/column, ``offset`` elements into its storage."""
    r, c = shape
    if layout == "n":
        base = torch.randn(offset + r * (c + pad), device="cuda").to(dtype)
        return base[offset:].view(r, c + pad)[:, :c]
    base = torch.randn(offset + c * (r + pad), device="cuda").to(dtype)
    return base[offset:].view(c, r + pad)[:, :r].t()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("la,lb", [("n", "n"), ("t", "n"), ("n", "t"), ("t", "t")])
@pytest.mark.parametrize("M,N,K", [(131, 4096, 6144), (64, 72, 40), (1, 24, 16), (300, 8, 1024)])
def test_matches_torch_mm(dtype, la, lb, M, N, K):
    torch.manual_seed(M + N + K)
    a = _operand((M, K), la, dtype, pad=8 if la == "n" else 0)
    b = _operand((K, N), lb, dtype)
    d = torch.empty(M, N, device="cuda", dtype=dtype)
    lt = L.lt_matmul(a, b, d, config.current())
    assert lt is not None
    stream = torch.cuda.current_stream().cuda_stream
    lt(a.data_ptr(), b.data_ptr(), d.data_ptr(), stream)
    ref = a.float() @ b.float()
    got = d.float()
    # fp32 accumulation, one rounding: within a few output ulps of the fp32 product
    tol = (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) * ref.abs().max().item() + 1e-3
    assert (got - ref).abs().max().item() <= tol
    # repeatable bit for bit
    d2 = torch.empty_like(d)
    lt(a.data_ptr(), b.data_ptr(), d2.data_ptr(), stream)
    assert torch.equal(d, d2)


@cuda
def test_addresses_off_the_256_byte_grid_take_the_16_byte_algorithm():
    dtype = torch.bfloat16
    a = _operand((131, 512), "n", dtype)
    b = _operand((512, 256), "n", dtype)
    d = torch.empty(131, 256, device="cuda", dtype=dtype)
    lt = L.lt_matmul(a, b, d, config.current())
    a2 = _operand((131, 512), "n", dtype, offset=8)  # 16 bytes in: aligned to 16, not to 256
    assert a2.data_ptr() % 256 and a2.data_ptr() % 16 == 0
    a2.copy_(a)
    d2 = torch.empty(131 * 256 + 8, device="cuda", dtype=dtype)[8:].view(131, 256)
    lt(a2.data_ptr(), b.data_ptr(), d2.data_ptr(), torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(d2.float(), (a.float() @ b.float()), rtol=2 ** -7, atol=1e-2)


@cuda
def test_plans_use_it_and_agree_with_torch_mm():
    """The 091 backward and the training block with and without the cuBLASLt calls: same
    results within a GEMM's rounding; the plans hold the calls only when it is on."""
    import fusedqkv
    from fusedqkv.ops import training_backward, training_forward

    torch.manual_seed(0)
    B, S, hidden, hq, hkv, D = 1, 300, 512, 8, 2, 64
    block = fusedqkv.GQAQKVRoPEQKNorm(hidden, hq, hkv, D, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(B, S, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ang = torch.randn(1, S, D, device="cuda")
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    results = {}
    for on in (True, False):
        with config.override(cublaslt=on):
            for _ in range(2):  # the second call runs on the bound plan
                x.grad = None
                for p in block.parameters():
                    p.grad = None
                q, k, v = block(x, cos, sin)
                (q.float().square().sum() + k.float().sum() + v.float().sum()).backward()
            fp = training_forward.PLANS.last()
            bp = training_backward.PLANS.last()
            assert (fp.lt_qkv is not None) == on and (bp.lt_dx is not None) == on and (bp.lt_dw is not None) == on
            results[on] = [t.detach().float().clone() for t in (q, k, v, x.grad, block.qkv_weight.grad)]
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2e-2)
