"""Triton kernel of the training block's forward in one launch: the QKV projection GEMM with
RoPE + RMSNorm of q and k in its epilogue (issue 24).

``qkv_rope_norm_gemm_kernel`` computes ``qkv = x W^T (+ b)`` ``[tokens, N]`` in output tiles
``[BM, D]`` -- one head each, so a head's norm and every RoPE pair sit in one tile -- and, for a
query or key head's tile, the normed and rotated head from the accumulator in registers:
nothing is read back. It writes ``qkv`` (the backward recomputes from it), q/k token-major
(``[tokens, H*D]`` through 2-D TMA descriptors: the ``[B, H, S, D]`` views with strides
``(S*H*D, D, H*D, 1)`` are that), and rstd ``[B, H, S]`` fp32.

Persistent programs stride over the tiles in groups of ``GROUP_M`` tile rows (the programs
running at once share W's column tiles and x's row tiles in L2); the tile and K loops are one
flattened software pipeline, so the next tile's loads are in flight during a tile's epilogue.

Semantics are the forward stage's (``rope_qk_norm_fwd.py``): the norm and RoPE see the
projection output rounded to its dtype, fp32 math, one rounding of q/k; RoPE is
``y = x cos + rotate(x) sin`` with cos/sin per element over the leading ``ROT`` columns of a
head (1 and 0 past them: partial rotary), ``rotate`` NeoX rotate-half within the ``ROT``
columns or interleaved pairs ``(2i, 2i+1)``. Switches: ``NORM_AFTER_ROPE``, ``NORM_WEIGHT``
(else unweighted), ``INTERLEAVED``, ``Q_GATE`` (query heads are ``[q | gate]`` column pairs of
tiles; the gate's tile is stored raw), ``V_NORM`` (value heads RMS-normed without a weight into
``v``), ``HAS_BIAS``. A norm over all heads of a token needs every head tile of a row: not
here (the plan keeps cuBLAS and the stage for it).
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
def _rotate(x, BM: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr):
    """rotate(x) of RoPE on a [BM, D] fp32 tile: in every ROT-column chunk, NeoX (a | b) ->
    (-b | a), or interleaved pairs (a, b) -> (-b, a). Chunks past the first are multiplied by a
    zero sin (partial rotary)."""
    if INTERLEAVED:
        a, b = tl.split(tl.reshape(x, (BM, D // 2, 2)))
        return tl.reshape(tl.join(-b, a), (BM, D))
    else:
        t = tl.permute(tl.reshape(x, (BM, D // ROT, 2, ROT // 2)), (0, 1, 3, 2))
        a, b = tl.split(t)
        return tl.reshape(tl.permute(tl.join(-b, a), (0, 1, 3, 2)), (BM, D))


@triton.jit
def _epilogue(x, on, r0, HQ, HKV,
              q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s,
              wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
              cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, S,
              BM: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, QT: tl.constexpr,
              NORM_AFTER_ROPE: tl.constexpr, NORM_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr,
              V_NORM: tl.constexpr):
    """Column tile ``on`` of tokens [r0, r0 + BM) from its projection tile ``x`` (rounded to the
    output dtype): a query or key head RMS-normed and rotated (fp32, one rounding) into q/k with
    its rstd; with ``V_NORM`` a value head normed into v; other tiles (gates, raw v) nothing.

    No branch on the tile's kind: the kind selects pointers and masks. (Triton 3.6's loop
    flattening fails on an ``if`` in the persistent loop's body.)"""
    # the tile's kind per token row: (Triton 3.9's interpreter types a scalar compare by its
    # operands, and a splat of it is no valid mask)
    rows = r0 + tl.arange(0, BM)
    kh = tl.broadcast_to(on - HQ * QT, rows.shape)
    is_q = (kh < 0) & (tl.broadcast_to(on % QT, rows.shape) == 0)
    is_k = (kh >= 0) & (kh < HKV)
    is_v = (kh >= HKV) & V_NORM
    h = tl.where(is_q, on // QT, tl.where(is_k, kh, kh - HKV))
    x = x.to(tl.float32)
    tmask = rows < M
    tok = rows.to(tl.int64)
    b = tok // S
    s = tok % S
    cols = tl.arange(0, D)
    rope = is_q | is_k
    cmask = (tmask & rope)[:, None] & (cols < ROT)[None, :]
    c = tl.load(cos_ptr + b[:, None] * scos_b + s[:, None] * scos_s + cols[None, :] * scos_d, mask=cmask,
                other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + b[:, None] * ssin_b + s[:, None] * ssin_s + cols[None, :] * ssin_d, mask=cmask,
                 other=0.0).to(tl.float32)
    if NORM_AFTER_ROPE:
        x = x * c + _rotate(x, BM, D, ROT, INTERLEAVED) * sn
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    y = x * r[:, None]
    if NORM_WEIGHT:
        wq = tl.load(wq_ptr + cols * swq).to(tl.float32)[None, :]
        wk = tl.load(wk_ptr + cols * swk).to(tl.float32)[None, :]
        y = y * tl.where(is_q[:, None], wq, tl.where(is_k[:, None], wk, 1.0))
    if not NORM_AFTER_ROPE:
        y = y * c + _rotate(y, BM, D, ROT, INTERLEAVED) * sn
    qo = q_ptr + b * sq_b + h * sq_h + s * sq_s
    ko = k_ptr + b * sk_b + h * sk_h + s * sk_s
    if V_NORM:
        ko = tl.where(is_v, v_ptr + b * sv_b + h * sv_h + s * sv_s, ko)
    out = tl.where(is_q, qo, ko)
    _store_cast(out[:, None] + cols[None, :], y, (tmask & (rope | is_v))[:, None] & (cols < D)[None, :])
    rstd = tl.where(is_q, rq_ptr + b * srq_b + h * srq_h + s * srq_s, rk_ptr + b * srk_b + h * srk_h + s * srk_s)
    tl.store(rstd, r, mask=tmask & rope)


@triton.jit
def qkv_rope_norm_gemm_kernel(
    x_desc, w_desc, qkv_desc,
    q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s,
    bias_ptr,
    wq_ptr, swq, wk_ptr, swk,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    eps, M, N, K, S, HQ, HKV,
    BM: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, GROUP_M: tl.constexpr,
    NPROG: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, NORM_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr,
    Q_GATE: tl.constexpr, V_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
):
    """``x_desc`` x [tokens, K] in blocks [BM, BK]; ``w_desc`` W [N, K] in blocks [D, BK];
    ``qkv_desc`` [tokens, N] in blocks [BM, D]; q/k (v: only with ``V_NORM``) ``[B, H, S, D]``
    with unit last stride. ``EPILOGUE`` off: the plain GEMM (benchmarks)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, D)
    n_tiles = n_m * n_n
    k_steps = tl.cdiv(K, BK)
    cols = tl.arange(0, D)
    tile_out = pid - NPROG
    QT: tl.constexpr = 2 if Q_GATE else 1  # column tiles per query head
    for tile in tl.range(pid, n_tiles, NPROG, flatten=True):
        tm, tn = _tile_of(tile, n_m, n_n, GROUP_M)
        acc = tl.zeros((BM, D), tl.float32)
        for kk in range(k_steps):
            acc = _mma(x_desc.load([tm * BM, kk * BK]), tl.trans(w_desc.load([tn * D, kk * BK])), acc)
        # the epilogue's tile recomputed from a counter of its own (not carried through the
        # pipelined loads)
        tile_out += NPROG
        om, on = _tile_of(tile_out, n_m, n_n, GROUP_M)
        r0 = om * BM
        if HAS_BIAS:
            acc += tl.load(bias_ptr + on * D + cols).to(tl.float32)[None, :]
        x = _to_lp(acc, qkv_desc.dtype)
        qkv_desc.store([r0, on * D], x)
        if EPILOGUE:
            _epilogue(x, on, r0, HQ, HKV, q_ptr, sq_b, sq_h, sq_s, k_ptr, sk_b, sk_h, sk_s, v_ptr, sv_b, sv_h, sv_s,
                      wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                      cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, S,
                      BM, D, ROT, QT, NORM_AFTER_ROPE, NORM_WEIGHT, INTERLEAVED, V_NORM)
