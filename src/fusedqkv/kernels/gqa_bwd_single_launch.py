"""The whole 091-style backward in one persistent launch, for few tokens.

At a few hundred tokens the two projection GEMMs are bound by memory (dX reads all of
W, dW writes a tensor of W's size) and take tens of microseconds; the RoPE/QK-norm stage
takes ~10 us. Issued as three launches (stage, cuBLAS, cuBLAS), the GPU sits idle while
the host issues each GEMM (~25 us of host time each on the H200 box, benchmarks/NOTES.md),
and the official timer (first kernel start to last kernel end) pays that. Here one
persistent kernel, one program per SM, does everything:

* phase 1: the stage work items (``_stage_program``: token block x {query and key heads,
  value copy}), writing dQKV, grad_cos/sin and the fp32 partials of the norm weights;
* a grid barrier (all programs are resident: the launch is cooperative);
* phase 2, one flat list of work items: the two norm-weight sums, the dX tiles (split along the QKV axis; the last split of a tile to
  finish -- a self-resetting ticket -- sums the fp32 partials in split order) and the
  dW tiles.

Every sum has a fixed order (deterministic; the tickets only decide who sums).
``PHASE`` selects the phases: 3 on the GPU (both, with the barrier); the CPU interpreter
runs programs one after another, so there the launcher issues phase 1 and phase 2 as
two launches and the barrier is not compiled.
"""

import triton
import triton.language as tl

from .projection_grads import _dw_tile, _dx_item
from .rope_qk_norm import _finish_norm_weight, _stage_program

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
    gcos_ptr, sgcos_b, sgcos_s, sgcos_d,
    gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
    gwq_ptr, sgwq, gwk_ptr, sgwk, wpart_ptr, wsup_ptr, tick_ptr, cs_ptr, wgrp_ptr,
    # the projections: X [M, HIDDEN], W [NQKV, HIDDEN], dX [M, HIDDEN], dW [NQKV, HIDDEN]
    x_ptr, sx_t, sx_h, w_ptr, sw_r, sw_c, dx_ptr, sdx_t, sdx_h, dw_ptr, sdw_r, sdw_c,
    # fp32 dX partials [SPLIT, M, HIDDEN] (the int32 tickets above: dX tiles, then barrier, exit)
    xpart_ptr,
    M, S, HQ, HKV, N_PROG_T, NQKV, HIDDEN, K_PER_SPLIT, eps,
    D: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, HB: tl.constexpr, PF: tl.constexpr,
    EXACT: tl.constexpr, NORM_AFTER_ROPE: tl.constexpr, SAVED_ROTATED: tl.constexpr,
    GRAD_COS_SIN: tl.constexpr, RECOMPUTE_RSTD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
    BJ: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr, PHASE: tl.constexpr, LP2: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_dx_tiles = tl.cdiv(M, BM) * tl.cdiv(HIDDEN, BN)
    if PHASE % 2 == 1:
        for item in range(pid, N_PROG_T * 2, nprog):
            _stage_program(
                item % N_PROG_T, item // N_PROG_T, N_PROG_T,
                gq_ptr, sgq_b, sgq_h, sgq_s, sgq_d, gk_ptr, sgk_b, sgk_h, sgk_s, sgk_d,
                gv_ptr, sgv_b, sgv_h, sgv_s, sgv_d, xq_ptr, sxq_b, sxq_h, sxq_s, sxq_d,
                xk_ptr, sxk_b, sxk_h, sxk_s, sxk_d, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                wq_ptr, swq, wk_ptr, swk, cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d,
                dqkv_ptr, s_dqkv_t, gcos_ptr, sgcos_b, sgcos_s, sgcos_d, gsin_ptr, sgsin_b, sgsin_s, sgsin_d,
                gwq_ptr, sgwq, gwk_ptr, sgwk, wpart_ptr, wsup_ptr, tick_ptr, cs_ptr, wgrp_ptr, M, S, HQ, HKV, eps,
                gq_ptr, gq_ptr, gq_ptr, gq_ptr,  # no TMA descriptors: placeholders
                D, HALF, HALF_P2, D_P2, BLOCK_T, HB, EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, False, 32,
                RECOMPUTE_RSTD, PF, False, 1, 1, 1, False, LP2,
            )
    if PHASE == 3:
        _grid_barrier(tick_ptr + n_dx_tiles, nprog)
    if PHASE >= 2:
        n_fin = 1
        n_dx = n_dx_tiles * SPLIT
        n_dw = tl.cdiv(NQKV, BJ) * tl.cdiv(HIDDEN, BN)
        for item in range(pid, n_fin + n_dx + n_dw, nprog):
            if item < n_fin:
                _finish_norm_weight(wpart_ptr, N_PROG_T, gwq_ptr, sgwq, gwk_ptr, sgwk, D, D_P2, 32, ".cg")
            elif item < n_fin + n_dx:
                _dx_item(item - n_fin, dqkv_ptr, s_dqkv_t, w_ptr, sw_r, sw_c, dx_ptr, sdx_t, sdx_h, xpart_ptr, tick_ptr,
                         M, NQKV, HIDDEN, K_PER_SPLIT, BM, BN, BK, SPLIT, STAGES)
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
