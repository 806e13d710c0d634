"""The RoPE + QK-norm backward stage in accurate mode (the training path) against float64
autograd, with cos/sin whose halves differ (not HF-style), both norm positions, both backends."""

import pytest
import torch

from fusedqkv.ops.rope_qk_norm import rope_qk_norm_backward


def _rot(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _forward64(x, w, cos, sin, eps, after_rope):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if after_rope:
        xr = x * c + _rot(x) * s
        r = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps)
        return xr * r * w, r
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * r * w
    return n * c + _rot(n) * s, r


@pytest.mark.parametrize("recompute_rstd", [False, True], ids=["rstd_given", "rstd_recomputed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("after_rope", [True, False], ids=["after_rope", "before_rope"])
def test_accurate_stage_matches_float64_autograd(backend, after_rope, recompute_rstd):
    torch.manual_seed(0)
    B, HQ, HKV, S, D, eps = 2, 4, 2, 5, 64, 1e-6
    xq = torch.randn(B, HQ, S, D, dtype=torch.float64, requires_grad=True)
    xk = torch.randn(B, HKV, S, D, dtype=torch.float64, requires_grad=True)
    wq = (1 + 0.1 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    wk = (1 + 0.1 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    ang = torch.randn(B, S, D, dtype=torch.float64)  # independent angles per half: s1 != s2
    cos = ang.cos().requires_grad_()
    sin = ang.sin().requires_grad_()
    yq, rq = _forward64(xq, wq, cos, sin, eps, after_rope)
    yk, rk = _forward64(xk, wk, cos, sin, eps, after_rope)
    gq, gk = torch.randn_like(yq), torch.randn_like(yk)
    gv = torch.randn(B, HKV, S, D, dtype=torch.float64)
    ((yq * gq).sum() + (yk * gk).sum()).backward()

    f = lambda t: t.detach().float()  # noqa: E731
    M = B * S
    dqkv = torch.empty(M, (HQ + 2 * HKV) * D)
    gcos, gsin = torch.empty(B, S, D), torch.empty(B, S, D)
    gwq, gwk = torch.empty(D), torch.empty(D)
    rq32, rk32 = (None, None) if recompute_rstd else (f(rq[..., 0]), f(rk[..., 0]))
    rope_qk_norm_backward(f(gq), f(gk), f(gv), f(xq), f(xk), rq32, rk32, f(wq), f(wk),
                          f(cos), f(sin), dqkv=dqkv, grad_cos=gcos, grad_sin=gsin, grad_q_norm_weight=gwq,
                          grad_k_norm_weight=gwk, exact=False, norm_after_rope=after_rope, saved_rotated=False,
                          backend=backend, eps=eps)
    view = dqkv.view(B, S, -1)
    got_dq = view[..., : HQ * D].view(B, S, HQ, D).transpose(1, 2)
    got_dk = view[..., HQ * D: (HQ + HKV) * D].view(B, S, HKV, D).transpose(1, 2)
    got_dv = view[..., (HQ + HKV) * D:].view(B, S, HKV, D).transpose(1, 2)

    def close(a, b):
        b = b.float()
        assert (a - b).abs().max() <= 1e-4 * b.abs().max() + 1e-5, float((a - b).abs().max())

    close(got_dq, xq.grad)
    close(got_dk, xk.grad)
    assert torch.equal(got_dv, f(gv))
    close(gcos, cos.grad)
    close(gsin, sin.grad)
    close(gwq, wq.grad)
    close(gwk, wk.grad)
