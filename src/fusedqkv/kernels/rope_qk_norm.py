"""Triton kernels for RoPE + per-head RMSNorm ("QK-norm") of a GQA attention block.

Kernels (the forward lives in rope_qk_norm_fwd.py):

* ``rope_qk_norm_bwd_kernel`` -- grid (token blocks, head groups). A program takes
  BLOCK_T tokens and a group of query heads, key heads or value heads, and loops over
  its heads with [tokens, head_dim/2] tiles (small tiles: no spills, and the head
  groups give parallelism when there are few tokens). It writes dQKV token-major
  ``[tokens, (Hq + 2*Hkv) * D]`` -- the ``[Q | K | V]`` layout the two projection
  GEMMs read (V is a plain copy) -- and fp32 partials: the group's head-sums of
  grad_cos/grad_sin per token and its norm-weight gradient.  Constexpr switches:

  - ``EXACT``: reproduce the bf16 rounding points of SOL-ExecBench 091's eager
    reference (every eager low-precision op rounds its result) -- needed to pass
    the official check -- or compute in fp32 and round once (training path).
  - ``NORM_AFTER_ROPE``: RMSNorm applied to the rotated tensor (HunyuanImage-3.0,
    091) or before RoPE (Qwen3 / OLMo 2).
  - ``SAVED_ROTATED``: the saved activation is the rotated one (091 hands over
    ``query_pre_norm`` = after RoPE) or the raw projection output (training).
  - ``GRAD_COS_SIN``: compute grad_cos/grad_sin at all.
  - ``RECOMPUTE_RSTD``: recompute rstd from the saved activation (training: nothing but
    the projection output is kept between forward and backward) instead of loading it.

  One program's work is ``_stage_program(pid_t, group, ...)``; the single-launch kernel
  (gqa_bwd_single_launch.py) runs the same work items from a persistent loop.

* The finish: sums the partials over head groups in a fixed order (deterministic; no
  atomics in any sum): grad_cos/grad_sin per token, with 091's rounding of the separate
  query and key sums, and the two norm-weight gradients. With ``FUSED_FINISH`` the last
  program of each token chunk to finish does it inside the main kernel (a self-resetting
  ticket decides who is last); otherwise ``rope_qk_norm_bwd_finish_kernel`` does it as
  a second launch queued after the GEMMs.

All tensors are addressed through explicit strides so non-contiguous views work.
Rotate-half RoPE is handled by loading the two halves of head_dim as separate tiles.
"""

import os

import triton
import triton.language as tl

# Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest even
# (the GPU's cvt.rn does round); under it, bf16 rounding is done with integer ops.
_SOFT_BF16_ROUND = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _bf16_rne(x):
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))


@triton.jit
def _rnd(x, DT: tl.constexpr, EXACT: tl.constexpr):
    # In EXACT mode every intermediate is rounded to the activation dtype, as an eager
    # op in that dtype would do; otherwise values stay fp32.
    if EXACT:
        if _SOFT_BF16_ROUND and DT == tl.bfloat16:
            return _bf16_rne(x)
        else:
            return x.to(DT).to(tl.float32)
    else:
        return x


@triton.jit
def _store_cast(ptr, x, mask):
    # the final rounding to the destination dtype (round to nearest even)
    if _SOFT_BF16_ROUND and ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _bf16_rne(x).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s, tmask, dh,
                 HALF: tl.constexpr):
    """cos/sin halves of a block of tokens as fp32 [tokens, head_dim/2] tiles."""
    cmask = tmask[:, None] & (dh[None, :] < HALF)
    cbase = cos_ptr + b[:, None] * scos_b + s[:, None] * scos_s
    sbase = sin_ptr + b[:, None] * ssin_b + s[:, None] * ssin_s
    c1 = tl.load(cbase + dh[None, :] * scos_d, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(cbase + (dh[None, :] + HALF) * scos_d, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(sbase + dh[None, :] * ssin_d, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(sbase + (dh[None, :] + HALF) * ssin_d, mask=cmask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DT: tl.constexpr, EXACT: tl.constexpr):
    # x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)
    y1 = _rnd(_rnd(x1 * c1, DT, EXACT) + _rnd(-x2 * s1, DT, EXACT), DT, EXACT)
    y2 = _rnd(_rnd(x2 * c2, DT, EXACT) + _rnd(x1 * s2, DT, EXACT), DT, EXACT)
    return y1, y2


@triton.jit
def _rope_bwd(g1, g2, c1, c2, s1, s2, DT: tl.constexpr, EXACT: tl.constexpr):
    # The transpose of the rotation y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2 is
    # (g1*c1 + g2*s2, g2*c2 - g1*s1). 091's reference computes g*cos + cat(g2, -g1)*sin,
    # which swaps s1 and s2 -- the same when both halves of sin agree (HF RoPE), not for
    # 091's random cos/sin; EXACT mode reproduces the reference, otherwise the true one.
    if EXACT:
        sa = s1
        sb = s2
    else:
        sa = s2
        sb = s1
    y1 = _rnd(_rnd(g1 * c1, DT, EXACT) + _rnd(g2 * sa, DT, EXACT), DT, EXACT)
    y2 = _rnd(_rnd(g2 * c2, DT, EXACT) + _rnd(-g1 * sb, DT, EXACT), DT, EXACT)
    return y1, y2


@triton.jit
def _rms_norm_bwd(g1, g2, x1, x2, r, w1, w2, D: tl.constexpr, DT: tl.constexpr, EXACT: tl.constexpr):
    # d/dx of x*r*w with r = rsqrt(mean(x^2)+eps):  g*w*r - r^3 * x * sum(g*w*x) / D.
    # Tiles are [tokens, head_dim/2]; r is [tokens, 1]. The operation order follows the
    # eager reference so EXACT mode matches it up to the order of the fp32 sum over head_dim.
    gw1 = g1 * w1
    gw2 = g2 * w2
    grad_rstd = tl.sum(gw1 * x1, axis=1, keep_dims=True) + tl.sum(gw2 * x2, axis=1, keep_dims=True)
    neg_r3 = -(r * r * r)
    dx1 = _rnd(gw1 * r + grad_rstd * ((neg_r3 * x1) / D), DT, EXACT)
    dx2 = _rnd(gw2 * r + grad_rstd * ((neg_r3 * x2) / D), DT, EXACT)
    # weight-gradient contribution g * (x * r), per element: the caller sums over tokens
    # once per program (a sum over the token axis crosses warps: shared memory and a
    # barrier, too costly once per head)
    return dx1, dx2, g1 * (x1 * r), g2 * (x2 * r)


@triton.jit
def _rstd(x1, x2, eps, D: tl.constexpr):
    # as the forward computes it: 1 / sqrt(mean(x^2) + eps), per token
    ms = (tl.sum(x1 * x1, axis=1, keep_dims=True) + tl.sum(x2 * x2, axis=1, keep_dims=True)) / D
    return 1.0 / tl.sqrt(ms + eps)


@triton.jit
def _load_head(g_row, sg_h, sg_d, x_row, sx_h, sx_d, r_row, sr_h, h, h1, d, mask, tmask, HALF: tl.constexpr):
    """Raw tiles of head h (masked off once h reaches h1): both halves of g and x, and rstd."""
    pmask = mask & (h < h1)
    g1 = tl.load(g_row + h * sg_h + d * sg_d, mask=pmask, other=0.0)
    g2 = tl.load(g_row + h * sg_h + (d + HALF) * sg_d, mask=pmask, other=0.0)
    x1 = tl.load(x_row + h * sx_h + d * sx_d, mask=pmask, other=0.0)
    x2 = tl.load(x_row + h * sx_h + (d + HALF) * sx_d, mask=pmask, other=0.0)
    r = tl.load(r_row + h * sr_h, mask=tmask & (h < h1), other=0.0)
    return g1, g2, x1, x2, r


@triton.jit
def _head_group_bwd(
    g_ptr, sg_b, sg_h, sg_s, sg_d,
    x_ptr, sx_b, sx_h, sx_s, sx_d,
    r_ptr, sr_b, sr_h, sr_s,
    w_ptr, sw,
    dqkv_ptr, s_dqkv_t, col0,
    cs_ptr, group, M,
    h0, h1, b, s, tok, tmask,
    c1, c2, s1, s2, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    DT: tl.constexpr, EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
    SAVED_ROTATED: tl.constexpr, GRAD_COS_SIN: tl.constexpr, BLOCK_T: tl.constexpr,
    RECOMPUTE_RSTD: tl.constexpr, PF: tl.constexpr,
):
    """Backward of heads [h0, h1) of one head set (query or key) for a block of tokens.
    Returns the block's norm-weight gradient contributions per element ([tokens, D/2] x 2),
    summed over the heads."""
    d = tl.arange(0, HALF_P2)[None, :]
    dmask = tl.arange(0, HALF_P2) < HALF
    mask = tmask[:, None] & (d < HALF)
    w1 = tl.load(w_ptr + tl.arange(0, HALF_P2) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + (tl.arange(0, HALF_P2) + HALF) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    g_row = g_ptr + b[:, None] * sg_b + s[:, None] * sg_s
    x_row = x_ptr + b[:, None] * sx_b + s[:, None] * sx_s
    r_row = r_ptr + b * sr_b + s * sr_s
    out_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + col0

    cs1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    cs2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    sn1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    sn2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    wg1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    wg2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    # The stage is bound by memory latency (few bytes in flight per SM): Triton's pipeliner
    # keeps the tiles of the next PF - 1 heads in flight (cp.async into shared memory, so
    # no registers) while head h is computed. A hand-rolled register queue of the same
    # depth doubled the register count (benchmarks/NOTES.md, v7).
    for h in tl.range(h0, h1, num_stages=PF):
        tiles = _load_head(g_row, sg_h, sg_d, x_row, sx_h, sx_d, r_row, sr_h, h, h1, d, mask, tmask, HALF)
        g1 = tiles[0].to(tl.float32)
        g2 = tiles[1].to(tl.float32)
        x1 = tiles[2].to(tl.float32)
        x2 = tiles[3].to(tl.float32)
        r = tiles[4].to(tl.float32)[:, None]
        if NORM_AFTER_ROPE:
            # the norm sees the rotated tensor; grad_cos/sin need the tensor RoPE was applied
            # to. 091's reference "recovers" it by rotating the saved rotated tensor once
            # more; for a saved raw tensor it is the forward rotation -- one formula.
            o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, DT, EXACT)
            if SAVED_ROTATED:
                n1 = x1
                n2 = x2
                p1 = o1
                p2 = o2
            else:
                n1 = o1
                n2 = o2
                p1 = x1
                p2 = x2
            if RECOMPUTE_RSTD:
                r = _rstd(n1, n2, eps, D)
            gn1, gn2, a1, a2 = _rms_norm_bwd(g1, g2, n1, n2, r, w1, w2, D, DT, EXACT)
            dx1, dx2 = _rope_bwd(gn1, gn2, c1, c2, s1, s2, DT, EXACT)
            q1 = gn1
            q2 = gn2
        else:
            # RoPE after the norm: the rotated tensor is x * r * w
            gn1, gn2 = _rope_bwd(g1, g2, c1, c2, s1, s2, DT, EXACT)
            if RECOMPUTE_RSTD:
                r = _rstd(x1, x2, eps, D)
            dx1, dx2, a1, a2 = _rms_norm_bwd(gn1, gn2, x1, x2, r, w1, w2, D, DT, EXACT)
            p1 = x1 * r * w1
            p2 = x2 * r * w2
            q1 = g1
            q2 = g2
        wg1 += a1
        wg2 += a2
        _store_cast(out_row + h * D + d, dx1, mask)
        _store_cast(out_row + h * D + d + HALF, dx2, mask)
        if GRAD_COS_SIN:
            # d/dcos: g * p ; d/dsin: g * rotate_half(p), rotate_half(p) = cat(-p2, p1)
            cs1 += _rnd(q1 * p1, DT, EXACT)
            cs2 += _rnd(q2 * p2, DT, EXACT)
            sn1 += _rnd(-(q1 * p2), DT, EXACT)
            sn2 += _rnd(q2 * p1, DT, EXACT)

    if GRAD_COS_SIN:
        # partials [groups, 2 (cos, sin), M, D] fp32
        cs_row = cs_ptr + (group * 2 * M + tok[:, None]).to(tl.int64) * D
        tl.store(cs_row + d, cs1, mask=mask)
        tl.store(cs_row + HALF + d, cs2, mask=mask)
        sn_row = cs_row + M.to(tl.int64) * D
        tl.store(sn_row + d, sn1, mask=mask)
        tl.store(sn_row + HALF + d, sn2, mask=mask)
    return wg1, wg2


@triton.jit
def rope_qk_norm_bwd_kernel(
    # grads of the block outputs [B, H, S, D]
    gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d,
    gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
    gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d,
    # saved activations [B, H, S, D]
    xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
    xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
    # rstd [B, H, S] (a trailing size-1 dim dropped by the launcher)
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    # norm weights [D]
    wq_ptr, swq, wk_ptr, swk,
    # cos / sin [B, S, D]
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    # outputs: dQKV [M, (Hq + 2 Hkv) D]; fp32 partials of grad_cos/sin and the norm weights
    dqkv_ptr, s_dqkv_t,
    cs_ptr, wpart_ptr,
    # final outputs and tickets (FUSED_FINISH only)
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    gwq_ptr, sgwq, gwk_ptr, sgwk, tick_ptr, wsup_ptr,
    M, S, HQ, HKV, HEADS_PER_GROUP, NQG, NKG, TPP, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, SAVED_ROTATED: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, FUSED_FINISH: tl.constexpr, SUPER: tl.constexpr,
    RECOMPUTE_RSTD: tl.constexpr, PF: tl.constexpr,
):
    """Grid (programs along tokens, head groups): one ``_stage_program`` per program."""
    _stage_program(
        tl.program_id(0), tl.program_id(1), tl.num_programs(0),
        gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d,
        xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, rq_ptr, srq_b, srq_h, srq_s,
        rk_ptr, srk_b, srk_h, srk_s, wq_ptr, swq, wk_ptr, swk, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b,
        ssin_s, ssin_d, dqkv_ptr, s_dqkv_t, cs_ptr, wpart_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr,
        sgsin_b, sgsin_s, sgsin_d, gwq_ptr, sgwq, gwk_ptr, sgwk, tick_ptr, wsup_ptr, M, S, HQ, HKV,
        HEADS_PER_GROUP, NQG, NKG, TPP, eps, D, HALF, HALF_P2, D_P2, BLOCK_T, EXACT, NORM_AFTER_ROPE,
        SAVED_ROTATED, GRAD_COS_SIN, FUSED_FINISH, SUPER, RECOMPUTE_RSTD, PF
    )


@triton.jit
def _stage_program(
    # which token chunk and head group, of how many chunks
    pid_t, group, n_prog_t,
    # grads of the block outputs [B, H, S, D]
    gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d,
    gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
    gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d,
    # saved activations [B, H, S, D]
    xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
    xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
    # rstd [B, H, S] (a trailing size-1 dim dropped by the launcher)
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    # norm weights [D]
    wq_ptr, swq, wk_ptr, swk,
    # cos / sin [B, S, D]
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    # outputs: dQKV [M, (Hq + 2 Hkv) D]; fp32 partials of grad_cos/sin and the norm weights
    dqkv_ptr, s_dqkv_t,
    cs_ptr, wpart_ptr,
    # final outputs and tickets (FUSED_FINISH only)
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    gwq_ptr, sgwq, gwk_ptr, sgwk, tick_ptr, wsup_ptr,
    M, S, HQ, HKV, HEADS_PER_GROUP, NQG, NKG, TPP, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, SAVED_ROTATED: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, FUSED_FINISH: tl.constexpr, SUPER: tl.constexpr,
    RECOMPUTE_RSTD: tl.constexpr, PF: tl.constexpr,
):
    """One (token chunk, head group) work item of the backward stage."""
    DT: tl.constexpr = gq_ptr.dtype.element_ty
    dh = tl.arange(0, HALF_P2)
    wg1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    wg2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    # each program takes TPP consecutive token blocks, so that the norm-weight partials
    # (one row per program and group) stay few enough for a quick final reduction
    for it in range(0, TPP):
        tok = (pid_t * TPP + it) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = tok < M
        b = (tok // S).to(tl.int64)
        s = tok % S
        if group < NQG + NKG:
            c1, c2, s1, s2 = load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                          b, s, tmask, dh, HALF)
            if group < NQG:
                h0 = group * HEADS_PER_GROUP
                a1, a2 = _head_group_bwd(
                    gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d,
                    xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
                    rq_ptr, srq_b, srq_h, srq_s,
                    wq_ptr, swq,
                    dqkv_ptr, s_dqkv_t, 0,
                    cs_ptr, group, M,
                    h0, tl.minimum(h0 + HEADS_PER_GROUP, HQ), b, s, tok, tmask, c1, c2, s1, s2, eps,
                    D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T,
                    RECOMPUTE_RSTD, PF,
                )
            else:
                h0 = (group - NQG) * HEADS_PER_GROUP
                a1, a2 = _head_group_bwd(
                    gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
                    xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
                    rk_ptr, srk_b, srk_h, srk_s,
                    wk_ptr, swk,
                    dqkv_ptr, s_dqkv_t, HQ * D,
                    cs_ptr, group, M,
                    h0, tl.minimum(h0 + HEADS_PER_GROUP, HKV), b, s, tok, tmask, c1, c2, s1, s2, eps,
                    D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T,
                    RECOMPUTE_RSTD, PF,
                )
            wg1 += a1
            wg2 += a2
        else:
            # V needs no math: copy its heads of this group into the last third of dQKV
            h0 = (group - NQG - NKG) * HEADS_PER_GROUP
            h1 = tl.minimum(h0 + HEADS_PER_GROUP, HKV)
            dv = tl.arange(0, D_P2)[None, :]
            vmask = tmask[:, None] & (dv < D)
            v_row = gv_ptr + b[:, None] * sgv_b + s[:, None] * sgv_s + dv * sgv_d
            o_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + (HQ + HKV) * D + dv
            for h in range(h0, h1):
                v = tl.load(v_row + h * sgv_h, mask=vmask, other=0.0)
                tl.store(o_row + h * D, v.to(dqkv_ptr.dtype.element_ty), mask=vmask)  # same dtype: a copy
    if group < NQG + NKG:
        # norm-weight partials [groups, programs along tokens, D] fp32
        wrow = wpart_ptr + (group * n_prog_t + pid_t) * D
        tl.store(wrow + dh, tl.sum(wg1, axis=0), mask=dh < HALF)
        tl.store(wrow + HALF + dh, tl.sum(wg2, axis=0), mask=dh < HALF)
        if FUSED_FINISH:
            # The last program of this token chunk to finish (a ticket, not a sum: the
            # results are summed in a fixed order) turns the chunk's partials into
            # grad_cos/grad_sin; the last chunk to finish reduces the norm-weight partials.
            # Tickets reset themselves for the next call. Acquire/release atomics order the
            # partial stores; .cg loads read them from L2.
            tl.debug_barrier()
            ticket = tl.atomic_add(tick_ptr + pid_t, 1)
            if ticket == NQG + NKG - 1:
                tl.store(tick_ptr + pid_t, 0)
                if GRAD_COS_SIN:
                    for it in range(0, TPP):
                        _finish_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
                                        gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                                        (pid_t * TPP + it) * BLOCK_T, M, S, NQG, NKG,
                                        D, D_P2, BLOCK_T, DT, EXACT, ".cg")
                # norm weights, in two levels so no single program walks all the rows: the
                # last chunk of each run of SUPER chunks sums their rows into a super row,
                # the last super row to be written sums those
                tl.debug_barrier()
                n_sup = tl.cdiv(n_prog_t, SUPER)
                sup = pid_t // SUPER
                c0 = sup * SUPER
                n_in = tl.minimum(SUPER, n_prog_t - c0)
                t2 = tl.atomic_add(tick_ptr + n_prog_t + sup, 1)
                if t2 == n_in - 1:
                    tl.store(tick_ptr + n_prog_t + sup, 0)
                    wq_sum = _sum_rows(wpart_ptr, 0, NQG, n_prog_t, c0, n_in, D, D_P2, SUPER)
                    wk_sum = _sum_rows(wpart_ptr, NQG, NQG + NKG, n_prog_t, c0, n_in, D, D_P2, SUPER)
                    dd = tl.arange(0, D_P2)
                    tl.store(wsup_ptr + (sup * 2) * D + dd, wq_sum, mask=dd < D)
                    tl.store(wsup_ptr + (sup * 2 + 1) * D + dd, wk_sum, mask=dd < D)
                    tl.debug_barrier()
                    t3 = tl.atomic_add(tick_ptr + n_prog_t + n_sup, 1)
                    if t3 == n_sup - 1:
                        tl.store(tick_ptr + n_prog_t + n_sup, 0)
                        rows = tl.arange(0, SUPER)[:, None]
                        m = (rows < n_sup) & (dd[None, :] < D)
                        q = tl.load(wsup_ptr + (rows * 2) * D + dd[None, :], mask=m, other=0.0, cache_modifier=".cg")
                        k = tl.load(wsup_ptr + (rows * 2 + 1) * D + dd[None, :], mask=m, other=0.0,
                                    cache_modifier=".cg")
                        _store_cast(gwq_ptr + dd * sgwq, tl.sum(q, axis=0), dd < D)
                        _store_cast(gwk_ptr + dd * sgwk, tl.sum(k, axis=0), dd < D)


@triton.jit
def _finish_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                    tok0, M, S, NQG, NKG,
                    D: tl.constexpr, D_P2: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr,
                    EXACT: tl.constexpr, CACHE: tl.constexpr):
    """grad_cos / grad_sin of tokens [tok0, tok0 + BLOCK_T) from the head-group partials."""
    d = tl.arange(0, D_P2)[None, :]
    tok = tok0 + tl.arange(0, BLOCK_T)[:, None]
    mask = (tok < M) & (d < D)
    b = (tok // S).to(tl.int64)
    s = tok % S
    for which in range(0, 2):  # 0: cos, 1: sin
        q = tl.zeros([BLOCK_T, D_P2], tl.float32)
        for g in range(0, NQG):
            q += tl.load(cs_ptr + ((g * 2 + which) * M + tok).to(tl.int64) * D + d, mask=mask, other=0.0,
                         cache_modifier=CACHE)
        k = tl.zeros([BLOCK_T, D_P2], tl.float32)
        for g in range(NQG, NQG + NKG):
            k += tl.load(cs_ptr + ((g * 2 + which) * M + tok).to(tl.int64) * D + d, mask=mask, other=0.0,
                         cache_modifier=CACHE)
        # the reference sums q and k contributions separately (each rounded), then adds
        v = _rnd(_rnd(q, DT, EXACT) + _rnd(k, DT, EXACT), DT, EXACT)
        if which == 0:
            _store_cast(gcos_ptr + b * sgcos_b + s * sgcos_s + d * sgcos_d, v, mask)
        else:
            _store_cast(gsin_ptr + b * sgsin_b + s * sgsin_s + d * sgsin_d, v, mask)


@triton.jit
def _finish_norm_weight(wpart_ptr, g0, g1, N_PROG_T, out_ptr, s_out,
                        D: tl.constexpr, D_P2: tl.constexpr, BLOCK_R: tl.constexpr, CACHE: tl.constexpr):
    """Sum of the partial rows of head groups [g0, g1) in a fixed order."""
    d = tl.arange(0, D_P2)[None, :]
    acc = tl.zeros([BLOCK_R, D_P2], tl.float32)
    n_rows = (g1 - g0) * N_PROG_T
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)[:, None]
        acc += tl.load(wpart_ptr + (g0 * N_PROG_T + rows) * D + d, mask=(rows < n_rows) & (d < D), other=0.0,
                       cache_modifier=CACHE)
    total = tl.sum(acc, axis=0)
    dd = tl.arange(0, D_P2)
    _store_cast(out_ptr + dd * s_out, total, dd < D)


@triton.jit
def _sum_rows(wpart_ptr, g0, g1, N_PROG_T, c0, n, D: tl.constexpr, D_P2: tl.constexpr, SUPER: tl.constexpr):
    """Sum of partial rows (group g, chunk c) for g in [g0, g1), c in [c0, c0 + n): fixed order."""
    rows = tl.arange(0, SUPER)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    m = (rows < n) & (d < D)
    acc = tl.zeros([SUPER, D_P2], tl.float32)
    for g in range(g0, g1):
        acc += tl.load(wpart_ptr + (g * N_PROG_T + c0 + rows) * D + d, mask=m, other=0.0, cache_modifier=".cg")
    return tl.sum(acc, axis=0)


@triton.jit
def rope_qk_norm_bwd_finish_kernel(
    cs_ptr, wpart_ptr,
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    gwq_ptr, sgwq, gwk_ptr, sgwk,
    M, S, NQG, NKG, N_PROG_T, N_FIN_T,
    D: tl.constexpr, D_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    EXACT: tl.constexpr, GRAD_COS_SIN: tl.constexpr,
):
    """Programs [0, N_FIN_T): grad_cos/grad_sin of BLOCK_T tokens each. The last two
    programs: the query and the key norm-weight gradients. Fixed summation order."""
    DT: tl.constexpr = gcos_ptr.dtype.element_ty
    pid = tl.program_id(0)
    if pid < N_FIN_T:
        if GRAD_COS_SIN:
            _finish_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                            pid * BLOCK_T, M, S, NQG, NKG, D, D_P2, BLOCK_T, DT, EXACT, "")
    elif pid == N_FIN_T:
        _finish_norm_weight(wpart_ptr, 0, NQG, N_PROG_T, gwq_ptr, sgwq, D, D_P2, BLOCK_R, "")
    else:
        _finish_norm_weight(wpart_ptr, NQG, NQG + NKG, N_PROG_T, gwk_ptr, sgwk, D, D_P2, BLOCK_R, "")
