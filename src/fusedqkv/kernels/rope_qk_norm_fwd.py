"""Triton kernel of the forward of RoPE + RMSNorm ("QK-norm").

``rope_qk_norm_fwd_kernel`` reads the projection output ``qkv`` token-major
``[tokens, (Hq + 2*Hkv) * D]`` (last dim contiguous), applies RoPE and RMSNorm in
either order, writes q/k as ``[batch, heads, seq, head_dim]`` (any strides) and rstd
in fp32 ``[batch, heads, seq]`` (any strides).  All math is fp32; the outputs are
rounded once.

Grid: ``(token blocks, head groups)``.  Head groups are ``GROUP`` consecutive query
heads (the first ``cdiv(Hq, GROUP)`` groups) or key heads (the rest).  A program loads
cos/sin for its ``BLOCK_T`` tokens once, then loops over the heads of its group with
2D tiles ``[BLOCK_T, rotary pairs]`` -- the first and the second element of each RoPE
pair -- so the register footprint does not grow with the head count (a 3D ``[heads,
tokens, head_dim/2]`` tile spills on sm_90 with 32 heads).

Constexpr switches of the block's variants (all off: the plain per-head block above):

- ``HALF``: rotary pairs per head (``rot/2``; ``head_dim/2`` without partial rotary);
  ``PASS = D - 2*HALF`` trailing dims of each head pass RoPE unrotated (partial rotary),
  a third tile ``[BLOCK_T, PASS_P2]``; the norm covers all D.
- ``INTERLEAVED``: RoPE pairs ``(2i, 2i+1)`` (GPT-J / Llama 4) instead of NeoX's
  ``(i, i + HALF)``; cos/sin are per element either way.
- ``NORM_WEIGHT``: the norm scales by its weight (else an unweighted RMSNorm).
- ``ALL_HEADS``: the RMS is over all heads of a token (``Hq*D`` channels of q, ``Hkv*D`` of k;
  weights ``[H*D]``): one program per (token, q or k) holds every head of its token in one
  ``[H_P2, pairs]`` tile (``HQ_P2``/``HKV_P2``: the head counts padded; BLOCK_T is 1), so q/k
  are read once; rstd is stored for every head.
- ``Q_GATE``: the Q rows of the projection are per head ``[q | gate]`` (2D columns); the
  gate is not touched here (the caller views it in ``qkv``).
- ``V_NORM``: v is RMS-normed per head without a weight into ``v`` (groups after the key
  groups); otherwise v stays a view of ``qkv``.
- ``K_EQ_V``: ``qkv`` has no value columns; v is the raw k (its norm reads the key columns).
"""

import triton
import triton.language as tl

from .rope_qk_norm import (_load_norm_w, _store_cast, load_cos_sin, load_cos_sin_token, load_norm_w_rows, load_pairs,
                           pair_cols, pair_layout, store_pairs)


@triton.jit
def _rope_fwd_2d(x1, x2, c1, c2, s1, s2):
    # x*cos + rotate(x)*sin on the two elements of each pair: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2; fp32
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _head_in(xb, i1, i2, ip, mask, pmask, c1, c2, s1, s2, NORM_AFTER_ROPE: tl.constexpr, PASS: tl.constexpr,
             INTERLEAVED: tl.constexpr):
    """One head's pair tiles (and pass-through tile) as the norm sees them, fp32, and their sum of
    squares per token."""
    x1, x2 = load_pairs(xb, i1, i2, 1, mask, INTERLEAVED)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM_AFTER_ROPE:
        x1, x2 = _rope_fwd_2d(x1, x2, c1, c2, s1, s2)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if PASS > 0:
        xp = tl.load(xb + ip, mask=pmask, other=0.0).to(tl.float32)
        ss += tl.sum(xp * xp, axis=1)
    else:
        xp = x1  # (no pass-through dims: never used)
    return x1, x2, xp, ss


@triton.jit
def _head_out(ob, so_d, i1, i2, ip, x1, x2, xp, r, w1, w2, wp, mask, pmask, c1, c2, s1, s2,
              NORM_AFTER_ROPE: tl.constexpr, PASS: tl.constexpr, NORM_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x * r (* w), rotated when RoPE comes after the norm, stored (one rounding)."""
    if NORM_WEIGHT:
        y1 = x1 * r[:, None] * w1
        y2 = x2 * r[:, None] * w2
    else:
        y1 = x1 * r[:, None]
        y2 = x2 * r[:, None]
    if not NORM_AFTER_ROPE:
        y1, y2 = _rope_fwd_2d(y1, y2, c1, c2, s1, s2)
    store_pairs(ob, i1, i2, so_d, y1, y2, mask, INTERLEAVED)
    if PASS > 0:
        if NORM_WEIGHT:
            yp = xp * r[:, None] * wp
        else:
            yp = xp * r[:, None]
        _store_cast(ob + ip * so_d, yp, pmask)


@triton.jit
def _head_group_fwd(
    x_ptr, s_x_t, col0, XHS,
    w_ptr, sw,
    o_ptr, so_b, so_h, so_s, so_d,
    r_ptr, sr_b, sr_h, sr_s,
    tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
    h0, H,
    D: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
):
    """Heads [h0, h0 + GROUP) of one head set, each normed on its own. ``XHS``: the columns
    between two heads of the set in a ``qkv`` row."""
    dmask = dh < HALF
    i1, i2 = pair_cols(dh, HALF, INTERLEAVED)
    dp = tl.arange(0, PASS_P2)
    ip = 2 * HALF + dp
    pm = dp < PASS
    pmask_t = tmask[:, None] & pm[None, :]
    if NORM_WEIGHT:
        w1, w2, wp = _load_norm_w(w_ptr, sw, 0, i1, i2, ip, dmask, pm, PASS)
    else:
        w1 = 1.0
        w2 = 1.0
        wp = 1.0
    x_row = x_ptr + tok64[:, None] * s_x_t + col0
    ob_row = o_ptr + b[:, None] * so_b + s[:, None] * so_s
    for hh in range(0, GROUP):
        h = h0 + hh
        # a per-token block, not a scalar compare broadcast into the mask: Triton 3.9's interpreter
        # types a scalar compare by its operands (int32), and a splat of it is no valid mask
        hvalid = tl.broadcast_to(h, tmask.shape) < H
        mask = cmask & hvalid[:, None]
        pmask = pmask_t & hvalid[:, None]
        x1, x2, xp, ss = _head_in(x_row + h * XHS, i1[None, :], i2[None, :], ip[None, :], mask, pmask,
                                  c1, c2, s1, s2, NORM_AFTER_ROPE, PASS, INTERLEAVED)
        r = 1.0 / tl.sqrt_rn(ss / D + eps)
        _head_out(ob_row + h * so_h, so_d, i1[None, :], i2[None, :], ip[None, :], x1, x2, xp, r, w1, w2, wp,
                  mask, pmask, c1, c2, s1, s2, NORM_AFTER_ROPE, PASS, NORM_WEIGHT, INTERLEAVED)
        tl.store(r_ptr + b * sr_b + h * sr_h + s * sr_s, r, mask=tmask & hvalid)


@triton.jit
def _all_heads_fwd(
    x_ptr, s_x_t, col0, XHS,
    w_ptr, sw,
    o_ptr, so_b, so_h, so_s, so_d,
    r_ptr, sr_b, sr_h, sr_s,
    cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
    tok, S, H, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, H_P2: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr, PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
):
    """ALL_HEADS: every head of token ``tok`` of one head set in one [H_P2 rows, pairs] tile,
    normed by one RMS over all H*D channels: read once, written once."""
    h = tl.arange(0, H_P2)
    hmask = h < H
    tok = tl.cast(tok, tl.int64)
    b = tok // S
    s = tok % S
    dh, dmask, i1, i2, ip, pm = pair_layout(HALF, HALF_P2, PASS, PASS_P2, INTERLEAVED)
    mask = hmask[:, None] & dmask[None, :]
    pmask = hmask[:, None] & pm[None, :]
    c1, c2, s1, s2 = load_cos_sin_token(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s, dh,
                                        HALF, INTERLEAVED)
    x1, x2, xp, ss = _head_in(x_ptr + (tok * s_x_t + col0 + h * XHS)[:, None], i1[None, :], i2[None, :],
                              ip[None, :], mask, pmask, c1, c2, s1, s2, NORM_AFTER_ROPE, PASS, INTERLEAVED)
    r = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=0) / (H * D) + eps)
    if NORM_WEIGHT:  # each row's head's part of the [H*D] weights
        w1, w2, wp = load_norm_w_rows(w_ptr, sw, h * D, hmask, i1, i2, ip, dmask, pm, PASS)
    else:
        w1 = 1.0
        w2 = 1.0
        wp = 1.0
    rr = tl.full([H_P2], 0.0, tl.float32) + r
    _head_out(o_ptr + (b * so_b + s * so_s + h * so_h)[:, None], so_d, i1[None, :], i2[None, :], ip[None, :],
              x1, x2, xp, rr, w1, w2, wp, mask, pmask, c1, c2, s1, s2, NORM_AFTER_ROPE, PASS, NORM_WEIGHT,
              INTERLEAVED)
    tl.store(r_ptr + b * sr_b + h * sr_h + s * sr_s, rr, mask=hmask)


@triton.jit
def _v_group_fwd(x_ptr, s_x_t, col0, o_ptr, so_b, so_h, so_s, so_d, tok64, b, s, tmask, eps, h0, H,
                 D: tl.constexpr, D_P2: tl.constexpr, GROUP: tl.constexpr):
    """V_NORM: heads [h0, h0 + GROUP) of v RMS-normed without a weight (whole-head tiles)."""
    dv = tl.arange(0, D_P2)
    vmask = tmask[:, None] & (dv < D)[None, :]
    x_row = x_ptr + tok64[:, None] * s_x_t + col0 + dv[None, :]
    o_row = o_ptr + b[:, None] * so_b + s[:, None] * so_s + dv[None, :] * so_d
    for hh in range(0, GROUP):
        h = h0 + hh
        hvalid = tl.broadcast_to(h, tmask.shape) < H
        m = vmask & hvalid[:, None]
        x = tl.load(x_row + h * D, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        _store_cast(o_row + h * so_h, x * r[:, None], m)


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
    # V_NORM: the normed v [B, Hkv, S, D] (else a placeholder never written)
    v_ptr, sv_b, sv_h, sv_s, sv_d,
    eps, M, S, HQ, HKV, NQG,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, GROUP: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    ALL_HEADS: tl.constexpr, Q_GATE: tl.constexpr, V_NORM: tl.constexpr, D_P2: tl.constexpr,
    HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, K_EQ_V: tl.constexpr,
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
    # columns of a query head in a qkv row: [q | gate] with Q_GATE
    QHS: tl.constexpr = 2 * D if Q_GATE else D
    # cos/sin loaded inside each branch, after the value check: hoisted above the branches, the plain
    # path compiled to other code and ran 0.4-1.3% slower (NOTES, session 12)
    if pid_g < NQG:
        if ALL_HEADS:  # (NQG = 1: the query program, then the key program, then the value groups)
            _all_heads_fwd(qkv_ptr, s_qkv_t, 0, QHS, wq_ptr, swq, q_ptr, sq_b, sq_h, sq_s, sq_d,
                           rq_ptr, srq_b, srq_h, srq_s, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s,
                           ssin_d, pid_t, S, HQ, eps, D, HALF, HALF_P2, HQ_P2,
                           NORM_AFTER_ROPE, PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
        else:
            c1, c2, s1, s2 = load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                          b, s, tmask, dh, HALF, INTERLEAVED)
            _head_group_fwd(qkv_ptr, s_qkv_t, 0, QHS, wq_ptr, swq,
                            q_ptr, sq_b, sq_h, sq_s, sq_d, rq_ptr, srq_b, srq_h, srq_s,
                            tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
                            pid_g * GROUP, HQ, D, HALF, GROUP, NORM_AFTER_ROPE,
                            PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
    else:
        if ALL_HEADS:
            nkg = 1
        else:
            nkg = tl.cdiv(HKV, GROUP)
        kg = pid_g - NQG
        is_v = False
        if V_NORM:
            is_v = kg >= nkg
        if is_v:
            _v_group_fwd(qkv_ptr, s_qkv_t, HQ * QHS + (0 if K_EQ_V else HKV * D), v_ptr, sv_b, sv_h, sv_s, sv_d,
                         tok64, b, s, tmask, eps, (kg - nkg) * GROUP, HKV, D, D_P2, GROUP)
        elif ALL_HEADS:
            _all_heads_fwd(qkv_ptr, s_qkv_t, HQ * QHS, D, wk_ptr, swk, k_ptr, sk_b, sk_h, sk_s, sk_d,
                           rk_ptr, srk_b, srk_h, srk_s, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s,
                           ssin_d, pid_t, S, HKV, eps, D, HALF, HALF_P2, HKV_P2,
                           NORM_AFTER_ROPE, PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
        else:
            c1, c2, s1, s2 = load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                          b, s, tmask, dh, HALF, INTERLEAVED)
            _head_group_fwd(qkv_ptr, s_qkv_t, HQ * QHS, D, wk_ptr, swk,
                            k_ptr, sk_b, sk_h, sk_s, sk_d, rk_ptr, srk_b, srk_h, srk_s,
                            tok64, b, s, tmask, dh, cmask, c1, c2, s1, s2, eps,
                            kg * GROUP, HKV, D, HALF, GROUP, NORM_AFTER_ROPE,
                            PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
