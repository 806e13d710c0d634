"""The LoRA adapters' block-diagonal B (ops/lora.block_b, kernels/lora_blocks.py) and the
products over it (LoRAUpdate: the split forward's one ``addmm_``, dU in one GEMM): the builder
against ``torch.zeros`` + ``torch.mul(..., out=view)``, the update's forward and gradients with
the block path on and off against plain fp64 LoRA math, and the rule that picks the path.
The builder's Triton launch runs interpreted here (TRITON_INTERPRET=1); test_gpu_fused_forward.py
compares it bitwise on the GPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusedqkv.ops import config, lora as L
from fusedqkv.ops.config import INTERPRET
from fusedqkv.ops.lora import LoRAUpdate, block_b

interpret = pytest.mark.skipif(not INTERPRET, reason="the Triton kernels run on CPU under TRITON_INTERPRET=1 only")


def _pairs(dtype, n_tot=50, hidden=24, seed=0, cover=True):
    """Five pairs (two builder launches): odd rows and ranks, a transposed B, a B sliced from a
    wider tensor (row stride > rank), scales not powers of two, one negative; the last two live
    dropouts (not shared). ``cover`` False: rows 40.. of the block belong to no pair."""
    g = torch.Generator().manual_seed(seed)
    specs = [(0, 17, 3, 2.0), (17, 9, 5, 0.75), (26, 14, 2, 1 / 3), (0, 17, 4, -1.7), (26, 13, 1, 0.3)]
    if not cover:
        specs = [(row, min(rows, 40 - row), r, s) for row, rows, r, s in specs]
    out = []
    for k, (row, rows, r, s) in enumerate(specs):
        a = (torch.randn(r, hidden, generator=g) / hidden ** 0.5).to(dtype)
        if k == 1:
            b = (torch.randn(r, rows, generator=g) * 3).to(dtype).t()
        elif k == 2:
            b = (torch.randn(rows, r + 3, generator=g) * 3).to(dtype)[:, 1:r + 1]
        else:
            b = (torch.randn(rows, r, generator=g) * 3).to(dtype)
        out.append((row, rows, a, b, s, k < 3))
    return out, n_tot


def _cols(pairs):
    ranks = [p[2].shape[0] for p in pairs]
    return [sum(ranks[:i]) for i in range(len(ranks))], sum(ranks)


def _rtz_bf16(t):
    """fp32 -> bf16 rounded toward zero (the interpreter's cast; the GPU rounds to nearest even)."""
    return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@interpret
@pytest.mark.parametrize("b_dtype,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.float32, torch.float16)])
@pytest.mark.parametrize("cover", [True, False])
def test_builder_matches_the_torch_ops(b_dtype, dtype, cover):
    """Bitwise where the block is fp16/fp32. For bf16 the interpreter rounds toward zero (the GPU
    to nearest even, as torch): there the kernel's fp32 products are checked bitwise through that
    rounding, and the GPU test compares the blocks themselves."""
    pairs, n_tot = _pairs(b_dtype, cover=cover)
    cols, rank = _cols(pairs)
    want = block_b(pairs, cols, n_tot, rank, dtype, "torch")
    got = block_b(pairs, cols, n_tot, rank, dtype, "triton")
    ref = torch.zeros(n_tot, rank, dtype=dtype)
    for (row, rows, _, b, s, _), c in zip(pairs, cols):
        torch.mul(b, s, out=ref[row:row + rows, c:c + b.shape[1]])
    assert torch.equal(want, ref) and got.dtype == dtype and got.shape == (n_tot, rank)
    if dtype != torch.bfloat16:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    prod = torch.zeros(n_tot, rank)
    for (row, rows, _, b, s, _), c in zip(pairs, cols):
        prod[row:row + rows, c:c + b.shape[1]] = b.float() * torch.tensor(s, dtype=torch.float32)
    assert torch.equal(want, prod.to(torch.bfloat16))  # torch: one rounding of the fp32 product
    assert torch.equal(got.view(torch.int16), _rtz_bf16(prod).view(torch.int16))
    if not cover:
        assert not got[40:].float().any()


def test_builder_refuses_what_does_not_fit():
    pairs, n_tot = _pairs(torch.float32)
    cols, rank = _cols(pairs)
    with pytest.raises(ValueError, match=r"pairs\[2\]"):
        block_b(pairs, cols, 30, rank, torch.float32)
    with pytest.raises(ValueError, match="cols"):
        block_b(pairs, cols[:-1], n_tot, rank, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        block_b(pairs, cols, n_tot, rank, torch.float32, "cuda")


def _reference(pairs, x, xds, base, dqkv):
    """Plain fp64 LoRA: qkv = base + sum_i s_i (x_i A_i^T) B_i^T, and the gradients of every A, every
    B, x (the shared pairs' share) and the dropout inputs for the output gradient dqkv."""
    x = x.double().requires_grad_()
    xds = [xd.double().requires_grad_() for xd in xds]
    ab = [(p[2].double().requires_grad_(), p[3].double().requires_grad_()) for p in pairs]
    out = base.double().clone()
    own = iter(xds)
    for (row, rows, _, _, s, shared), (a, b) in zip(pairs, ab):
        inp = x if shared else next(own)
        out = out.index_add(1, torch.arange(row, row + rows), s * (inp @ a.t()) @ b.t())
    grads = torch.autograd.grad(out, [a for a, _ in ab] + [b for _, b in ab] + [x] + xds, dqkv.double())
    return out.detach(), list(grads)


@pytest.mark.parametrize("path", ["split", "gemm_operands"])
@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpret)])
def test_update_matches_fp64_lora_with_the_block_on_and_off(path, mode, backend):
    """fp32: the split forward (one addmm over the block, or one per pair) and the one-launch
    forward's operands ((U, block) as more inner columns), then the backward (dU over the block or
    per pair), against fp64; some block rows belong to no pair."""
    pairs, n_tot = _pairs(torch.float32, cover=False)
    m = 11
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, 24, generator=g)
    xds = [torch.randn(1, m, 24, generator=g) for _ in range(2)]  # [batch, seq, hidden] as PEFT's dropout gives
    base = torch.randn(m, n_tot, generator=g)
    dqkv = torch.randn(m, n_tot, generator=g)
    want, want_grads = _reference(pairs, x, [xd.reshape(m, -1) for xd in xds], base, dqkv)
    with config.override(lora_block=mode):
        update = LoRAUpdate(pairs, xds, n_tot, torch.float32)
        if path == "split":
            qkv = base.clone()
            update.forward(qkv, x, backend)
        else:
            u, b = update.gemm_operands(x, backend)
            qkv = base + u @ b.t()
        assert (update.block is not None) == (mode == "on" or path == "gemm_operands")
        assert update.dense_du == (mode == "on")
        g_x = torch.zeros(m, 24)
        grads = update.backward(dqkv, g_x, x, [True] * len(update.params))
    assert update.block is None and update.u is None  # nothing kept past the call
    n = len(pairs)
    got_grads = grads[:2 * n] + [g_x] + [gr.reshape(m, -1) for gr in grads[2 * n:]]
    assert torch.allclose(qkv.double(), want, rtol=1e-5, atol=1e-5)
    for k, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a.dtype == torch.float32 and a.shape == b.shape, k
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5), k
    assert all(gr.is_contiguous() for gr in grads[n:2 * n])  # dB in the parameter's layout


class _Products(TorchDispatchMode):
    """Counts the matrix products a block of code runs (each a cuBLAS launch on the GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _qkv_adapters(rows, rank, hidden, device="cpu"):
    """r=``rank`` adapters on q, k, v (``rows``), shared, bf16 (bench_lora's layout)."""
    out, row = [], 0
    for n in rows:
        a = torch.empty(rank, hidden, dtype=torch.bfloat16, device=device)
        b = torch.empty(n, rank, dtype=torch.bfloat16, device=device)
        out.append((row, n, a, b, 2.0, True))
        row += n
    return out, row


def test_the_rule_takes_the_block_wherever_it_saves_a_launch_at_memory_bound_ranks():
    """bench_lora's adapters (r=16 on q/k/v: R=48, 091's and h5120's rows): the block at every size on
    both paths (its products stay memory-bound); at r=32 (R=96) the flop rule: the block at 512
    tokens, per pair at 8192; a single pair never (the builder would cost the launch it saves)."""
    n = 3
    for rows in ((4096, 1024, 1024), (8192, 1024, 1024)):
        for r in (16, 32):
            pairs, n_tot = _qkv_adapters(rows, r, 8, "meta")
            update = LoRAUpdate(pairs, [], n_tot, torch.bfloat16)
            assert (update.rank <= L.BLOCK_MEMORY_BOUND_RANK) == (r == 16)
            zeros = n_tot * 3 * r - sum(rows) * r

            def want(m, products, saved):
                return r == 16 or 2 * m * zeros * products <= saved * L.BLOCK_FLOPS_PER_SAVED_LAUNCH
            for m in (512, 2048, 8192):
                assert update.block_pays(m, 2, 2 * n - 1 - 2) == want(m, 2, 2 * n - 1 - 2), (rows, r, m)
                assert update.block_pays(m, 1, n - 1) == want(m, 1, n - 1), (rows, r, m)
            if r == 32:  # the flop rule keeps the pairs at 8192 tokens, takes the block at 512
                assert not update.block_pays(8192, 1, n - 1) and update.block_pays(512, 2, 2 * n - 1 - 2)
    one = LoRAUpdate(_qkv_adapters((64,), 4, 8)[0], [], 64, torch.bfloat16)
    assert not one.block_pays(1, 2, 2 * 1 - 1 - 2)


@pytest.mark.parametrize("tokens,block", [(6, True), (40, False)])
def test_the_split_forward_and_dU_follow_the_rule(monkeypatch, tokens, block):
    """The products the update runs follow ``block_pays`` (its threshold scaled down to tiny
    sizes): the block path one forward product and one dU product; per pair three of each."""
    pairs, n_tot = _qkv_adapters((32, 8, 8), 4, 16)
    g = torch.Generator().manual_seed(1)
    pairs = [(row, rows, torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g), s, sh)
             for row, rows, a, b, s, sh in pairs]
    # waste per token over both products: 2 * (48 * 12 - 48 * 4) * 2 = 1536 flops; 3 saved launches
    monkeypatch.setattr(L, "BLOCK_FLOPS_PER_SAVED_LAUNCH", 1536 * 20 / 3)
    monkeypatch.setattr(L, "BLOCK_MEMORY_BOUND_RANK", 0)  # the flop rule at this tiny rank
    x = torch.randn(tokens, 16, generator=g)
    update = LoRAUpdate(pairs, [], n_tot, torch.float32)
    qkv = torch.zeros(tokens, n_tot)
    with _Products() as fwd:
        update.forward(qkv, x, "torch")
    assert (update.block is not None) == block and update.dense_du == block
    with _Products() as bwd:  # dU, dB per pair, dA (shared), dX += dU A
        update.backward(torch.randn(tokens, n_tot, generator=g), torch.zeros(tokens, 16), x, [True] * 6)
    assert fwd.n == 1 + (1 if block else 3)  # U, then the update
    assert bwd.n == (1 if block else 3) + 3 + 1 + 1
