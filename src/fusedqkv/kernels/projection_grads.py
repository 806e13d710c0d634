"""Triton kernels for the two projection gradients of the block backward, from dQKV
``[tokens, NQKV]`` (token-major, as the RoPE/QK-norm stage writes it):

* ``tma_matmul_kernel``: a persistent TMA matmul (host descriptors, the tile and K loops
  flattened into one software pipeline, fp32, one rounding, no split: deterministic), used
  for dX = dQKV . W and dW = dQKV^T . X at few tokens, chained behind the stage by
  programmatic dependent launch (``ops/projection.py``).
* the single launch's product tiles (``_dw_tile``: one dW tile over the whole token axis;
  ``_dx_item``: one K-split of a dX tile, the last split of a tile -- a self-resetting
  ticket -- summing the fp32 partials in split order).
"""

import triton
import triton.language as tl

from .rope_qk_norm import _SOFT_BF16_ROUND, _finish_norm_weight, _store_cast, _to_lp

# Triton 3.6's interpreter multiplies 16-bit float operands of tl.dot as raw bits; under it
# the operands are widened to fp32 first (exact: bf16/fp16 -> fp32 loses nothing)
_INTERPRET = _SOFT_BF16_ROUND


@triton.jit
def _mma(a, b, acc):
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_offsets(tile, N, BR: tl.constexpr, BC: tl.constexpr):
    """Row and column indices of output tile ``tile`` (row-major over tiles, N columns)."""
    n_n = tl.cdiv(N, BC)
    return (tile // n_n) * BR + tl.arange(0, BR), (tile % n_n) * BC + tl.arange(0, BC)


@triton.jit
def _dx_split(tile, split, dq_ptr, s_dq, w_ptr, sw_r, sw_c, M, NQKV, HIDDEN, K_PER_SPLIT,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """One K-split of one dX tile: dQKV[m, k-range] . W[k-range, n] in fp32."""
    rm, rn = _tile_offsets(tile, HIDDEN, BM, BN)
    rk = tl.arange(0, BK)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, NQKV)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kk = k0 + rk
        a = tl.load(dq_ptr + rm[:, None].to(tl.int64) * s_dq + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0, cache_modifier=".cg")
        b = tl.load(w_ptr + kk[:, None].to(tl.int64) * sw_r + rn[None, :] * sw_c,
                    mask=(kk[:, None] < k_hi) & (rn[None, :] < HIDDEN), other=0.0)
        acc = _mma(a, b, acc)
    return acc


@triton.jit
def _dx_store(tile, acc, ptr, s_t, s_h, M, HIDDEN, BM: tl.constexpr, BN: tl.constexpr):
    rm, rn = _tile_offsets(tile, HIDDEN, BM, BN)
    _store_cast(ptr + rm[:, None].to(tl.int64) * s_t + rn[None, :] * s_h, acc, (rm[:, None] < M) & (rn[None, :] < HIDDEN))


@triton.jit
def _dx_reduce(tile, part_ptr, dx_ptr, sdx_t, sdx_h, M, HIDDEN,
               BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """dX tile = sum of its SPLIT fp32 partials, in split order, rounded once."""
    rm, rn = _tile_offsets(tile, HIDDEN, BM, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < HIDDEN)
    acc = tl.zeros((BM, BN), tl.float32)
    for sp in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (sp * M + rm[:, None]).to(tl.int64) * HIDDEN + rn[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
    _store_cast(dx_ptr + rm[:, None].to(tl.int64) * sdx_t + rn[None, :] * sdx_h, acc, mask)


@triton.jit
def _dw_tile(item, dq_ptr, s_dq, x_ptr, sx_t, sx_h, dw_ptr, sdw_r, sdw_c, M, NQKV, HIDDEN,
             BJ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """One dW tile: dQKV[:, j]^T . X[:, n], summed over all tokens."""
    rj, rn = _tile_offsets(item, HIDDEN, BJ, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BJ, BN), tl.float32)
    for m0 in tl.range(0, M, BK, num_stages=STAGES):
        mm = m0 + rk
        a = tl.load(dq_ptr + mm[:, None].to(tl.int64) * s_dq + rj[None, :],
                    mask=(mm[:, None] < M) & (rj[None, :] < NQKV), other=0.0, cache_modifier=".cg")
        b = tl.load(x_ptr + mm[:, None].to(tl.int64) * sx_t + rn[None, :] * sx_h,
                    mask=(mm[:, None] < M) & (rn[None, :] < HIDDEN), other=0.0)
        acc = _mma(tl.trans(a), b, acc)
    _store_cast(dw_ptr + rj[:, None].to(tl.int64) * sdw_r + rn[None, :] * sdw_c, acc,
                (rj[:, None] < NQKV) & (rn[None, :] < HIDDEN))


@triton.jit
def _dx_item(item, dq_ptr, s_dq, w_ptr, sw_r, sw_c, dx_ptr, sdx_t, sdx_h, xpart_ptr, tick_ptr, M, NQKV, HIDDEN,
             K_PER_SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
             STAGES: tl.constexpr):
    """Work item ``item`` = tile * SPLIT + split: one K-split of one dX tile; with SPLIT > 1 the
    fp32 partials ``[SPLIT, M, HIDDEN]`` are summed, in split order, by the last split of the
    tile to finish (a self-resetting ticket)."""
    tile = item // SPLIT
    split = item % SPLIT
    acc = _dx_split(tile, split, dq_ptr, s_dq, w_ptr, sw_r, sw_c, M, NQKV, HIDDEN, K_PER_SPLIT, BM, BN, BK, STAGES)
    if SPLIT == 1:
        _dx_store(tile, acc, dx_ptr, sdx_t, sdx_h, M, HIDDEN, BM, BN)
    else:
        _dx_store(tile, acc, xpart_ptr + tl.cast(split * M, tl.int64) * HIDDEN, HIDDEN, 1, M, HIDDEN, BM, BN)
        tl.debug_barrier()
        ticket = tl.atomic_add(tick_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            tl.store(tick_ptr + tile, 0)
            _dx_reduce(tile, xpart_ptr, dx_ptr, sdx_t, sdx_h, M, HIDDEN, BM, BN, SPLIT)


@triton.jit
def tma_matmul_kernel(a_desc, b_desc, c_desc, R, C, K,
                      fin_part_ptr, fin_rows, fin_gwq_ptr, fin_sgwq, fin_gwk_ptr, fin_sgwk,
                      BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      TRANS_A: tl.constexpr, NPROG: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
                      WAIT_AT_END: tl.constexpr, FINISH: tl.constexpr, FIN_D: tl.constexpr,
                      FIN_D_P2: tl.constexpr):
    """Persistent C[R, C] = A . B through TMA descriptors, the whole K axis per tile (fp32,
    one rounding; no split, deterministic). ``TRANS_A``: ``a_desc`` addresses A^T ([K, R],
    blocks [BK, BR]) -- dW = dQKV^T . X reads dQKV as stored -- else A ([R, K], blocks
    [BR, BK]); ``b_desc`` addresses B [K, C] in blocks [BK, BC]. NPROG programs stride over
    the tiles; the tile and K loops are flattened into one software pipeline, so the next
    tile's loads are in flight while a tile's result is stored.

    ``PDL``: launched as a programmatic dependent; waits for the kernel before it first.
    ``TRIGGER``: lets the next programmatic dependent launch at once (it must not read what
    this kernel writes). ``WAIT_AT_END``: waits for the kernel before it at the end instead
    of the start (this kernel only reads what finished before that kernel started).

    ``FINISH``: the last program (it has no more tiles than any other) also sums the RoPE/QK-norm
    stage's norm-weight rows ``fin_part`` [fin_rows, 2, FIN_D] into the two norm-weight
    gradients -- off the stage's critical path; the stage must have completed before this
    kernel started reading (as for its operands)."""
    if PDL and not WAIT_AT_END:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if FINISH:
        if pid == NPROG - 1:
            _finish_norm_weight(fin_part_ptr, fin_rows, fin_gwq_ptr, fin_sgwq, fin_gwk_ptr, fin_sgwk, FIN_D,
                                FIN_D_P2, 32, ".cg")
    n_c = tl.cdiv(C, BC)
    n_tiles = tl.cdiv(R, BR) * n_c
    k_steps = tl.cdiv(K, BK)
    tile_out = pid - NPROG
    for tile in tl.range(pid, n_tiles, NPROG, flatten=True):
        r0 = (tile // n_c) * BR
        c0 = (tile % n_c) * BC
        acc = tl.zeros((BR, BC), tl.float32)
        for kk in range(k_steps):
            if TRANS_A:
                a = tl.trans(a_desc.load([kk * BK, r0]))
            else:
                a = a_desc.load([r0, kk * BK])
            acc = _mma(a, b_desc.load([kk * BK, c0]), acc)
        # the store's indices recomputed from a counter of its own (not carried through the
        # pipelined loads)
        tile_out += NPROG
        c_desc.store([(tile_out // n_c) * BR, (tile_out % n_c) * BC], _to_lp(acc, c_desc.dtype))
    if PDL and WAIT_AT_END:
        tl.extra.cuda.gdc_wait()
