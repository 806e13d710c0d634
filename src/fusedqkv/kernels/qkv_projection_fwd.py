"""Triton kernel of the training block's forward in one launch: the QKV projection GEMM with
RoPE + RMSNorm of q and k in its epilogue (issue 24).

``qkv_rope_norm_gemm_kernel`` computes ``qkv = x W^T (+ b)`` ``[tokens, N]`` one head per
output tile, in up to three accumulators: the first and the second element of the NeoX RoPE
pairs (``[BM, HALF]`` each; W's rows of the two halves of the rotary dims) and the unrotated
tail (``[BM, PASS]``, partial rotary). RoPE then needs no data movement between threads: the
pair partners sit at the same place of two accumulators (a rotation of one ``[BM, D]`` tile
moved it through shared memory and spilled registers: NOTES "Session 11"). For a query or key
head's tile the epilogue norms and rotates in registers; nothing is read back. It writes
``qkv`` (the backward recomputes from it), q/k ``[B, H, S, D]`` (unit last stride: the
training path's token-major views) and rstd ``[B, H, S]`` fp32.

Persistent programs stride over the tiles in groups of ``GROUP_M`` tile rows (the programs
running at once share W's column tiles and x's row tiles in L2); the tile and K loops are one
flattened software pipeline, so the next tile's loads are in flight during a tile's epilogue.
The epilogue has no branch on the tile's kind (query head, its gate, key head, value head):
the kind selects pointers and masks per row (Triton 3.6's loop flattening fails on an ``if`` in
the loop's body).

Semantics are the forward stage's (``rope_qk_norm_fwd.py``): the norm and RoPE see the
projection output rounded to its dtype, fp32 math in the stage's order, one rounding of q/k;
cos/sin per element. Switches: ``NORM_AFTER_ROPE``, ``NORM_WEIGHT`` (else unweighted),
``Q_GATE`` (query heads are ``[q | gate]`` pairs of tiles; the gate is stored raw), ``V_NORM``
(value heads RMS-normed without a weight into ``v``), ``HAS_BIAS``. Not here (the plan keeps
cuBLAS and the stage): interleaved RoPE, a tail that is no power of two, a norm over all heads.
"""

import triton
import triton.language as tl

from .projection_grads import _mma
from .rope_qk_norm import _store_cast, _to_lp


@triton.jit
def _tile_of(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of the ``tile``-th tile: groups of ``GROUP_M`` tile rows, rows
    fastest within a group."""
    per_group = GROUP_M * n_n
    first = (tile // per_group) * GROUP_M
    rows = tl.minimum(n_m - first, GROUP_M)
    within = tile % per_group
    return first + within % rows, within // rows


@triton.jit
def _cs(ptr, sb, ss_, sd, b, s, j, mask, other):
    return tl.load(ptr + b[:, None] * sb + s[:, None] * ss_ + j[None, :] * sd, mask=mask, other=other)


@triton.jit
def _w(wq_ptr, swq, wk_ptr, swk, j, is_q, is_k, NORM_WEIGHT: tl.constexpr):
    """The norm weight of columns ``j`` per row: q's, k's, or 1 (value heads)."""
    if NORM_WEIGHT:
        wq = tl.load(wq_ptr + j * swq).to(tl.float32)[None, :]
        wk = tl.load(wk_ptr + j * swk).to(tl.float32)[None, :]
        return tl.where(is_q[:, None], wq, tl.where(is_k[:, None], wk, 1.0))
    else:
        return 1.0


@triton.jit
def _epilogue(x1, x2, x3, on, r0, HQ, HKV,
              q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s,
              wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
              cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, S,
              BM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, QT: tl.constexpr,
              NORM_AFTER_ROPE: tl.constexpr, NORM_WEIGHT: tl.constexpr, V_NORM: tl.constexpr):
    """Column tile ``on`` (one head) of tokens [r0, r0 + BM) from its pair tiles ``x1``/``x2``
    and tail ``x3`` (rounded to the output dtype): a query or key head RMS-normed and rotated
    (fp32, one rounding) into q/k with its rstd; with ``V_NORM`` a value head normed into v;
    other tiles (gates, raw v) nothing."""
    # the tile's kind per row (Triton 3.9's interpreter types a scalar compare by its operands,
    # and a splat of it is no valid mask)
    rows = r0 + tl.arange(0, BM)
    kh = tl.broadcast_to(on - HQ * QT, rows.shape)
    is_q = (kh < 0) & (tl.broadcast_to(on % QT, rows.shape) == 0)
    is_k = (kh >= 0) & (kh < HKV)
    is_v = (kh >= HKV) & V_NORM
    h = tl.where(is_q, on // QT, tl.where(is_k, kh, kh - HKV))
    tmask = rows < M
    tok = rows.to(tl.int64)
    b = tok // S
    s = tok % S
    j = tl.arange(0, HALF)
    rope = is_q | is_k
    cm = (tmask & rope)[:, None]
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if NORM_AFTER_ROPE:
        c1 = _cs(cos_ptr, scos_b, scos_s, scos_d, b, s, j, cm, 1.0).to(tl.float32)
        s1 = _cs(sin_ptr, ssin_b, ssin_s, ssin_d, b, s, j, cm, 0.0).to(tl.float32)
        c2 = _cs(cos_ptr, scos_b, scos_s, scos_d, b, s, j + HALF, cm, 1.0).to(tl.float32)
        s2 = _cs(sin_ptr, ssin_b, ssin_s, ssin_d, b, s, j + HALF, cm, 0.0).to(tl.float32)
        f1, f2 = f1 * c1 - f2 * s1, f2 * c2 + f1 * s2
    ss = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
    if PASS > 0:
        jp = 2 * HALF + tl.arange(0, PASS)
        f3 = x3.to(tl.float32)
        ss += tl.sum(f3 * f3, axis=1)
    r = 1.0 / tl.sqrt_rn(ss / D + eps)
    y1 = f1 * r[:, None] * _w(wq_ptr, swq, wk_ptr, swk, j, is_q, is_k, NORM_WEIGHT)
    y2 = f2 * r[:, None] * _w(wq_ptr, swq, wk_ptr, swk, j + HALF, is_q, is_k, NORM_WEIGHT)
    if not NORM_AFTER_ROPE:
        c1 = _cs(cos_ptr, scos_b, scos_s, scos_d, b, s, j, cm, 1.0).to(tl.float32)
        s1 = _cs(sin_ptr, ssin_b, ssin_s, ssin_d, b, s, j, cm, 0.0).to(tl.float32)
        c2 = _cs(cos_ptr, scos_b, scos_s, scos_d, b, s, j + HALF, cm, 1.0).to(tl.float32)
        s2 = _cs(sin_ptr, ssin_b, ssin_s, ssin_d, b, s, j + HALF, cm, 0.0).to(tl.float32)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
    qo = q_ptr + b * sq_b + h * sq_h + s * sq_s
    ko = k_ptr + b * sk_b + h * sk_h + s * sk_s
    if V_NORM:
        ko = tl.where(is_v, v_ptr + b * sv_b + h * sv_h + s * sv_s, ko)
    out = tl.where(is_q, qo, ko)[:, None]
    om = (tmask & (rope | is_v))[:, None]
    _store_cast(out + j[None, :], y1, om)
    _store_cast(out + (j + HALF)[None, :], y2, om)
    if PASS > 0:
        y3 = f3 * r[:, None] * _w(wq_ptr, swq, wk_ptr, swk, jp, is_q, is_k, NORM_WEIGHT)
        _store_cast(out + jp[None, :], y3, om)
    rstd = tl.where(is_q, rq_ptr + b * srq_b + h * srq_h + s * srq_s, rk_ptr + b * srk_b + h * srk_h + s * srk_s)
    tl.store(rstd, r, mask=tmask & rope)


@triton.jit
def qkv_rope_norm_gemm_kernel(
    x_desc, w_desc, w3_desc, qkv_desc, qkv3_desc,
    q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s,
    bias_ptr,
    wq_ptr, swq, wk_ptr, swk,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    eps, M, N, K, S, HQ, HKV,
    BM: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    GROUP_M: tl.constexpr, NPROG: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    Q_GATE: tl.constexpr, V_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
):
    """``x_desc`` x [tokens, K] in blocks [BM, BK]; ``w_desc`` W [N, K] in blocks [HALF, BK],
    ``w3_desc`` in blocks [PASS, BK]; ``qkv_desc``/``qkv3_desc`` [tokens, N] in blocks [BM, HALF] /
    [BM, PASS] (the ``*3`` descriptors only read with ``PASS``); q/k (v: only with ``V_NORM``)
    ``[B, H, S, D]`` with unit last stride. ``EPILOGUE`` off: the GEMM alone (benchmarks)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = N // D
    n_tiles = n_m * n_n
    k_steps = tl.cdiv(K, BK)
    tile_out = pid - NPROG
    QT: tl.constexpr = 2 if Q_GATE else 1  # column tiles per query head
    PW: tl.constexpr = PASS if PASS > 0 else 16  # (the tail's tile width; unused without a tail)
    for tile in tl.range(pid, n_tiles, NPROG, flatten=True):
        tm, tn = _tile_of(tile, n_m, n_n, GROUP_M)
        acc1 = tl.zeros((BM, HALF), tl.float32)
        acc2 = tl.zeros((BM, HALF), tl.float32)
        acc3 = tl.zeros((BM, PW), tl.float32)
        for kk in range(k_steps):
            a = x_desc.load([tm * BM, kk * BK])
            acc1 = _mma(a, tl.trans(w_desc.load([tn * D, kk * BK])), acc1)
            acc2 = _mma(a, tl.trans(w_desc.load([tn * D + HALF, kk * BK])), acc2)
            if PASS > 0:
                acc3 = _mma(a, tl.trans(w3_desc.load([tn * D + 2 * HALF, kk * BK])), acc3)
        # the epilogue's tile recomputed from a counter of its own (not carried through the
        # pipelined loads)
        tile_out += NPROG
        om, on = _tile_of(tile_out, n_m, n_n, GROUP_M)
        r0 = om * BM
        c0 = on * D
        if HAS_BIAS:
            acc1 += tl.load(bias_ptr + c0 + tl.arange(0, HALF)).to(tl.float32)[None, :]
            acc2 += tl.load(bias_ptr + c0 + HALF + tl.arange(0, HALF)).to(tl.float32)[None, :]
            if PASS > 0:
                acc3 += tl.load(bias_ptr + c0 + 2 * HALF + tl.arange(0, PW)).to(tl.float32)[None, :]
        x1 = _to_lp(acc1, qkv_desc.dtype)
        x2 = _to_lp(acc2, qkv_desc.dtype)
        qkv_desc.store([r0, c0], x1)
        qkv_desc.store([r0, c0 + HALF], x2)
        x3 = x1
        if PASS > 0:
            x3 = _to_lp(acc3, qkv3_desc.dtype)
            qkv3_desc.store([r0, c0 + 2 * HALF], x3)
        if EPILOGUE:
            _epilogue(x1, x2, x3, on, r0, HQ, HKV, q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s,
                      v_ptr, sv_b, sv_h, sv_s, wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s,
                      rk_ptr, srk_b, srk_h, srk_s, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                      eps, M, S, BM, D, HALF, PASS, QT, NORM_AFTER_ROPE, NORM_WEIGHT, V_NORM)
