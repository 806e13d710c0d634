"""The whole 091-style backward in one persistent launch, for few tokens.

At a few hundred tokens the two projection GEMMs are bound by memory (dX reads all of
W, dW writes a tensor of W's size) and take tens of microseconds; the RoPE/QK-norm stage
takes ~10 us. Issued as three launches (stage, cuBLAS, cuBLAS), the GPU sits idle while
the host issues each GEMM (~25 us of host time each on the H200 box, benchmarks/NOTES.md),
and the official timer (first kernel start to last kernel end) pays that. Here one
persistent kernel, one program per SM, does everything:

* phase 1: the stage work items (``_stage_program``: token chunk x head group), writing
  dQKV and the fp32 partials of grad_cos/sin and the norm weights;
* a grid barrier (all programs are resident: the launch is cooperative);
* phase 2, one flat list of work items: the grad_cos/sin finish per 16 tokens, the two
  norm-weight sums, the dX tiles (split along the QKV axis; the last split of a tile to
  finish -- a self-resetting ticket -- sums the fp32 partials in split order) and the
  dW tiles.

Every sum has a fixed order (deterministic; the tickets only decide who sums).
``PHASE`` selects the phases: 3 on the GPU (both, with the barrier); the CPU interpreter
runs programs one after another, so there the launcher issues phase 1 and phase 2 as
two launches and the barrier is not compiled.
"""

import triton
import triton.language as tl

from .rope_qk_norm import _SOFT_BF16_ROUND, _finish_cos_sin, _finish_norm_weight, _stage_program, _store_cast

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
def _grid_barrier(bar_ptr, nprog):
    # every program arrives (release: its stores before are visible to whoever acquires),
    # then waits until all have arrived (acquire)
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < nprog:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


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
def gqa_bwd_single_launch_kernel(
    # the stage (see rope_qk_norm_bwd_kernel)
    gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d,
    gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
    gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d,
    xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
    xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d,
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    wq_ptr, swq, wk_ptr, swk,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    dqkv_ptr, s_dqkv_t,
    cs_ptr, wpart_ptr,
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    gwq_ptr, sgwq, gwk_ptr, sgwk,
    # the projections: X [M, HIDDEN], W [NQKV, HIDDEN], dX [M, HIDDEN], dW [NQKV, HIDDEN]
    x_ptr, sx_t, sx_h, w_ptr, sw_r, sw_c, dx_ptr, sdx_t, sdx_h, dw_ptr, sdw_r, sdw_c,
    # fp32 dX partials [SPLIT, M, HIDDEN]; int32 tickets (dX tiles, then barrier, exit)
    xpart_ptr, tick_ptr,
    M, S, HQ, HKV, HEADS_PER_GROUP, NQG, NKG, TPP, N_PROG_T, NQKV, HIDDEN, K_PER_SPLIT, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, PF: tl.constexpr,
    EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, SAVED_ROTATED: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, RECOMPUTE_RSTD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    BJ: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr, FIN_T: tl.constexpr,
    PHASE: tl.constexpr,
):
    DT: tl.constexpr = gq_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_groups = NQG + 2 * NKG
    n_dx_tiles = tl.cdiv(M, BM) * tl.cdiv(HIDDEN, BN)
    if PHASE % 2 == 1:
        for item in range(pid, N_PROG_T * n_groups, nprog):
            _stage_program(
                item % N_PROG_T, item // N_PROG_T, N_PROG_T,
                gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
                gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
                xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                wq_ptr, swq, wk_ptr, swk, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                dqkv_ptr, s_dqkv_t, cs_ptr, wpart_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
                gsin_ptr, sgsin_b, sgsin_s, sgsin_d, gwq_ptr, sgwq, gwk_ptr, sgwk, tick_ptr, wpart_ptr,
                M, S, HQ, HKV, HEADS_PER_GROUP, NQG, NKG, TPP, eps,
                D, HALF, HALF_P2, D_P2, BLOCK_T, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, False, 16,
                RECOMPUTE_RSTD, PF,
            )
    if PHASE == 3:
        _grid_barrier(tick_ptr + n_dx_tiles, nprog)
    if PHASE >= 2:
        n_fin_t = tl.cdiv(M, FIN_T) if GRAD_COS_SIN else 0
        n_fin = n_fin_t + 2
        n_dx = n_dx_tiles * SPLIT
        n_dw = tl.cdiv(NQKV, BJ) * tl.cdiv(HIDDEN, BN)
        for item in range(pid, n_fin + n_dx + n_dw, nprog):
            if item < n_fin_t:
                _finish_cos_sin(cs_ptr, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                                item * FIN_T, M, S, NQG, NKG, D, D_P2, FIN_T, DT, EXACT, ".cg")
            elif item < n_fin:
                if item == n_fin_t:
                    _finish_norm_weight(wpart_ptr, 0, NQG, N_PROG_T, gwq_ptr, sgwq, D, D_P2, 32, ".cg")
                else:
                    _finish_norm_weight(wpart_ptr, NQG, NQG + NKG, N_PROG_T, gwk_ptr, sgwk, D, D_P2, 32, ".cg")
            elif item < n_fin + n_dx:
                tile = (item - n_fin) // SPLIT
                split = (item - n_fin) % SPLIT
                acc = _dx_split(tile, split, dqkv_ptr, s_dqkv_t, w_ptr, sw_r, sw_c, M, NQKV, HIDDEN, K_PER_SPLIT,
                                BM, BN, BK, STAGES)
                if SPLIT == 1:
                    _dx_store(tile, acc, dx_ptr, sdx_t, sdx_h, M, HIDDEN, BM, BN)
                else:
                    # fp32 partials [SPLIT, M, HIDDEN]; the last split of this tile to finish
                    # sums them in split order
                    _dx_store(tile, acc, xpart_ptr + (split * M).to(tl.int64) * HIDDEN, HIDDEN, 1, M, HIDDEN, BM, BN)
                    tl.debug_barrier()
                    ticket = tl.atomic_add(tick_ptr + tile, 1, sem="acq_rel", scope="gpu")
                    if ticket == SPLIT - 1:
                        tl.store(tick_ptr + tile, 0)
                        _dx_reduce(tile, xpart_ptr, dx_ptr, sdx_t, sdx_h, M, HIDDEN, BM, BN, SPLIT)
            else:
                _dw_tile(item - n_fin - n_dx, dqkv_ptr, s_dqkv_t, x_ptr, sx_t, sx_h, dw_ptr, sdw_r, sdw_c,
                         M, NQKV, HIDDEN, BJ, BN, BKW, STAGES)
    if PHASE == 3:
        # the last program out resets the barrier for the next launch (every program has
        # passed it by now)
        done = tl.atomic_add(tick_ptr + n_dx_tiles + 1, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:
            tl.store(tick_ptr + n_dx_tiles, 0)
            tl.store(tick_ptr + n_dx_tiles + 1, 0)
