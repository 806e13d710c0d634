"""Triton kernel of the forward of RoPE + per-head RMSNorm ("QK-norm").

``rope_qk_norm_fwd_kernel`` reads the projection output ``qkv`` token-major
``[tokens, (Hq + 2*Hkv) * D]``, applies RoPE and RMSNorm in either order, writes
q/k as ``[batch, heads, seq, head_dim]`` and rstd in fp32.
"""

import triton
import triton.language as tl

from .rope_qk_norm import _rotate, _store_cast


@triton.jit
def _head_set_fwd(
    x_ptr, s_x_t, col0,
    w_ptr, sw,
    o_ptr, so_b, so_h, so_s, so_d,
    r_ptr, sr_b, sr_h, sr_s,
    b, s, tok, tmask, c1, c2, s1, s2, eps,
    H, D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, H_P2: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr,
):
    h = tl.arange(0, H_P2)[:, None, None]
    d = tl.arange(0, HALF_P2)[None, None, :]
    bb = b[None, :, None]
    ss = s[None, :, None]
    hmask = (h < H) & tmask[None, :, None]
    mask = hmask & (d < HALF)
    x_base = x_ptr + tok[None, :, None].to(tl.int64) * s_x_t + col0 + h * D
    x1 = tl.load(x_base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + d + HALF, mask=mask, other=0.0).to(tl.float32)
    dmask = tl.arange(0, HALF_P2) < HALF
    w1 = tl.load(w_ptr + tl.arange(0, HALF_P2) * sw, mask=dmask, other=0.0).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + (tl.arange(0, HALF_P2) + HALF) * sw, mask=dmask, other=0.0).to(tl.float32)[None, None, :]
    if NORM_AFTER_ROPE:
        x1, x2 = _rotate(x1, x2, c1, c2, s1, s2, tl.float32, False)
    ms = (tl.sum(x1 * x1, axis=2, keep_dims=True) + tl.sum(x2 * x2, axis=2, keep_dims=True)) / D
    r = 1.0 / tl.sqrt(ms + eps)
    y1 = x1 * r * w1
    y2 = x2 * r * w2
    if not NORM_AFTER_ROPE:
        y1, y2 = _rotate(y1, y2, c1, c2, s1, s2, tl.float32, False)
    o_base = o_ptr + bb * so_b + h * so_h + ss * so_s
    _store_cast(o_base + d * so_d, y1, mask)
    _store_cast(o_base + (d + HALF) * so_d, y2, mask)
    tl.store(r_ptr + bb * sr_b + h * sr_h + ss * sr_s, r, mask=hmask)


@triton.jit
def rope_qk_norm_fwd_kernel(
    qkv_ptr, s_qkv_t,
    wq_ptr, swq, wk_ptr, swk,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    q_ptr, sq_b, sq_h, sq_s, sq_d,
    k_ptr, sk_b, sk_h, sk_s, sk_d,
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    eps, M, S, HQ, HKV, ITERS,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dh = tl.arange(0, HALF_P2)
    dmask = dh < HALF
    for it in range(0, ITERS):
        blk = pid + it * nprog
        tok = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = tok < M
        b = (tok // S).to(tl.int64)
        s = tok % S
        cmask = tmask[:, None] & dmask[None, :]
        cbase = cos_ptr + b[:, None] * scos_b + s[:, None] * scos_s
        sbase = sin_ptr + b[:, None] * ssin_b + s[:, None] * ssin_s
        c1 = tl.load(cbase + dh[None, :] * scos_d, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
        c2 = tl.load(cbase + (dh[None, :] + HALF) * scos_d, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
        s1 = tl.load(sbase + dh[None, :] * ssin_d, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
        s2 = tl.load(sbase + (dh[None, :] + HALF) * ssin_d, mask=cmask, other=0.0).to(tl.float32)[None, :, :]
        _head_set_fwd(qkv_ptr, s_qkv_t, 0, wq_ptr, swq,
                      q_ptr, sq_b, sq_h, sq_s, sq_d, rq_ptr, srq_b, srq_h, srq_s,
                      b, s, tok, tmask, c1, c2, s1, s2, eps,
                      HQ, D, HALF, HALF_P2, HQ_P2, NORM_AFTER_ROPE)
        _head_set_fwd(qkv_ptr, s_qkv_t, HQ * D, wk_ptr, swk,
                      k_ptr, sk_b, sk_h, sk_s, sk_d, rk_ptr, srk_b, srk_h, srk_s,
                      b, s, tok, tmask, c1, c2, s1, s2, eps,
                      HKV, D, HALF, HALF_P2, HKV_P2, NORM_AFTER_ROPE)
