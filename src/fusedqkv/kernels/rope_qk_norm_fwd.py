"""Triton kernel of the forward of RoPE + per-head RMSNorm ("QK-norm").

``rope_qk_norm_fwd_kernel`` reads the projection output ``qkv`` token-major
``[tokens, (Hq + 2*Hkv) * D]`` (last dim contiguous), applies RoPE and RMSNorm in
either order, writes q/k as ``[batch, heads, seq, head_dim]`` (any strides) and rstd
in fp32 ``[batch, heads, seq]`` (any strides).  All math is fp32; the outputs are
rounded once.

Grid: ``(token blocks, head groups)``.  Head groups are ``GROUP`` consecutive query
heads (the first ``cdiv(Hq, GROUP)`` groups) or key heads (the rest).  A program loads
cos/sin for its ``BLOCK_T`` tokens once, then loops over the heads of its group with
2D tiles ``[BLOCK_T, head_dim/2]`` -- the two rotate-half halves -- so the register
footprint does not grow with the head count (a 3D ``[heads, tokens, head_dim/2]``
tile spills on sm_90 with 32 heads).
"""

import triton
import triton.language as tl

from .rope_qk_norm import _store_cast, load_cos_sin


@triton.jit
def _rope_fwd_2d(x1, x2, c1, c2, s1, s2):
    # x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1); fp32
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _head_group_fwd(
    x_ptr, s_x_t, col0,
    w_ptr, sw,
    o_ptr, so_b, so_h, so_s, so_d,
    r_ptr, sr_b, sr_h, sr_s,
    tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
    h0, H,
    D: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
):
    dmask = dh < HALF
    w1 = tl.load(w_ptr + dh * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + (dh + HALF) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    x_row = x_ptr + tok64[:, None] * s_x_t + col0 + dh[None, :]
    for hh in range(0, GROUP):
        h = h0 + hh
        # a per-token block, not a scalar compare broadcast into the mask: Triton 3.9's interpreter
        # types a scalar compare by its operands (int32), and a splat of it is no valid mask
        hvalid = tl.broadcast_to(h, tmask.shape) < H
        mask = cmask & hvalid[:, None]
        xb = x_row + h * D
        x1 = tl.load(xb, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM_AFTER_ROPE:
            x1, x2 = _rope_fwd_2d(x1, x2, c1, c2, s1, s2)
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        r = 1.0 / tl.sqrt_rn(ms + eps)
        y1 = x1 * r[:, None] * w1
        y2 = x2 * r[:, None] * w2
        if not NORM_AFTER_ROPE:
            y1, y2 = _rope_fwd_2d(y1, y2, c1, c2, s1, s2)
        ob = o_ptr + b[:, None] * so_b + h * so_h + s[:, None] * so_s
        _store_cast(ob + dh[None, :] * so_d, y1, mask)
        _store_cast(ob + (dh[None, :] + HALF) * so_d, y2, mask)
        tl.store(r_ptr + b * sr_b + h * sr_h + s * sr_s, r, mask=tmask & hvalid)


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
    eps, M, S, HQ, HKV, NQG,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, GROUP: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)
    dh = tl.arange(0, HALF_P2)
    dmask = dh < HALF
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < M
    tok64 = tok.to(tl.int64)
    b = tok64 // S
    s = tok64 % S
    cmask = tmask[:, None] & dmask[None, :]
    c1, c2, s1, s2 = load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                  b, s, tmask, dh, HALF)
    if pid_g < NQG:
        _head_group_fwd(qkv_ptr, s_qkv_t, 0, wq_ptr, swq,
                        q_ptr, sq_b, sq_h, sq_s, sq_d, rq_ptr, srq_b, srq_h, srq_s,
                        tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
                        pid_g * GROUP, HQ, D, HALF, GROUP, NORM_AFTER_ROPE)
    else:
        _head_group_fwd(qkv_ptr, s_qkv_t, HQ * D, wk_ptr, swk,
                        k_ptr, sk_b, sk_h, sk_s, sk_d, rk_ptr, srk_b, srk_h, srk_s,
                        tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
                        (pid_g - NQG) * GROUP, HKV, D, HALF, GROUP, NORM_AFTER_ROPE)
