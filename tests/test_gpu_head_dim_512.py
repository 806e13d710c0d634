"""head_dim 512 (Gemma 4's global layers, issue 38) on the GPU: the stages at Gemma 4 31B's heads (32
query, 4 KV) in each layout the launcher picks at 512 (4-token blocks: head groups of 8 and of 16,
every head of a block), Gemma 4's block (weighted norms before RoPE, v normed) against the torch
backend and bitwise repeatable; the training API (v the raw k, ``k_eq_v``) in bf16 against float64
by the three-way rule;
and the 091 entry point at 512 on each products path (the PDL chain, the hybrid, cuBLAS) against
its torch backend. Skipped without a CUDA GPU (the CPU tests: test_block_variants.py,
test_091_backward.py)."""

import _oracle
import pytest
import torch

from fusedqkv import gqa_qkv_rope_qk_norm, gqa_qkv_rope_qk_norm_backward
from fusedqkv.module import reference_block
from fusedqkv.ops import backward_091
from fusedqkv.ops.gqa_forward import rope_qk_norm_forward
from fusedqkv.ops.rope_qk_norm import _launch_config, rope_qk_norm_backward
from fusedqkv.ops.variant import Variant, heads_of

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HQ, HKV, D = 32, 4, 512
GEMMA4 = Variant(v_norm=True)


def _layout(m: int) -> tuple:
    block_t, _, _, _, group = _launch_config(m, HQ, HKV, D, torch.device("cuda"))
    return block_t, group


@cuda
@pytest.mark.parametrize("b,s,dtype", [(2, 50, torch.bfloat16), (1, 1500, torch.bfloat16), (1, 4096, torch.bfloat16),
                                       (2, 50, torch.float32)], ids=["group8", "group16", "every_head", "group8-fp32"])
def test_stages_match_torch_backend_and_repeat(b, s, dtype):
    m = b * s
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = (4, 8) if m <= 1024 else ((4, 16) if -(-m // 8) < 3 * sms else (4, 0))
    assert _layout(m) == want
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m)
    qkv = torch.randn(b, s, (HQ + 2 * HKV) * D, device=dev, generator=g).to(dtype)
    wq, wk = ((1 + 0.2 * torch.randn(D, device=dev, generator=g)).to(dtype) for _ in range(2))
    ang = torch.rand(b, s, D // 2, device=dev, generator=g) * 6.3
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    fwd = {k: rope_qk_norm_forward(qkv, wq, wk, cos, sin, HQ, HKV, 1e-6, False, GEMMA4, k) for k in ("torch", "triton")}
    for a, t in zip(fwd["torch"], fwd["triton"]):
        scale = a.float().abs().max()
        assert float((t.float() - a.float()).abs().max() / scale) < tol
    xq, xk, xv, _ = heads_of(qkv, HQ, HKV, D, False)
    gq, gk, gv = (torch.randn(t.shape, device=dev, generator=g).to(dtype) for t in (xq, xk, xk))
    got = {}
    for backend in ("torch", "triton", "triton again"):
        dqkv = torch.empty(m, qkv.shape[-1], device=dev, dtype=dtype)
        gw = torch.empty_like(wq), torch.empty_like(wk)
        gcs = torch.empty_like(cos), torch.empty_like(sin)
        rope_qk_norm_backward(gq, gk, gv, xq, xk, None, None, wq, wk, cos, sin, dqkv=dqkv, grad_cos=gcs[0],
                              grad_sin=gcs[1], grad_q_norm_weight=gw[0], grad_k_norm_weight=gw[1], exact=False,
                              norm_after_rope=False, saved_rotated=False, backend=backend.split()[0], eps=1e-6,
                              variant=GEMMA4, saved_v=xv)
        got[backend] = (dqkv, *gcs, *gw)
    for a, t in zip(got["triton"], got["triton again"]):  # bitwise repeatable: no atomics in any sum
        assert torch.equal(a, t)
    for i, (a, t) in enumerate(zip(got["torch"], got["triton"])):
        scale = a.float().abs().max().clamp_min(1e-6)
        assert float((t.float() - a.float()).abs().max() / scale) < tol, i


@cuda
@pytest.mark.parametrize("b,s", [(1, 40), (2, 1100)])
def test_training_api_bf16_three_way(b, s):
    """Gemma 4's global block through the training API (v the raw k: rows [Q | K]; cuBLAS + the
    stages: the one-launch forward refuses head_dim 512), bf16: every output and gradient at most
    twice as far from float64 as the reference block in bf16, plus 1e-3 of the float64 maximum."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(s)
    hidden = 1024
    x = torch.randn(b, s, hidden, device=dev, generator=g, dtype=torch.float64)
    w = torch.randn((HQ + HKV) * D, hidden, device=dev, generator=g, dtype=torch.float64) / hidden ** 0.5
    wq, wk = (1 + 0.2 * torch.randn(D, device=dev, generator=g, dtype=torch.float64) for _ in range(2))
    ang = torch.rand(1, s, D // 2, device=dev, generator=g, dtype=torch.float64) * 6.3
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    gr = [torch.randn(sh, device=dev, generator=g, dtype=torch.float64)
          for sh in ((b, HQ, s, D), (b, HKV, s, D), (b, HKV, s, D))]

    def run(dtype, fn):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w, wq, wk)]
        out = fn(*leaves, cos.to(dtype), sin.to(dtype))
        grads = torch.autograd.grad(out, leaves, [t.to(dtype) for t in gr])
        return [o.detach().double() for o in out] + [t.double() for t in grads]

    def ref(*a):
        return reference_block(*a, HQ, HKV, 1e-6, False, v_norm=True, k_eq_v=True)

    exact = run(torch.float64, ref)
    eager = run(torch.bfloat16, ref)
    ours = run(torch.bfloat16, lambda *a: gqa_qkv_rope_qk_norm(*a, num_heads=HQ, num_kv_heads=HKV, eps=1e-6,
                                                                qk_norm_position="before_rope", v_norm=True,
                                                                k_eq_v=True))
    for i, (o, e, r) in enumerate(zip(ours, eager, exact)):
        scale = float(r.abs().max())
        assert float((o - r).abs().max()) <= 2 * float((e - r).abs().max()) + 1e-3 * scale, i


@cuda
@pytest.mark.parametrize("seq,path", [(64, "chain"), (1000, "hybrid"), (3000, "cublas")])
def test_091_entry_point_at_head_dim_512(seq, path):
    """The 091 backward at head_dim 512 (exact mode) on each products path: the stage's outputs
    (grad_cos, grad_sin, the norm-weight gradients) and the products against the torch backend on
    the same GPU, within a bf16 rounding."""
    args = [t.cuda() if isinstance(t, torch.Tensor) else t
            for t in _oracle.make_inputs(1, HQ, HKV, seq, D, hidden=1024, seed=seq)]
    ref = gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    got = gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    assert backward_091.PLANS.last().path == path
    for name, a, t in zip(("grad_hidden_states", "grad_cos", "grad_sin", "grad_qkv_weight", "grad_q_norm_weight",
                           "grad_k_norm_weight"), ref, got):
        a, t = a.float(), t.float()
        assert ((a - t).abs() <= a.abs() * 2 ** -7 + 1e-3 * float(a.abs().max())).all(), name
