"""The all-heads stages (``norm_scope='all_heads'``: one program holds every head of a token) at
the head counts of released models and past them, on the GPU: each launches within the device's
shared memory (their pipeline stages are sized by ``all_heads_stages``), matches the torch
backend and repeats bitwise. Skipped without a CUDA GPU (the CPU tests: test_block_variants.py)."""

import pytest
import torch

from fusedqkv.ops.gqa_forward import rope_qk_norm_forward
from fusedqkv.ops.rope_qk_norm import rope_qk_norm_backward
from fusedqkv.ops.variant import Variant, heads_of

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [  # (hq, hkv, head_dim, dtype, variant switches)
    (32, 32, 128, torch.bfloat16, {}),  # OLMo 3 7B
    (40, 40, 128, torch.bfloat16, {}),  # OLMo 2 13B: 64-row tiles
    (64, 64, 128, torch.float16, dict(q_gate=True, v_norm=True)),
    (48, 8, 128, torch.bfloat16, dict(rot=64)),  # MiniMax-M2's heads
    (32, 32, 128, torch.float32, {}),  # fp32 tiles: fewer pipeline stages fit
    (96, 8, 256, torch.bfloat16, dict(interleaved=True)),
]


@cuda
@pytest.mark.parametrize("hq,hkv,d,dtype,switches", SHAPES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}-{str(s[3])[6:]}" for s in SHAPES])
def test_all_heads_stages_launch_and_match_torch(hq, hkv, d, dtype, switches):
    v = Variant(all_heads=True, **switches)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(hq * d)
    B, S = 2, 300
    nq = 2 * hq if v.q_gate else hq
    qkv = torch.randn(B, S, (nq + 2 * hkv) * d, device=dev, generator=g).to(dtype)
    wq = (1 + 0.2 * torch.randn(hq * d, device=dev, generator=g)).to(dtype)
    wk = (1 + 0.2 * torch.randn(hkv * d, device=dev, generator=g)).to(dtype)
    ang = torch.rand(B, S, v.rotary(d) // 2, device=dev, generator=g) * 6.3
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((ang.sin(), ang.sin()), -1)
    fwd = {b: rope_qk_norm_forward(qkv, wq, wk, cos, sin, hq, hkv, 1e-6, False, v, b) for b in ("torch", "triton")}
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(fwd["torch"], fwd["triton"]):
        if a is not None:
            torch.testing.assert_close(b, a, **tol)
    xq, xk, xv, _ = heads_of(qkv, hq, hkv, d, v.q_gate)
    gq, gk, gv = (torch.randn(t.shape, device=dev, generator=g).to(dtype) for t in (xq, xk, xk))
    gg = torch.randn(xq.shape, device=dev, generator=g).to(dtype) if v.q_gate else None
    got = {}
    for backend in ("torch", "triton", "triton again"):
        dqkv = torch.empty(B * S, qkv.shape[-1], device=dev, dtype=dtype)
        gw = torch.empty_like(wq), torch.empty_like(wk)
        gcs = torch.empty_like(cos), torch.empty_like(sin)
        rope_qk_norm_backward(gq, gk, gv, xq, xk, None, None, wq, wk, cos, sin, dqkv=dqkv, grad_cos=gcs[0],
                              grad_sin=gcs[1], grad_q_norm_weight=gw[0], grad_k_norm_weight=gw[1], exact=False,
                              norm_after_rope=False, saved_rotated=False, backend=backend.split()[0], eps=1e-6,
                              variant=v, grad_gate=gg, saved_v=xv if v.v_norm else None)
        got[backend] = (dqkv, *gcs, *gw)
    for a, b in zip(got["triton"], got["triton again"]):  # bitwise repeatable: no atomics in any sum
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(got["torch"], got["triton"])):
        scale = a.float().abs().max().clamp_min(1e-6)
        assert float((b.float() - a.float()).abs().max() / scale) < (1e-5 if dtype == torch.float32 else 2e-2), i
