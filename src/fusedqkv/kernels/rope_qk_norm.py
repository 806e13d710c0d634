"""Triton kernels for RoPE + per-head RMSNorm ("QK-norm") of a GQA attention block.

Kernels (the forward lives in rope_qk_norm_fwd.py):

* ``rope_qk_norm_bwd_kernel`` -- grid (token blocks, 2). A program takes a block of
  BLOCK_T tokens and either every query and key head of it (axis 1 = 0) or the copy of
  its value heads (axis 1 = 1). It walks the heads HB at a time with [HB * BLOCK_T rows,
  head_dim/2] tiles (row = (head, token); the two halves of head_dim are separate tiles,
  which is how rotate-half RoPE is done), so few tokens still give full tiles. It writes
  dQKV token-major ``[tokens, (Hq + 2*Hkv) * D]`` -- the ``[Q | K | V]`` layout the two
  projection GEMMs read -- and, as it holds every head of its tokens, grad_cos/grad_sin
  complete (no partials, no cross-program finish), plus one fp32 partial row per program
  of each norm-weight gradient. Constexpr switches:

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
  - ``TMA``: the q/k gradient and activation tiles come through host TMA descriptors
    (token blocks then never straddle two sequences); otherwise per-thread loads.

  The block's variants (issue 25), in the training mode only (not EXACT, raw saved tensors,
  rstd recomputed); all off on the 091 path and the plain training path, whose code they leave
  as it was. ``HALF`` is the number of RoPE pairs per head (``rot/2``; ``D/2`` without partial
  rotary) and ``PASS = D - 2*HALF`` trailing dims pass RoPE unrotated (``PASS_P2`` their tile
  width); ``INTERLEAVED``: pairs ``(2i, 2i+1)`` (else NeoX ``(i, i + HALF)``); ``NORM_WEIGHT``:
  the norm scales by a weight (else unweighted: no weight gradients); ``Q_GATE``: each query
  head is ``[q | gate]`` in dQKV (the gate's gradient copied by the value program);
  ``V_NORM``: v is an unweighted per-head RMSNorm of the raw v (its backward in the value
  program). The query/key variants run in ``_head_set_bwd_variants`` (fp32, no TMA).

* ``rope_qk_norm_bwd_all_heads_kernel`` -- the norm over all heads of a token (OLMo 2/3's,
  ``norm_scope='all_heads'``; weights ``[H*D]``), with the same variant switches. Persistent
  programs take one token at a time and hold each head set of it in one ``[heads, pairs]``
  tile (the RMS needs all of them: read once); the norm-weight sums stay in registers over a
  program's tokens, one fp32 row per program, finished by ``rope_qk_norm_bwd_finish_cols_kernel``.

* The norm-weight finish sums the partial rows in a fixed order (deterministic; no
  atomics in any sum). With ``FUSED_FINISH`` the last programs to finish do it inside the
  main kernel, in two levels (self-resetting tickets decide who is last); otherwise
  ``rope_qk_norm_bwd_finish_kernel`` does it as a second launch queued after the GEMMs.

All tensors are addressed through explicit strides so non-contiguous views work.
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
    if x.dtype == ptr.dtype.element_ty:
        tl.store(ptr, x, mask=mask)
    elif _SOFT_BF16_ROUND and ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _bf16_rne(x).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stored_abs(x, ptr, mask):
    """|x| as ``_store_cast(ptr, x, mask)`` stores it (rounded to the destination dtype), in fp32;
    0 where masked: the value an amax of the stored tensor sees."""
    if x.dtype == ptr.dtype.element_ty:
        y = x
    elif _SOFT_BF16_ROUND and ptr.dtype.element_ty == tl.bfloat16:
        y = _bf16_rne(x)
    else:
        y = x.to(ptr.dtype.element_ty)
    return tl.where(mask, tl.abs(y.to(tl.float32)), 0.0)


@triton.jit
def _store_col_amax(acol_ptr, a, h0, H1, cols, cmask, HB: tl.constexpr, BLOCK_T: tl.constexpr, W: tl.constexpr,
                    HEAD_STRIDE: tl.constexpr):
    """A head step's column amaxes: ``a`` [HB * BLOCK_T rows, W] (|stored values|, row = (head,
    token)), the max over each head's tokens stored at ``acol_ptr + (h0 + head) * HEAD_STRIDE +
    cols`` (in the partials' dtype: the maxima of stored values are exact in it)."""
    if HB == 1:
        tl.store(acol_ptr + h0 * HEAD_STRIDE + cols, tl.max(a, 0).to(acol_ptr.dtype.element_ty), mask=cmask)
    else:
        hh = tl.arange(0, HB)
        m = tl.max(tl.reshape(a, [HB, BLOCK_T, W]), 1)
        tl.store(acol_ptr + (h0 + hh)[:, None] * HEAD_STRIDE + cols[None, :], m.to(acol_ptr.dtype.element_ty),
                 mask=(h0 + hh < H1)[:, None] & cmask[None, :])


@triton.jit
def _store_row_amax(arow_ptr, ra, tok0, t_end, HB: tl.constexpr, BLOCK_T: tl.constexpr):
    """A program's row amaxes ``ra`` [HB * BLOCK_T] (row = (head, token)): the max over each token's
    rows, stored at ``arow_ptr + token`` for its tokens ``tok0 .. t_end``."""
    if HB == 1:
        m = ra
    else:
        m = tl.max(tl.reshape(ra, [HB, BLOCK_T]), 0)
    t = tok0 + tl.arange(0, BLOCK_T)
    tl.store(arow_ptr + t, m.to(arow_ptr.dtype.element_ty), mask=t < t_end)


@triton.jit
def pair_cols(dh, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Columns within a head of the two elements of RoPE pairs ``dh``: NeoX rotate-half
    ``(i, i + HALF)``, or interleaved (GPT-J / Llama 4) ``(2i, 2i + 1)``."""
    if INTERLEAVED:
        return dh * 2, dh * 2 + 1
    else:
        return dh, dh + HALF


@triton.jit
def pair_layout(HALF: tl.constexpr, HALF_P2: tl.constexpr, PASS: tl.constexpr, PASS_P2: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """A head's columns as the variants' tiles see them: pair indices ``dh`` and their mask, the
    pairs' two columns ``i1``/``i2`` (``pair_cols``), the pass-through columns ``ip`` and their mask."""
    dh = tl.arange(0, HALF_P2)
    i1, i2 = pair_cols(dh, HALF, INTERLEAVED)
    dp = tl.arange(0, PASS_P2)
    return dh, dh < HALF, i1, i2, 2 * HALF + dp, dp < PASS


@triton.jit
def load_pairs(row, i1, i2, sd, mask, INTERLEAVED: tl.constexpr):
    """The two elements of the RoPE pairs at columns ``i1``/``i2`` (``[1, pairs]``; see
    ``pair_cols``) of the rows ``row`` (``[rows, 1]`` pointers; column stride ``sd``), masked by
    ``mask`` ``[rows, pairs]``, in their dtype. Interleaved pairs are adjacent: one contiguous
    ``[rows, pairs, 2]`` load, split (two stride-2 loads would not vectorise)."""
    if INTERLEAVED:
        col = i1[:, :, None] + tl.arange(0, 2)[None, None, :]
        return tl.split(tl.load(row[:, :, None] + col * sd, mask=mask[:, :, None], other=0.0))
    else:
        return tl.load(row + i1 * sd, mask=mask, other=0.0), tl.load(row + i2 * sd, mask=mask, other=0.0)


@triton.jit
def store_pairs(row, i1, i2, sd, y1, y2, mask, INTERLEAVED: tl.constexpr):
    """``load_pairs``' store: y1/y2 (fp32) rounded once to the destination's dtype."""
    if INTERLEAVED:
        col = i1[:, :, None] + tl.arange(0, 2)[None, None, :]
        _store_cast(row[:, :, None] + col * sd, tl.join(y1, y2), mask[:, :, None])
    else:
        _store_cast(row + i1 * sd, y1, mask)
        _store_cast(row + i2 * sd, y2, mask)


@triton.jit
def load_cos_sin_raw(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s, tmask, dh,
                     HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """cos/sin at the two elements of each RoPE pair of a block of tokens as [tokens, pairs]
    tiles in their dtype (NeoX: the two halves)."""
    cmask = tmask[:, None] & (dh[None, :] < HALF)
    cbase = cos_ptr + b[:, None] * scos_b + s[:, None] * scos_s
    sbase = sin_ptr + b[:, None] * ssin_b + s[:, None] * ssin_s
    if INTERLEAVED:
        i1, i2 = pair_cols(dh, HALF, INTERLEAVED)
        c1, c2 = load_pairs(cbase, i1[None, :], i2[None, :], scos_d, cmask, INTERLEAVED)
        s1, s2 = load_pairs(sbase, i1[None, :], i2[None, :], ssin_d, cmask, INTERLEAVED)
    else:
        c1 = tl.load(cbase + dh[None, :] * scos_d, mask=cmask, other=0.0)
        c2 = tl.load(cbase + (dh[None, :] + HALF) * scos_d, mask=cmask, other=0.0)
        s1 = tl.load(sbase + dh[None, :] * ssin_d, mask=cmask, other=0.0)
        s2 = tl.load(sbase + (dh[None, :] + HALF) * ssin_d, mask=cmask, other=0.0)
    return c1, c2, s1, s2


@triton.jit
def load_cos_sin_token(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s, dh,
                       HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``load_cos_sin`` of one token (``b``, ``s`` scalars): fp32 [1, pairs] rows, which broadcast
    over a tile of that token's heads."""
    one = tl.full([1], 0, tl.int64)
    return load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b + one, s + one,
                        one == 0, dh, HALF, INTERLEAVED)


@triton.jit
def load_cos_sin(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s, tmask, dh,
                 HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """cos/sin of the RoPE pairs of a block of tokens as fp32 [tokens, pairs] tiles."""
    c1, c2, s1, s2 = load_cos_sin_raw(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, b, s,
                                      tmask, dh, HALF, INTERLEAVED)
    return c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)


@triton.jit
def _to_lp(x, DT: tl.constexpr):
    """fp32 -> the 16-bit dtype DT, round to nearest even (also under the interpreter)."""
    if _SOFT_BF16_ROUND and DT == tl.bfloat16:
        return _bf16_rne(x).to(DT)
    else:
        return x.to(DT)


@triton.jit
def _lp_mul(a, b, HW: tl.constexpr):
    """a * b of two 16-bit float tensors in that dtype: one rounding, as an eager bf16/fp16
    multiply (the exact product of two 16-bit values fits in fp32, so rounding it to 16 bits
    once is what float math then a cast gives). ``HW`` (sm_90 and newer): two elements per
    instruction; else fp32 math and a cast, the same result."""
    if _SOFT_BF16_ROUND or not HW:
        return _rnd(a.to(tl.float32) * b.to(tl.float32), a.dtype, True).to(a.dtype)
    elif a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float16,
                                         is_pure=True, pack=2)


@triton.jit
def _lp_add(a, b, HW: tl.constexpr):
    """a + b of two 16-bit float tensors in that dtype, one rounding (as eager: a sum of two
    16-bit values either fits in fp32 or differs from the larger by less than half its
    16-bit ulp, so float math then a cast rounds the same). ``HW`` as for ``_lp_mul``."""
    if _SOFT_BF16_ROUND or not HW:
        return _rnd(a.to(tl.float32) + b.to(tl.float32), a.dtype, True).to(a.dtype)
    elif a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("add.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float16,
                                         is_pure=True, pack=2)


@triton.jit
def _lp_sub(a, b, HW: tl.constexpr):
    """a - b, as ``_lp_add``."""
    if _SOFT_BF16_ROUND or not HW:
        return _rnd(a.to(tl.float32) - b.to(tl.float32), a.dtype, True).to(a.dtype)
    elif a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("sub.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float16,
                                         is_pure=True, pack=2)


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
    if (D & (D - 1)) == 0:
        # (neg_r3 * x) / D == (neg_r3 / D) * x bit for bit when D is a power of two (both
        # are the rounded product scaled exactly): one multiply per element less
        c = neg_r3 / D
        dx1 = _rnd(gw1 * r + grad_rstd * (c * x1), DT, EXACT)
        dx2 = _rnd(gw2 * r + grad_rstd * (c * x2), DT, EXACT)
    else:
        dx1 = _rnd(gw1 * r + grad_rstd * ((neg_r3 * x1) / D), DT, EXACT)
        dx2 = _rnd(gw2 * r + grad_rstd * ((neg_r3 * x2) / D), DT, EXACT)
    # x * r: the caller accumulates the weight gradient g * (x * r) per element (one fma)
    # and sums over tokens once per program (a sum over the token axis crosses warps:
    # shared memory and a barrier, too costly once per head)
    return dx1, dx2, x1 * r, x2 * r


@triton.jit
def _rstd(x1, x2, eps, D: tl.constexpr):
    # as the forward computes it: 1 / sqrt(mean(x^2) + eps), per token
    ms = (tl.sum(x1 * x1, axis=1, keep_dims=True) + tl.sum(x2 * x2, axis=1, keep_dims=True)) / D
    return 1.0 / tl.sqrt(ms + eps)


@triton.jit
def _head_set_bwd(
    g_ptr, sg_b, sg_h, sg_s, sg_d,
    x_ptr, sx_b, sx_h, sx_s, sx_d,
    r_ptr, sr_b, sr_h, sr_s,
    w_ptr, sw,
    dqkv_ptr, s_dqkv_t, col0,
    H0, H1, b, s, tok, rmask, hb,
    c1, c2, s1, s2, eps, cs1, cs2, sn1, sn2,
    g_desc, x_desc, b0, s0, acol_ptr, ra,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
    DT: tl.constexpr, EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
    SAVED_ROTATED: tl.constexpr, GRAD_COS_SIN: tl.constexpr, BLOCK_T: tl.constexpr, HB: tl.constexpr,
    RECOMPUTE_RSTD: tl.constexpr, PF: tl.constexpr, TMA: tl.constexpr, LP2: tl.constexpr,
    ROW_AMAX: tl.constexpr, COL_AMAX: tl.constexpr,
):
    """Backward of heads [H0, H1) of one head set (query or key) for BLOCK_T tokens.

    Tiles are [HB * BLOCK_T rows, head_dim/2]; row = (head within the HB-head step hb, token).
    Adds the grad_cos/grad_sin contributions, summed over the head steps, to the per-row
    accumulators ``cs1, cs2, sn1, sn2`` ([HB * BLOCK_T, D/2] fp32: cos first half, cos second
    half, sin first, sin second; the caller sums the HB rows of each token) and returns
    them, with the norm-weight gradient contributions summed over heads and tokens
    ([D/2] x 2).

    TMA: g and x come through host TMA descriptors of their [B, H, S, D] tensors (box
    [1, 1, BLOCK_T, D/2]; HB == 1 and the block's tokens are s0 + i of batch b0): one thread
    issues each tile's copy, so the loop spends no instructions on addresses and masks and
    keeps PF - 1 head steps in flight through shared memory; rows past the sequence come
    back zero.

    ROW_AMAX: the max |dQKV| (as stored) of each row over these heads' columns joins ``ra`` ([HB *
    BLOCK_T] fp32, returned last); COL_AMAX: each of their columns' max over the block's tokens is
    stored at ``acol_ptr + col0 + column`` (the program's row of column partials)."""
    d = tl.arange(0, HALF_P2)[None, :]
    dmask = tl.arange(0, HALF_P2) < HALF
    w1 = tl.load(w_ptr + tl.arange(0, HALF_P2) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + (tl.arange(0, HALF_P2) + HALF) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    g_row = g_ptr + b[:, None] * sg_b + s[:, None] * sg_s + hb[:, None] * sg_h
    x_row = x_ptr + b[:, None] * sx_b + s[:, None] * sx_s + hb[:, None] * sx_h
    r_row = r_ptr + b * sr_b + s * sr_s + hb * sr_h
    out_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + col0 + hb[:, None] * D

    R: tl.constexpr = HB * BLOCK_T
    wg1 = tl.zeros([R, HALF_P2], tl.float32)
    wg2 = tl.zeros([R, HALF_P2], tl.float32)
    # 091's exact mode in 16-bit math: each eager op (multiply, add) is one packed 16-bit
    # instruction on two elements, instead of an fp32 op plus a round trip through 16 bits
    LP: tl.constexpr = EXACT and NORM_AFTER_ROPE and (DT == tl.bfloat16 or DT == tl.float16)
    cf1 = c1.to(tl.float32)
    cf2 = c2.to(tl.float32)
    sf1 = s1.to(tl.float32)
    sf2 = s2.to(tl.float32)
    # The stage is bound by memory latency: Triton's pipeliner keeps the tiles of the next
    # PF - 1 head steps in flight (cp.async into shared memory, so no registers) while one
    # is computed (benchmarks/NOTES.md, v7).
    for h0 in tl.range(H0, H1, HB, num_stages=PF):
        hmask = rmask & (h0 + hb < H1)
        mask = hmask[:, None] & (d < HALF)
        if TMA:
            g1r = tl.reshape(g_desc.load([b0, h0, s0, 0]), [BLOCK_T, HALF_P2])
            g2r = tl.reshape(g_desc.load([b0, h0, s0, HALF]), [BLOCK_T, HALF_P2])
            x1r = tl.reshape(x_desc.load([b0, h0, s0, 0]), [BLOCK_T, HALF_P2])
            x2r = tl.reshape(x_desc.load([b0, h0, s0, HALF]), [BLOCK_T, HALF_P2])
        else:
            g1r = tl.load(g_row + h0 * sg_h + d * sg_d, mask=mask, other=0.0)
            g2r = tl.load(g_row + h0 * sg_h + (d + HALF) * sg_d, mask=mask, other=0.0)
            x1r = tl.load(x_row + h0 * sx_h + d * sx_d, mask=mask, other=0.0)
            x2r = tl.load(x_row + h0 * sx_h + (d + HALF) * sx_d, mask=mask, other=0.0)
        r = tl.load(r_row + h0 * sr_h, mask=hmask, other=0.0).to(tl.float32)[:, None]
        g1 = g1r.to(tl.float32)
        g2 = g2r.to(tl.float32)
        x1 = x1r.to(tl.float32)
        x2 = x2r.to(tl.float32)
        if NORM_AFTER_ROPE:
            # the norm sees the rotated tensor; grad_cos/sin need the tensor RoPE was applied
            # to. 091's reference "recovers" it by rotating the saved rotated tensor once
            # more; for a saved raw tensor it is the forward rotation -- one formula.
            if LP:
                # x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)
                o1r = _lp_sub(_lp_mul(x1r, c1, LP2), _lp_mul(x2r, s1, LP2), LP2)
                o2r = _lp_add(_lp_mul(x2r, c2, LP2), _lp_mul(x1r, s2, LP2), LP2)
                o1 = o1r.to(tl.float32)
                o2 = o2r.to(tl.float32)
            else:
                o1, o2 = _rotate(x1, x2, cf1, cf2, sf1, sf2, DT, EXACT)
                o1r = o1
                o2r = o2
            if SAVED_ROTATED:
                n1 = x1
                n2 = x2
                p1 = o1
                p2 = o2
                p1r = o1r
                p2r = o2r
            else:
                n1 = o1
                n2 = o2
                p1 = x1
                p2 = x2
                p1r = x1r
                p2r = x2r
            if RECOMPUTE_RSTD:
                # rows past the tokens: 0, not 1/sqrt(eps) -- inf for eps = 0, and 0 * inf = nan in the
                # weight-gradient sums
                r = tl.where(hmask[:, None], _rstd(n1, n2, eps, D), 0.0)
            if LP:
                gn1, gn2, a1, a2 = _rms_norm_bwd(g1, g2, n1, n2, r, w1, w2, D, DT, False)
                q1r = _to_lp(gn1, DT)
                q2r = _to_lp(gn2, DT)
                # RoPE transpose as 091's reference: g*cos + cat(g2, -g1)*sin (see _rope_bwd)
                dx1 = _lp_add(_lp_mul(q1r, c1, LP2), _lp_mul(q2r, s1, LP2), LP2)
                dx2 = _lp_sub(_lp_mul(q2r, c2, LP2), _lp_mul(q1r, s2, LP2), LP2)
            else:
                gn1, gn2, a1, a2 = _rms_norm_bwd(g1, g2, n1, n2, r, w1, w2, D, DT, EXACT)
                dx1, dx2 = _rope_bwd(gn1, gn2, cf1, cf2, sf1, sf2, DT, EXACT)
            q1 = gn1
            q2 = gn2
            wn1 = g1
            wn2 = g2
        else:
            # RoPE after the norm: the rotated tensor is x * r * w
            gn1, gn2 = _rope_bwd(g1, g2, cf1, cf2, sf1, sf2, DT, EXACT)
            if RECOMPUTE_RSTD:
                r = tl.where(hmask[:, None], _rstd(x1, x2, eps, D), 0.0)  # (as above)
            dx1, dx2, a1, a2 = _rms_norm_bwd(gn1, gn2, x1, x2, r, w1, w2, D, DT, EXACT)
            p1 = a1 * w1  # x * r * w
            p2 = a2 * w2
            q1 = g1
            q2 = g2
            wn1 = gn1
            wn2 = gn2
        # fp32 sums of g * (x * r) whose order is free anyway: fused multiply-adds
        wg1 = tl.fma(wn1, a1, wg1)
        wg2 = tl.fma(wn2, a2, wg2)
        _store_cast(out_row + h0 * D + d, dx1, mask)
        _store_cast(out_row + h0 * D + d + HALF, dx2, mask)
        if ROW_AMAX or COL_AMAX:
            am1 = _stored_abs(dx1, out_row, mask)
            am2 = _stored_abs(dx2, out_row, mask)
            if ROW_AMAX:
                ra = tl.maximum(ra, tl.maximum(tl.max(am1, 1), tl.max(am2, 1)))
            if COL_AMAX:
                cols = tl.arange(0, HALF_P2)
                _store_col_amax(acol_ptr + col0, am1, h0, H1, cols, dmask, HB, BLOCK_T, HALF_P2, D)
                _store_col_amax(acol_ptr + col0 + HALF, am2, h0, H1, cols, dmask, HB, BLOCK_T, HALF_P2, D)
        if GRAD_COS_SIN:
            # d/dcos: g * p ; d/dsin: g * rotate_half(p), rotate_half(p) = cat(-p2, p1)
            if LP:
                cs1 += _lp_mul(q1r, p1r, LP2).to(tl.float32)
                cs2 += _lp_mul(q2r, p2r, LP2).to(tl.float32)
                sn1 -= _lp_mul(q1r, p2r, LP2).to(tl.float32)
                sn2 += _lp_mul(q2r, p1r, LP2).to(tl.float32)
            else:
                cs1 += _rnd(q1 * p1, DT, EXACT)
                cs2 += _rnd(q2 * p2, DT, EXACT)
                sn1 += _rnd(-(q1 * p2), DT, EXACT)
                sn2 += _rnd(q2 * p1, DT, EXACT)
    return cs1, cs2, sn1, sn2, tl.sum(wg1, axis=0), tl.sum(wg2, axis=0), ra


@triton.jit
def _load_norm_w(w_ptr, sw, off, i1, i2, ip, dmask, pm, PASS: tl.constexpr):
    """Norm-weight elements ``off`` + the pair columns (and pass-through columns) as fp32 [1, n] rows."""
    w1 = tl.load(w_ptr + (off + i1) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + (off + i2) * sw, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if PASS > 0:
        wp = tl.load(w_ptr + (off + ip) * sw, mask=pm, other=0.0).to(tl.float32)[None, :]
    else:
        wp = w1  # (never used)
    return w1, w2, wp


@triton.jit
def load_norm_w_rows(w_ptr, sw, off, rmask, i1, i2, ip, dmask, pm, PASS: tl.constexpr):
    """Norm-weight elements at each row's offset ``off`` ([rows]) + the pair columns (and
    pass-through columns) as fp32 [rows, n] tiles (ALL_HEADS: a row is a head, ``off = h * D``)."""
    base = w_ptr + off[:, None] * sw
    m = rmask[:, None] & dmask[None, :]
    w1 = tl.load(base + i1[None, :] * sw, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(base + i2[None, :] * sw, mask=m, other=0.0).to(tl.float32)
    if PASS > 0:
        wp = tl.load(base + ip[None, :] * sw, mask=rmask[:, None] & pm[None, :], other=0.0).to(tl.float32)
    else:
        wp = w1  # (never used)
    return w1, w2, wp


@triton.jit
def _variant_front(g_row, x_row, sg_d, sx_d, i1, i2, ip, mask, pmask, c1, c2, s1, s2,
                   NORM_AFTER_ROPE: tl.constexpr, PASS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One head step of the training variants: the norm's input n and the gradient at the norm's
    output gn (pairs and pass-through; fp32), with the raw x and g pairs."""
    g1, g2 = load_pairs(g_row, i1, i2, sg_d, mask, INTERLEAVED)
    x1, x2 = load_pairs(x_row, i1, i2, sx_d, mask, INTERLEAVED)
    g1 = g1.to(tl.float32)
    g2 = g2.to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if PASS > 0:
        gp = tl.load(g_row + ip * sg_d, mask=pmask, other=0.0).to(tl.float32)
        xp = tl.load(x_row + ip * sx_d, mask=pmask, other=0.0).to(tl.float32)
    else:
        gp = g1  # (never used)
        xp = x1
    if NORM_AFTER_ROPE:
        n1, n2 = _rotate(x1, x2, c1, c2, s1, s2, tl.float32, False)
        gn1 = g1
        gn2 = g2
    else:
        n1 = x1
        n2 = x2
        gn1, gn2 = _rope_bwd(g1, g2, c1, c2, s1, s2, tl.float32, False)
    return n1, n2, xp, gn1, gn2, gp, x1, x2, g1, g2


@triton.jit
def _row_sum(a1, a2, ap, PASS: tl.constexpr):
    t = tl.sum(a1, axis=1, keep_dims=True) + tl.sum(a2, axis=1, keep_dims=True)
    if PASS > 0:
        t += tl.sum(ap, axis=1, keep_dims=True)
    return t


@triton.jit
def _variant_back(n1, n2, np_, gw1, gw2, gwp, x1, x2, g1, g2, v1, v2, r, grad_rstd, c, c1, c2, s1, s2,
                  NORM_AFTER_ROPE: tl.constexpr, PASS: tl.constexpr):
    """The training variants' gradient at the norm's and RoPE's inputs from ``_variant_front``'s
    tiles, ``gw = gn * w``, the rstd ``r``, its gradient ``grad_rstd`` and ``c = -r^3 / N``: the
    dQKV pairs and pass-through, the normed n*r (pairs, pass-through), and the grad_cos/sin
    factors (q, p: grad_cos += q*p, grad_sin += q*rotate(p))."""
    # d/dn of n*r*w: g*w*r - r^3 * n * sum(g*w*n) / N
    dn1 = gw1 * r + grad_rstd * (c * n1)
    dn2 = gw2 * r + grad_rstd * (c * n2)
    a1 = n1 * r
    a2 = n2 * r
    if PASS > 0:
        ap = np_ * r
        dxp = gwp * r + grad_rstd * (c * np_)
    else:
        ap = a1  # (never used)
        dxp = a1
    if NORM_AFTER_ROPE:
        dx1, dx2 = _rope_bwd(dn1, dn2, c1, c2, s1, s2, tl.float32, False)
        q1 = dn1  # the gradient at RoPE's output, and RoPE's input
        q2 = dn2
        p1 = x1
        p2 = x2
    else:
        dx1 = dn1
        dx2 = dn2
        q1 = g1
        q2 = g2
        p1 = a1 * v1  # n * r * w
        p2 = a2 * v2
    return dx1, dx2, dxp, a1, a2, ap, q1, q2, p1, p2


@triton.jit
def _variant_store(ob, i1r, i2r, ipr, dx1, dx2, dxp, mask, pmask, gn1, gn2, gnp, a1, a2, ap, wg1, wg2, wgp,
                   PASS: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr):
    """``_variant_back``'s dQKV tiles stored at ``ob``; the norm-weight accumulators plus g*n*r."""
    store_pairs(ob, i1r, i2r, 1, dx1, dx2, mask, INTERLEAVED)
    if PASS > 0:
        _store_cast(ob + ipr, dxp, pmask)
    if NORM_WEIGHT:
        wg1 = tl.fma(gn1, a1, wg1)
        wg2 = tl.fma(gn2, a2, wg2)
        if PASS > 0:
            wgp = tl.fma(gnp, ap, wgp)
    return wg1, wg2, wgp


@triton.jit
def _head_set_bwd_variants(
    g_ptr, sg_b, sg_h, sg_s, sg_d,
    x_ptr, sx_b, sx_h, sx_s, sx_d,
    w_ptr, sw,
    dqkv_ptr, s_dqkv_t, col0, OHS,
    wrow_ptr,
    H0, H1, b, s, tok, rmask, hb,
    c1, c2, s1, s2, eps, cs1, cs2, sn1, sn2,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, BLOCK_T: tl.constexpr, HB: tl.constexpr, PF: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
):
    """``_head_set_bwd`` for the block's per-head variants, in the training mode only (fp32, one
    rounding; x the raw projection output; rstd recomputed; no TMA): partial rotary (PASS
    trailing dims unrotated), interleaved pairs, no norm weight, and a head stride ``OHS`` in
    dQKV (2D for gated queries). Writes this set's norm-weight gradient row to ``wrow_ptr``
    ([D], summed over heads and tokens) and returns the grad_cos/sin accumulators (see
    ``_head_set_bwd``)."""
    dh, dmask, i1, i2, ip, pm = pair_layout(HALF, HALF_P2, PASS, PASS_P2, INTERLEAVED)
    i1r = i1[None, :]
    i2r = i2[None, :]
    ipr = ip[None, :]
    g_row = g_ptr + b[:, None] * sg_b + s[:, None] * sg_s + hb[:, None] * sg_h
    x_row = x_ptr + b[:, None] * sx_b + s[:, None] * sx_s + hb[:, None] * sx_h
    out_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + col0 + hb[:, None] * OHS
    R: tl.constexpr = HB * BLOCK_T
    if NORM_WEIGHT:
        w1, w2, wp = _load_norm_w(w_ptr, sw, 0, i1, i2, ip, dmask, pm, PASS)
    else:
        w1 = 1.0
        w2 = 1.0
        wp = 1.0
    wg1 = tl.zeros([R, HALF_P2], tl.float32)
    wg2 = tl.zeros([R, HALF_P2], tl.float32)
    wgp = tl.zeros([R, PASS_P2], tl.float32)
    for h0 in tl.range(H0, H1, HB, num_stages=PF):
        hmask = rmask & (h0 + hb < H1)
        mask = hmask[:, None] & dmask[None, :]
        pmask = hmask[:, None] & pm[None, :]
        n1, n2, np_, gn1, gn2, gnp, x1, x2, g1, g2 = _variant_front(
            g_row + h0 * sg_h, x_row + h0 * sx_h, sg_d, sx_d, i1r, i2r, ipr, mask, pmask, c1, c2, s1, s2,
            NORM_AFTER_ROPE, PASS, INTERLEAVED)
        gw1 = gn1 * w1
        gw2 = gn2 * w2
        gwp = gnp * wp
        r = tl.where(hmask[:, None], 1.0 / tl.sqrt(_row_sum(n1 * n1, n2 * n2, np_ * np_, PASS) / D + eps), 0.0)
        grad_rstd = _row_sum(gw1 * n1, gw2 * n2, gwp * np_, PASS)
        dx1, dx2, dxp, a1, a2, ap, q1, q2, p1, p2 = _variant_back(
            n1, n2, np_, gw1, gw2, gwp, x1, x2, g1, g2, w1, w2, r, grad_rstd, -(r * r * r) / D, c1, c2, s1, s2,
            NORM_AFTER_ROPE, PASS)
        wg1, wg2, wgp = _variant_store(out_row + h0 * OHS, i1r, i2r, ipr, dx1, dx2, dxp, mask, pmask, gn1, gn2, gnp,
                                       a1, a2, ap, wg1, wg2, wgp, PASS, INTERLEAVED, NORM_WEIGHT)
        if GRAD_COS_SIN:
            cs1 += q1 * p1
            cs2 += q2 * p2
            sn1 += -(q1 * p2)
            sn2 += q2 * p1
    if NORM_WEIGHT:
        tl.store(wrow_ptr + i1, tl.sum(wg1, axis=0), mask=dmask)
        tl.store(wrow_ptr + i2, tl.sum(wg2, axis=0), mask=dmask)
        if PASS > 0:
            tl.store(wrow_ptr + ip, tl.sum(wgp, axis=0), mask=pm)
    return cs1, cs2, sn1, sn2


@triton.jit
def _all_heads_set_bwd(
    g_ptr, sg_b, sg_h, sg_s, sg_d,
    x_ptr, sx_b, sx_h, sx_s, sx_d,
    w_ptr, sw,
    dqkv_ptr, s_dqkv_t, col0, OHS,
    tok, b, s, H, eps, c1, c2, s1, s2, wg1, wg2, wgp,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, H_P2: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr, GRAD_COS_SIN: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
):
    """ALL_HEADS: one head set (query or key) of token ``tok``, every head in one [H_P2 rows,
    pairs] tile, the norm's RMS over all H*D channels (read once). Adds g*n*r to the norm-weight
    accumulators ``wg*`` (per head and column) and returns them with this set's grad_cos/sin
    sums ([1, pairs] each; zeros without GRAD_COS_SIN)."""
    h = tl.arange(0, H_P2)
    hmask = h < H
    dh, dmask, i1, i2, ip, pm = pair_layout(HALF, HALF_P2, PASS, PASS_P2, INTERLEAVED)
    i1r = i1[None, :]
    i2r = i2[None, :]
    ipr = ip[None, :]
    mask = hmask[:, None] & dmask[None, :]
    pmask = hmask[:, None] & pm[None, :]
    n1, n2, np_, gn1, gn2, gnp, x1, x2, g1, g2 = _variant_front(
        g_ptr + (b * sg_b + s * sg_s + h * sg_h)[:, None], x_ptr + (b * sx_b + s * sx_s + h * sx_h)[:, None],
        sg_d, sx_d, i1r, i2r, ipr, mask, pmask, c1, c2, s1, s2, NORM_AFTER_ROPE, PASS, INTERLEAVED)
    if NORM_WEIGHT:  # each row's head's part of the [H*D] weights
        v1, v2, vp = load_norm_w_rows(w_ptr, sw, h * D, hmask, i1, i2, ip, dmask, pm, PASS)
    else:
        v1 = 1.0
        v2 = 1.0
        vp = 1.0
    gw1 = gn1 * v1
    gw2 = gn2 * v2
    gwp = gnp * vp
    nd = H * D
    # the token's sums over every head: of n^2 (rstd) and of g*w*n (rstd's gradient)
    r = 1.0 / tl.sqrt(tl.sum(_row_sum(n1 * n1, n2 * n2, np_ * np_, PASS)) / nd + eps)
    grad_rstd = tl.sum(_row_sum(gw1 * n1, gw2 * n2, gwp * np_, PASS))
    dx1, dx2, dxp, a1, a2, ap, q1, q2, p1, p2 = _variant_back(
        n1, n2, np_, gw1, gw2, gwp, x1, x2, g1, g2, v1, v2, r, grad_rstd, -(r * r * r) / nd, c1, c2, s1, s2,
        NORM_AFTER_ROPE, PASS)
    wg1, wg2, wgp = _variant_store(dqkv_ptr + tok * s_dqkv_t + col0 + (h * OHS)[:, None], i1r, i2r, ipr, dx1, dx2,
                                   dxp, mask, pmask, gn1, gn2, gnp, a1, a2, ap, wg1, wg2, wgp, PASS, INTERLEAVED,
                                   NORM_WEIGHT)
    if GRAD_COS_SIN:
        cs1 = tl.sum(q1 * p1, axis=0, keep_dims=True)
        cs2 = tl.sum(q2 * p2, axis=0, keep_dims=True)
        sn1 = tl.sum(-(q1 * p2), axis=0, keep_dims=True)
        sn2 = tl.sum(q2 * p1, axis=0, keep_dims=True)
    else:
        cs1 = tl.zeros([1, HALF_P2], tl.float32)
        cs2 = cs1
        sn1 = cs1
        sn2 = cs1
    return wg1, wg2, wgp, cs1, cs2, sn1, sn2


@triton.jit
def _store_weight_rows(wrow_ptr, wg1, wg2, wgp, H, D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                       H_P2: tl.constexpr, PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr):
    """ALL_HEADS: a program's norm-weight sums [heads, columns] into its partial row (head h's
    columns at h*D)."""
    h = tl.arange(0, H_P2)[:, None]
    _, dmask, i1, i2, ip, pm = pair_layout(HALF, HALF_P2, PASS, PASS_P2, INTERLEAVED)
    m = (h < H) & dmask[None, :]
    tl.store(wrow_ptr + h * D + i1[None, :], wg1, mask=m)
    tl.store(wrow_ptr + h * D + i2[None, :], wg2, mask=m)
    if PASS > 0:
        tl.store(wrow_ptr + h * D + ip[None, :], wgp, mask=(h < H) & pm[None, :])


@triton.jit
def _value_out(gv_ptrs, xv_ptrs, o_ptrs, vmask, rows_valid, eps, D: tl.constexpr, V_NORM: tl.constexpr):
    """A tile of v's gradient into dQKV: a copy, or (V_NORM) the backward of v's unweighted
    per-head RMSNorm (rows: heads; ``xv_ptrs`` the raw v, read only then)."""
    v = tl.load(gv_ptrs, mask=vmask, other=0.0)
    if V_NORM:
        xv = tl.load(xv_ptrs, mask=vmask, other=0.0).to(tl.float32)
        gvf = v.to(tl.float32)
        rv = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1, keep_dims=True) / D + eps)
        rv = tl.where(rows_valid[:, None], rv, 0.0)
        grad_rv = tl.sum(gvf * xv, axis=1, keep_dims=True)
        y = gvf * rv + grad_rv * ((-(rv * rv * rv) / D) * xv)
        _store_cast(o_ptrs, y, vmask)
    else:
        y = v.to(o_ptrs.dtype.element_ty)
        tl.store(o_ptrs, y, mask=vmask)  # same dtype: a copy
    return y  # what was stored (before its rounding to dQKV's dtype)


@triton.jit
def _cos_sin_grad_pointers(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d, t, d, S,
                           HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """grad_cos/grad_sin addresses of both elements of RoPE pair ``d`` of token ``t``: (cos first,
    cos second, sin first, sin second)."""
    tb = (t // S).to(tl.int64)
    ts = t % S
    if INTERLEAVED:
        p_c1 = gcos_ptr + tb * sgcos_b + ts * sgcos_s + (2 * d) * sgcos_d
        p_c2 = p_c1 + sgcos_d
        p_s1 = gsin_ptr + tb * sgsin_b + ts * sgsin_s + (2 * d) * sgsin_d
        p_s2 = p_s1 + sgsin_d
    else:
        p_c1 = gcos_ptr + tb * sgcos_b + ts * sgcos_s + d * sgcos_d
        p_c2 = p_c1 + HALF * sgcos_d
        p_s1 = gsin_ptr + tb * sgsin_b + ts * sgsin_s + d * sgsin_d
        p_s2 = p_s1 + HALF * sgsin_d
    return p_c1, p_c2, p_s1, p_s2


@triton.jit
def _store_cos_sin(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                   c1, c2, s1, s2, tok0, t_end, S, ADD_STORED: tl.constexpr,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr, DT: tl.constexpr, EXACT: tl.constexpr,
                   HB: tl.constexpr, BLOCK_T: tl.constexpr, INTERLEAVED: tl.constexpr):
    """grad_cos/grad_sin of tokens [tok0, tok0 + BLOCK_T) from per-row sums: each summed over
    the rows of its token and rounded; with ADD_STORED, added to the (rounded) values this
    program stored there before and rounded again."""
    t = tok0 + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    m = (t < t_end) & (d < HALF)
    p_c1, p_c2, p_s1, p_s2 = _cos_sin_grad_pointers(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s,
                                                    sgsin_d, t, d, S, HALF, INTERLEAVED)
    v_c1 = _rnd(_token_sum(c1, HB, BLOCK_T, HALF_P2), DT, EXACT)
    v_c2 = _rnd(_token_sum(c2, HB, BLOCK_T, HALF_P2), DT, EXACT)
    v_s1 = _rnd(_token_sum(s1, HB, BLOCK_T, HALF_P2), DT, EXACT)
    v_s2 = _rnd(_token_sum(s2, HB, BLOCK_T, HALF_P2), DT, EXACT)
    if ADD_STORED:
        tl.debug_barrier()  # the earlier stores of every thread of the program are done
        v_c1 = _rnd(tl.load(p_c1, mask=m, other=0.0).to(tl.float32) + v_c1, DT, EXACT)
        v_c2 = _rnd(tl.load(p_c2, mask=m, other=0.0).to(tl.float32) + v_c2, DT, EXACT)
        v_s1 = _rnd(tl.load(p_s1, mask=m, other=0.0).to(tl.float32) + v_s1, DT, EXACT)
        v_s2 = _rnd(tl.load(p_s2, mask=m, other=0.0).to(tl.float32) + v_s2, DT, EXACT)
    _store_cast(p_c1, v_c1, m)
    _store_cast(p_c2, v_c2, m)
    _store_cast(p_s1, v_s1, m)
    _store_cast(p_s2, v_s2, m)


@triton.jit
def _token_sum(x, HB: tl.constexpr, BLOCK_T: tl.constexpr, HALF_P2: tl.constexpr):
    """[HB * BLOCK_T rows, D/2] -> [BLOCK_T, D/2]: the sum over the HB heads of each token."""
    if HB == 1:
        return x
    else:
        return tl.sum(tl.reshape(x, [HB, BLOCK_T, HALF_P2]), axis=0)


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
    # norm weights [D] (no NORM_WEIGHT: placeholders never read)
    wq_ptr, swq, wk_ptr, swk,
    # cos / sin [B, S, D] ([B, S, rot] with partial rotary)
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    # outputs: dQKV [M, (Hq + 2 Hkv) D]; grad_cos / grad_sin [B, S, D]
    dqkv_ptr, s_dqkv_t,
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    # norm-weight gradients [D], their fp32 partials [programs, 2, D] and super rows, tickets;
    # GROUPED: grad_cos/sin partials [groups, 2, M, D] and norm-weight rows [programs, groups, D]
    gwq_ptr, sgwq, gwk_ptr, sgwk, wpart_ptr, wsup_ptr, tick_ptr, cs_ptr, wgrp_ptr,
    M, S, HQ, HKV, eps,
    # TMA: host descriptors of grad/saved q and k (else placeholders never read)
    gq_desc, xq_desc, gk_desc, xk_desc,
    # Q_GATE: the gate's gradient [B, Hq, S, D]; V_NORM: the raw v [B, Hkv, S, D] with the strides
    # of k (both views of the projection output); else placeholders never read
    gg_ptr, sgg_b, sgg_h, sgg_s, sgg_d, xv_ptr,
    # ROW_AMAX / COL_AMAX: dQKV's amax partials, in its dtype: rows [kinds, M], columns [programs, dQKV's
    # columns] (else None)
    arow_ptr, acol_ptr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, HB: tl.constexpr,
    EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, SAVED_ROTATED: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, FUSED_FINISH: tl.constexpr, SUPER: tl.constexpr,
    RECOMPUTE_RSTD: tl.constexpr, PF: tl.constexpr,
    GROUPED: tl.constexpr, NQG: tl.constexpr, NKG: tl.constexpr, GSIZE: tl.constexpr, TMA: tl.constexpr,
    LP2: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    Q_GATE: tl.constexpr, V_NORM: tl.constexpr, ROW_AMAX: tl.constexpr, COL_AMAX: tl.constexpr,
):
    """Grid (token blocks, kinds). Program (pid, kind) takes a block of BLOCK_T tokens, and either every query
    and key head of it (grad_cos/grad_sin complete in the program: no partials), or -- GROUPED,
    for few tokens, where that leaves too few programs -- one group of GSIZE query or key heads
    (fp32 partials; the last group of the block to finish sums them), or the copy of its value
    heads. (One block per program: a loop over several blocks, carrying the norm-weight sums,
    took the 8-token kernel from ~150 to ~210 registers, sm_90 offline.) Axis 1 (``kind``): the query
    and key heads (0) or the value copy (1); GROUPED: a query head group (< NQG), a key head group
    (< NQG + NKG), or the value copy (the last).

    The block's variants (training mode only; see the module docstring) run the query and key
    heads through ``_head_set_bwd_variants``; V_NORM and Q_GATE change the value program.

    ROW_AMAX / COL_AMAX (the FP8 casts' amaxes of dQKV, so that no pass reads dQKV for them): program
    (pid, kind) stores the max |dQKV| (the stored values) of each of its tokens' rows over the columns
    it writes to ``arow[kind, token]``, and of each column it writes over its tokens to
    ``acol[pid, column]``; every element of dQKV is in exactly one of each (plain query/key path only)."""
    pid = tl.program_id(0)
    kind = tl.program_id(1)
    n_prog = tl.num_programs(0)
    DT: tl.constexpr = gq_ptr.dtype.element_ty
    R: tl.constexpr = HB * BLOCK_T
    NG: tl.constexpr = NQG + NKG
    # the variants of the query/key heads (all off: _head_set_bwd, the 091 and plain training paths)
    VARIANT: tl.constexpr = ((PASS > 0) or INTERLEAVED) or ((not NORM_WEIGHT) or Q_GATE)
    # dQKV columns between two query heads ([q | gate] per head with Q_GATE)
    QOHS: tl.constexpr = 2 * D if Q_GATE else D
    rows = tl.arange(0, R)
    hb = rows // BLOCK_T
    tl.static_assert(not ((ROW_AMAX or COL_AMAX) and VARIANT), "dQKV's amax partials: plain query/key path only")
    ra = tl.zeros([R], tl.float32)  # ROW_AMAX: each row's max |dQKV| so far
    if COL_AMAX:
        acol_row = acol_ptr + pid.to(tl.int64) * (HQ * QOHS + 2 * HKV * D)
    else:
        acol_row = acol_ptr
    if TMA:
        # blocks never straddle two sequences (a TMA box is one batch's rows): block pid is
        # tokens s0 .. s0 + BLOCK_T of sequence b0, those past S masked (and zero-filled)
        n_sb = tl.cdiv(S, BLOCK_T)
        b0 = pid // n_sb
        s0 = (pid % n_sb) * BLOCK_T
        tok0 = b0 * S + s0
        t_end = b0 * S + S
    else:
        b0 = 0
        s0 = 0
        tok0 = pid * BLOCK_T
        t_end = M
    tok = tok0 + rows % BLOCK_T
    rmask = tok < t_end
    b = (tok // S).to(tl.int64)
    s = tok % S
    dh = tl.arange(0, HALF_P2)
    hm = dh < HALF
    if GROUPED:
        n_qk = NG
    else:
        n_qk = 1
    if kind < n_qk:
        c1, c2, s1, s2 = load_cos_sin_raw(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                          b, s, rmask, dh, HALF, INTERLEAVED)
        z = tl.zeros([R, HALF_P2], tl.float32)
        if GROUPED:
            if kind < NQG:
                h0 = kind * GSIZE
                if VARIANT:
                    c_1, c_2, s_1, s_2 = _head_set_bwd_variants(
                        gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d, wq_ptr, swq,
                        dqkv_ptr, s_dqkv_t, 0, QOHS, wgrp_ptr + (pid * NG + kind) * D, h0, tl.minimum(h0 + GSIZE, HQ), b, s, tok, rmask, hb,
                        c1, c2, s1, s2, eps, z, z, z, z,
                        D, HALF, HALF_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, BLOCK_T, HB, PF,
                        PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT,
                    )
                else:
                    c_1, c_2, s_1, s_2, a1, a2, ra = _head_set_bwd(
                        gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
                        rq_ptr, srq_b, srq_h, srq_s, wq_ptr, swq, dqkv_ptr, s_dqkv_t, 0,
                        h0, tl.minimum(h0 + GSIZE, HQ), b, s, tok, rmask, hb, c1, c2, s1, s2, eps, z, z, z, z,
                        gq_desc, xq_desc, b0, s0, acol_row, ra,
                        D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T, HB,
                        RECOMPUTE_RSTD, PF, TMA, LP2, ROW_AMAX, COL_AMAX,
                    )
            else:
                h0 = (kind - NQG) * GSIZE
                if VARIANT:
                    c_1, c_2, s_1, s_2 = _head_set_bwd_variants(
                        gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, wk_ptr, swk,
                        dqkv_ptr, s_dqkv_t, HQ * QOHS, D, wgrp_ptr + (pid * NG + kind) * D, h0,
                        tl.minimum(h0 + GSIZE, HKV), b, s, tok, rmask, hb, c1, c2, s1, s2, eps, z, z, z, z,
                        D, HALF, HALF_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, BLOCK_T, HB, PF,
                        PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT,
                    )
                else:
                    c_1, c_2, s_1, s_2, a1, a2, ra = _head_set_bwd(
                        gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
                        rk_ptr, srk_b, srk_h, srk_s, wk_ptr, swk, dqkv_ptr, s_dqkv_t, HQ * D,
                        h0, tl.minimum(h0 + GSIZE, HKV), b, s, tok, rmask, hb, c1, c2, s1, s2, eps, z, z, z, z,
                        gk_desc, xk_desc, b0, s0, acol_row, ra,
                        D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T, HB,
                        RECOMPUTE_RSTD, PF, TMA, LP2, ROW_AMAX, COL_AMAX,
                    )
            if ROW_AMAX:
                _store_row_amax(arow_ptr + kind.to(tl.int64) * M, ra, tok0, t_end, HB, BLOCK_T)
            # partials: this group's head sums of grad_cos/sin per token [groups, 2, M, D] and its
            # norm-weight row [blocks, groups, D], fp32 (the variants store theirs)
            if GRAD_COS_SIN:
                _store_cs_partials(cs_ptr, kind, M, tok0, t_end, c_1, c_2, s_1, s_2, D, HALF, HALF_P2, HB, BLOCK_T)
            if not VARIANT:
                grow = wgrp_ptr + (pid * NG + kind) * D
                tl.store(grow + dh, a1, mask=hm)
                tl.store(grow + HALF + dh, a2, mask=hm)
            # the last group of this block to finish (a ticket, not a sum: the results are
            # summed in a fixed order) turns the block's partials into grad_cos/sin and its
            # query and key norm-weight rows. Acquire/release atomics order the partial stores;
            # .cg loads read them from L2.
            tl.debug_barrier()
            t0 = tl.atomic_add(tick_ptr + pid, 1)
            if t0 == NG - 1:
                tl.store(tick_ptr + pid, 0)
                if GRAD_COS_SIN:
                    _finish_block_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s,
                                          sgsin_d, tok0, t_end, M, S, D, HALF, HALF_P2, DT, EXACT, NQG, NKG, BLOCK_T,
                                          INTERLEAVED)
                if NORM_WEIGHT:
                    _finish_block_norm_weight(wgrp_ptr, wpart_ptr, pid, D, D_P2, NQG, NKG)
                if FUSED_FINISH:
                    _finish_norm_weight_levels(pid, n_prog, wpart_ptr, wsup_ptr, tick_ptr + n_prog,
                                               gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, SUPER)
        elif VARIANT:
            # norm-weight partials [programs, 2 (query, key), D] fp32
            wrow_q = wpart_ptr + pid * 2 * D
            wrow_k = wrow_q + D
            c_1, c_2, s_1, s_2 = _head_set_bwd_variants(
                gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d, wq_ptr, swq,
                dqkv_ptr, s_dqkv_t, 0, QOHS, wrow_q, 0, HQ, b, s, tok, rmask, hb, c1, c2, s1, s2, eps, z, z, z, z,
                D, HALF, HALF_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, BLOCK_T, HB, PF,
                PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT,
            )
            c_1, c_2, s_1, s_2 = _head_set_bwd_variants(
                gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, wk_ptr, swk,
                dqkv_ptr, s_dqkv_t, HQ * QOHS, D, wrow_k, 0, HKV, b, s, tok, rmask, hb, c1, c2, s1, s2, eps,
                c_1, c_2, s_1, s_2,
                D, HALF, HALF_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, BLOCK_T, HB, PF,
                PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT,
            )
            if GRAD_COS_SIN:
                _store_cos_sin(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                               c_1, c_2, s_1, s_2, tok0, t_end, S, False,
                               HALF, HALF_P2, DT, False, HB, BLOCK_T, INTERLEAVED)
            if FUSED_FINISH:
                _finish_norm_weight_levels(pid, n_prog, wpart_ptr, wsup_ptr, tick_ptr,
                                           gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, SUPER)
        else:
            c_1, c_2, s_1, s_2, a1, a2, ra = _head_set_bwd(
                gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
                rq_ptr, srq_b, srq_h, srq_s, wq_ptr, swq, dqkv_ptr, s_dqkv_t, 0,
                0, HQ, b, s, tok, rmask, hb, c1, c2, s1, s2, eps, z, z, z, z,
                gq_desc, xq_desc, b0, s0, acol_row, ra,
                D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T, HB,
                RECOMPUTE_RSTD, PF, TMA, LP2, ROW_AMAX, COL_AMAX,
            )
            # norm-weight partials [programs, 2 (query, key), D] fp32
            wrow = wpart_ptr + pid * 2 * D
            tl.store(wrow + dh, a1, mask=hm)
            tl.store(wrow + HALF + dh, a2, mask=hm)
            if GRAD_COS_SIN and EXACT:
                # the reference rounds the query sums and the key sums separately, then adds:
                # the rounded query sums (exact in the output dtype) wait in grad_cos/sin while
                # the key heads run (in registers they took ~80 more, sm_90 offline)
                _store_cos_sin(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                               c_1, c_2, s_1, s_2, tok0, t_end, S, False,
                               HALF, HALF_P2, DT, EXACT, HB, BLOCK_T, INTERLEAVED)
                c_1 = z
                c_2 = z
                s_1 = z
                s_2 = z
            # otherwise (fp32, one rounding) the key contributions add to the query sums
            c_1, c_2, s_1, s_2, a1, a2, ra = _head_set_bwd(
                gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
                rk_ptr, srk_b, srk_h, srk_s, wk_ptr, swk, dqkv_ptr, s_dqkv_t, HQ * D,
                0, HKV, b, s, tok, rmask, hb, c1, c2, s1, s2, eps, c_1, c_2, s_1, s_2,
                gk_desc, xk_desc, b0, s0, acol_row, ra,
                D, HALF, HALF_P2, DT, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, BLOCK_T, HB,
                RECOMPUTE_RSTD, PF, TMA, LP2, ROW_AMAX, COL_AMAX,
            )
            tl.store(wrow + D + dh, a1, mask=hm)
            tl.store(wrow + D + HALF + dh, a2, mask=hm)
            if ROW_AMAX:
                _store_row_amax(arow_ptr, ra, tok0, t_end, HB, BLOCK_T)
            if GRAD_COS_SIN:
                _store_cos_sin(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                               c_1, c_2, s_1, s_2, tok0, t_end, S, EXACT,
                               HALF, HALF_P2, DT, EXACT, HB, BLOCK_T, INTERLEAVED)
            if FUSED_FINISH:
                _finish_norm_weight_levels(pid, n_prog, wpart_ptr, wsup_ptr, tick_ptr,
                                           gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, SUPER)
    else:
        # V needs no math (V_NORM: the backward of its unweighted RMSNorm): its heads into the last
        # third of dQKV; with Q_GATE, the gate's gradient into the gate columns too
        dv = tl.arange(0, D_P2)[None, :]
        v_row = gv_ptr + b[:, None] * sgv_b + s[:, None] * sgv_s + hb[:, None] * sgv_h + dv * sgv_d
        if Q_GATE:
            o_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + (2 * HQ + HKV) * D + hb[:, None] * D + dv
        else:
            o_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + (HQ + HKV) * D + hb[:, None] * D + dv
        # (a name of its own: the query/key branch's h0 is i32, this loop variable takes HKV's
        # type -- i64 once an argument is beyond 32 bits -- and scf.if joins same-named variables)
        for hv in range(0, HKV, HB):
            vmask = (rmask & (hv + hb < HKV))[:, None] & (dv < D)
            vy = _value_out(v_row + hv * sgv_h, xv_ptr + b[:, None] * sxk_b + s[:, None] * sxk_s
                            + (hv + hb[:, None]) * sxk_h + dv * sxk_d, o_row + hv * D, vmask, rmask & (hv + hb < HKV),
                            eps, D, V_NORM)
            if ROW_AMAX or COL_AMAX:
                av = _stored_abs(vy, o_row, vmask)
                if ROW_AMAX:
                    ra = tl.maximum(ra, tl.max(av, 1))
                if COL_AMAX:
                    vc = tl.arange(0, D_P2)
                    _store_col_amax(acol_row + (HQ + HKV) * D, av, hv, HKV, vc, vc < D, HB, BLOCK_T, D_P2, D)
        if ROW_AMAX:
            _store_row_amax(arow_ptr + kind.to(tl.int64) * M, ra, tok0, t_end, HB, BLOCK_T)
        if Q_GATE:
            g_row = gg_ptr + b[:, None] * sgg_b + s[:, None] * sgg_s + hb[:, None] * sgg_h + dv * sgg_d
            og_row = dqkv_ptr + tok[:, None].to(tl.int64) * s_dqkv_t + D + hb[:, None] * (2 * D) + dv
            for hg in range(0, HQ, HB):
                gmask = (rmask & (hg + hb < HQ))[:, None] & (dv < D)
                gg = tl.load(g_row + hg * sgg_h, mask=gmask, other=0.0)
                tl.store(og_row + hg * (2 * D), gg.to(dqkv_ptr.dtype.element_ty), mask=gmask)


@triton.jit
def rope_qk_norm_bwd_all_heads_kernel(
    # grads of the block outputs [B, H, S, D]
    gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d,
    gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
    gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d,
    # the raw projection outputs [B, H, S, D]
    xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
    xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
    # norm weights [H*D] (no NORM_WEIGHT: placeholders never read)
    wq_ptr, swq, wk_ptr, swk,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    # outputs: dQKV [M, (Hq + 2 Hkv) D] ((2 Hq + 2 Hkv) D with Q_GATE); grad_cos / grad_sin [B, S, rot]
    dqkv_ptr, s_dqkv_t,
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    # the norm-weight partials [programs, (Hq + Hkv) * D] fp32
    wpart_ptr,
    M, S, HQ, HKV, eps,
    # Q_GATE: the gate's gradient [B, Hq, S, D]; V_NORM: the raw v with the strides of k
    gg_ptr, sgg_b, sgg_h, sgg_s, sgg_d, xv_ptr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, PF: tl.constexpr,
    NORM_AFTER_ROPE: tl.constexpr, GRAD_COS_SIN: tl.constexpr,
    PASS: tl.constexpr, PASS_P2: tl.constexpr, INTERLEAVED: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    Q_GATE: tl.constexpr, V_NORM: tl.constexpr,
):
    """The backward stage of ``norm_scope='all_heads'`` (the training mode: fp32, one rounding,
    rstd recomputed). Persistent programs each take tokens pid, pid + programs, ...; per token
    every query head in one tile, then every key head (a norm over all heads needs the whole
    set: read once), then the value heads (and the gate's gradient). grad_cos/sin are complete
    per token; the norm-weight gradients are summed per program in registers over its tokens
    into one fp32 row, summed over programs by ``rope_qk_norm_bwd_finish_cols_kernel``."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    DT: tl.constexpr = gq_ptr.dtype.element_ty
    QOHS: tl.constexpr = 2 * D if Q_GATE else D
    dh = tl.arange(0, HALF_P2)
    aq1 = tl.zeros([HQ_P2, HALF_P2], tl.float32)
    aq2 = tl.zeros([HQ_P2, HALF_P2], tl.float32)
    aqp = tl.zeros([HQ_P2, PASS_P2], tl.float32)
    ak1 = tl.zeros([HKV_P2, HALF_P2], tl.float32)
    ak2 = tl.zeros([HKV_P2, HALF_P2], tl.float32)
    akp = tl.zeros([HKV_P2, PASS_P2], tl.float32)
    # the value tiles: every value head of the token [HKV_P2, D_P2] (gate: [HQ_P2, D_P2])
    dv = tl.arange(0, D_P2)[None, :]
    hv = tl.arange(0, HKV_P2)
    vmask = (hv < HKV)[:, None] & (dv < D)
    hg = tl.arange(0, HQ_P2)
    gmask = (hg < HQ)[:, None] & (dv < D)
    for t in tl.range(pid, M, n_prog, num_stages=PF):
        tok = tl.cast(t, tl.int64)  # (tl.cast: the interpreter's loop variable is a Python int)
        b = tok // S
        s = tok % S
        c1, c2, s1, s2 = load_cos_sin_token(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                                            b, s, dh, HALF, INTERLEAVED)
        aq1, aq2, aqp, cq1, cq2, sq1, sq2 = _all_heads_set_bwd(
            gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d, wq_ptr, swq,
            dqkv_ptr, s_dqkv_t, 0, QOHS, tok, b, s, HQ, eps, c1, c2, s1, s2, aq1, aq2, aqp,
            D, HALF, HALF_P2, HQ_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
        ak1, ak2, akp, ck1, ck2, sk1, sk2 = _all_heads_set_bwd(
            gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d, xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, wk_ptr, swk,
            dqkv_ptr, s_dqkv_t, HQ * QOHS, D, tok, b, s, HKV, eps, c1, c2, s1, s2, ak1, ak2, akp,
            D, HALF, HALF_P2, HKV_P2, NORM_AFTER_ROPE, GRAD_COS_SIN, PASS, PASS_P2, INTERLEAVED, NORM_WEIGHT)
        if GRAD_COS_SIN:
            _store_cos_sin(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                           cq1 + ck1, cq2 + ck2, sq1 + sk1, sq2 + sk2, tok, tok + 1, S, False,
                           HALF, HALF_P2, DT, False, 1, 1, INTERLEAVED)
        o_tok = dqkv_ptr + tok * s_dqkv_t
        _value_out(gv_ptr + b * sgv_b + s * sgv_s + hv[:, None] * sgv_h + dv * sgv_d,
                   xv_ptr + b * sxk_b + s * sxk_s + hv[:, None] * sxk_h + dv * sxk_d,
                   o_tok + (HQ * QOHS + HKV * D) + hv[:, None] * D + dv, vmask, hv < HKV, eps, D, V_NORM)
        if Q_GATE:
            gg = tl.load(gg_ptr + b * sgg_b + s * sgg_s + hg[:, None] * sgg_h + dv * sgg_d, mask=gmask, other=0.0)
            tl.store(o_tok + D + hg[:, None] * (2 * D) + dv, gg.to(dqkv_ptr.dtype.element_ty), mask=gmask)
    if NORM_WEIGHT:
        wrow = wpart_ptr + pid.to(tl.int64) * ((HQ + HKV) * D)
        _store_weight_rows(wrow, aq1, aq2, aqp, HQ, D, HALF, HALF_P2, HQ_P2, PASS, PASS_P2, INTERLEAVED)
        _store_weight_rows(wrow + HQ * D, ak1, ak2, akp, HKV, D, HALF, HALF_P2, HKV_P2, PASS, PASS_P2, INTERLEAVED)


@triton.jit
def _finish_norm_weight_levels(pid, n_prog, wpart_ptr, wsup_ptr, tick_ptr, gwq_ptr, sgwq, gwk_ptr, sgwk,
                               D: tl.constexpr, D_P2: tl.constexpr, SUPER: tl.constexpr):
    """After program ``pid`` wrote its [2, D] row of norm-weight partials: two levels, so no
    program sums more than SUPER rows at once. The last program of each run of SUPER programs
    to finish sums their rows into a super row; the last super row to be written, all super
    rows. Tickets reset themselves for the next call."""
    tl.debug_barrier()
    n_sup = tl.cdiv(n_prog, SUPER)
    sup = pid // SUPER
    c0 = sup * SUPER
    n_in = tl.minimum(SUPER, n_prog - c0)
    t1 = tl.atomic_add(tick_ptr + sup, 1)
    if t1 == n_in - 1:
        tl.store(tick_ptr + sup, 0)
        _sum_rows(wpart_ptr, c0, n_in, wsup_ptr + sup * 2 * D, D, D_P2, SUPER)
        tl.debug_barrier()
        t2 = tl.atomic_add(tick_ptr + n_sup, 1)
        if t2 == n_sup - 1:
            tl.store(tick_ptr + n_sup, 0)
            _finish_norm_weight(wsup_ptr, n_sup, gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, SUPER, ".cg")


@triton.jit
def _store_cs_partials(cs_ptr, group, M, tok0, t_end, c1, c2, s1, s2, D: tl.constexpr, HALF: tl.constexpr,
                       HALF_P2: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr):
    """One head group's grad_cos/sin sums of a token block (its tokens below t_end) into
    partials [groups, 2, M, D]."""
    t = tok0 + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    m = (t < t_end) & (d < HALF)
    pc = cs_ptr + ((group * 2) * M + t).to(tl.int64) * D + d
    # tl.cast, not M.to(): an int argument equal to 1 is a compile-time constant (a Python int)
    ps = pc + tl.cast(M, tl.int64) * D
    tl.store(pc, _token_sum(c1, HB, BLOCK_T, HALF_P2), mask=m)
    tl.store(pc + HALF, _token_sum(c2, HB, BLOCK_T, HALF_P2), mask=m)
    tl.store(ps, _token_sum(s1, HB, BLOCK_T, HALF_P2), mask=m)
    tl.store(ps + HALF, _token_sum(s2, HB, BLOCK_T, HALF_P2), mask=m)


@triton.jit
def _finish_block_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                          tok0, t_end, M, S, D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                          DT: tl.constexpr, EXACT: tl.constexpr, NQG: tl.constexpr, NKG: tl.constexpr,
                          BLOCK_T: tl.constexpr, INTERLEAVED: tl.constexpr):
    """grad_cos/grad_sin of a token block from the head groups' partials: the query groups and
    the key groups summed (fixed order) and rounded separately, then added, as the reference
    does. The group loops are unrolled, so every load is in flight at once (one load per group
    in a loop waited an L2 round trip each: 40 in a row at 091's 128 tokens, v7)."""
    t = tok0 + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    m = (t < t_end) & (d < HALF)
    base = cs_ptr + t.to(tl.int64) * D + d
    gstride = tl.cast(2 * M, tl.int64) * D  # (tl.cast: M may be the constant 1, see _store_cs_partials)
    sstride = tl.cast(M, tl.int64) * D
    qc1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    qc2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    qs1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    qs2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    for g in tl.static_range(NQG):
        qc1 += tl.load(base + g * gstride, mask=m, other=0.0, cache_modifier=".cg")
        qc2 += tl.load(base + g * gstride + HALF, mask=m, other=0.0, cache_modifier=".cg")
        qs1 += tl.load(base + g * gstride + sstride, mask=m, other=0.0, cache_modifier=".cg")
        qs2 += tl.load(base + g * gstride + sstride + HALF, mask=m, other=0.0, cache_modifier=".cg")
    kc1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    kc2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    ks1 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    ks2 = tl.zeros([BLOCK_T, HALF_P2], tl.float32)
    for g in tl.static_range(NQG, NQG + NKG):
        kc1 += tl.load(base + g * gstride, mask=m, other=0.0, cache_modifier=".cg")
        kc2 += tl.load(base + g * gstride + HALF, mask=m, other=0.0, cache_modifier=".cg")
        ks1 += tl.load(base + g * gstride + sstride, mask=m, other=0.0, cache_modifier=".cg")
        ks2 += tl.load(base + g * gstride + sstride + HALF, mask=m, other=0.0, cache_modifier=".cg")
    pc, pc2, ps, ps2 = _cos_sin_grad_pointers(gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                                              t, d, S, HALF, INTERLEAVED)
    _store_cast(pc, _rnd(_rnd(qc1, DT, EXACT) + _rnd(kc1, DT, EXACT), DT, EXACT), m)
    _store_cast(pc2, _rnd(_rnd(qc2, DT, EXACT) + _rnd(kc2, DT, EXACT), DT, EXACT), m)
    _store_cast(ps, _rnd(_rnd(qs1, DT, EXACT) + _rnd(ks1, DT, EXACT), DT, EXACT), m)
    _store_cast(ps2, _rnd(_rnd(qs2, DT, EXACT) + _rnd(ks2, DT, EXACT), DT, EXACT), m)


@triton.jit
def _finish_block_norm_weight(wgrp_ptr, wpart_ptr, pid, D: tl.constexpr, D_P2: tl.constexpr, NQG: tl.constexpr,
                              NKG: tl.constexpr):
    """A token block's group rows [groups, D] of norm-weight partials summed into its query and
    key rows [2, D] (fixed order, unrolled)."""
    dd = tl.arange(0, D_P2)
    m = dd < D
    row = wgrp_ptr + (pid * (NQG + NKG)) * D + dd
    q = tl.zeros([D_P2], tl.float32)
    for g in tl.static_range(NQG):
        q += tl.load(row + g * D, mask=m, other=0.0, cache_modifier=".cg")
    k = tl.zeros([D_P2], tl.float32)
    for g in tl.static_range(NQG, NQG + NKG):
        k += tl.load(row + g * D, mask=m, other=0.0, cache_modifier=".cg")
    tl.store(wpart_ptr + (pid * 2) * D + dd, q, mask=m)
    tl.store(wpart_ptr + (pid * 2 + 1) * D + dd, k, mask=m)


@triton.jit
def _sum_rows(wpart_ptr, c0, n, out_ptr, D: tl.constexpr, D_P2: tl.constexpr, SUPER: tl.constexpr):
    """Rows [c0, c0 + n) (n <= SUPER) of the [rows, 2, D] partials summed into out [2, D]:
    one tile load per head set, fixed order."""
    rows = tl.arange(0, SUPER)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    m = (rows < n) & (d < D)
    q = tl.load(wpart_ptr + ((c0 + rows) * 2) * D + d, mask=m, other=0.0, cache_modifier=".cg")
    k = tl.load(wpart_ptr + ((c0 + rows) * 2 + 1) * D + d, mask=m, other=0.0, cache_modifier=".cg")
    dd = tl.arange(0, D_P2)
    tl.store(out_ptr + dd, tl.sum(q, axis=0), mask=dd < D)
    tl.store(out_ptr + D + dd, tl.sum(k, axis=0), mask=dd < D)


@triton.jit
def _finish_norm_weight(wpart_ptr, n_rows, gwq_ptr, sgwq, gwk_ptr, sgwk,
                        D: tl.constexpr, D_P2: tl.constexpr, BLOCK_R: tl.constexpr, CACHE: tl.constexpr):
    """The two norm-weight gradients from the rows of [rows, 2, D] partials, in a fixed order."""
    d = tl.arange(0, D_P2)[None, :]
    q = tl.zeros([BLOCK_R, D_P2], tl.float32)
    k = tl.zeros([BLOCK_R, D_P2], tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)[:, None]
        m = (rows < n_rows) & (d < D)
        q += tl.load(wpart_ptr + (rows * 2) * D + d, mask=m, other=0.0, cache_modifier=CACHE)
        k += tl.load(wpart_ptr + (rows * 2 + 1) * D + d, mask=m, other=0.0, cache_modifier=CACHE)
    dd = tl.arange(0, D_P2)
    _store_cast(gwq_ptr + dd * sgwq, tl.sum(q, axis=0), dd < D)
    _store_cast(gwk_ptr + dd * sgwk, tl.sum(k, axis=0), dd < D)


@triton.jit
def rope_qk_norm_bwd_finish_kernel(wpart_ptr, n_rows, gwq_ptr, sgwq, gwk_ptr, sgwk,
                                   D: tl.constexpr, D_P2: tl.constexpr, BLOCK_R: tl.constexpr):
    """The norm-weight gradients as a second launch (when the finish is not fused)."""
    _finish_norm_weight(wpart_ptr, n_rows, gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, BLOCK_R, "")


@triton.jit
def rope_qk_norm_bwd_finish_cols_kernel(wpart_ptr, n_rows, NQ, NK, gwq_ptr, sgwq, gwk_ptr, sgwk,
                                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """ALL_HEADS: the norm-weight gradients ([Hq*D] and [Hkv*D]) from the stage's fp32 rows
    ``[n_rows, NQ + NK]`` (query columns first); grid over blocks of BLOCK_C columns, each
    summing its columns over the rows in a fixed order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_cols = NQ + NK
    cm = cols < n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)[:, None]
        m = (rows < n_rows) & cm[None, :]
        acc += tl.load(wpart_ptr + rows.to(tl.int64) * n_cols + cols[None, :], mask=m, other=0.0)
    tot = tl.sum(acc, axis=0)
    _store_cast(gwq_ptr + cols * sgwq, tot, cols < NQ)
    _store_cast(gwk_ptr + (cols - NQ) * sgwk, tot, (cols >= NQ) & cm)
