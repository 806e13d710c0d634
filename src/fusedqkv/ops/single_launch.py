"""Launcher of the single-launch backward (stage + dX + dW in one persistent kernel).

Used for few tokens, where three launches leave the GPU idle while the host issues the
GEMMs (see :mod:`fusedqkv.kernels.gqa_bwd_single_launch`). The caller checks
:func:`eligible`; the outputs are written in place.
"""

from __future__ import annotations

import os

import torch

from .launch import _INTERPRET, kernel, sm90_or_newer
from .rope_qk_norm import PREFETCH, _next_pow2, sm_count, stage_tensor_args, ticket_buffer

# Largest token count that takes the single launch. Off (0) by default: on the H200 its GEMM phase ran
# at about half the speed of cuBLAS (benchmarks/NOTES.md, "single launch").
# FUSEDQKV_SINGLE_LAUNCH_MAX_TOKENS overrides it (0 turns the path off).
MAX_TOKENS = int(os.environ.get("FUSEDQKV_SINGLE_LAUNCH_MAX_TOKENS", "0"))

NUM_WARPS = 8  # two warpgroups for the wgmma tiles
# the stage's tiles: one token x 16 heads per step (4 elements per thread at head_dim 128), so
# that few tokens still give ~2 work items per program
BLOCK_T = 1
HB = 16
BM = BN = BJ = 128
BK = BKW = 64
STAGES = 3

# run the two phases as two launches on the GPU too (no barrier): for profiling each phase
SPLIT_PHASES = False

def eligible(M: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Few tokens and a 16-bit activation dtype (the wgmma operands); the caller also needs
    X and dX as [tokens, hidden] views."""
    return (0 < M <= MAX_TOKENS and dtype in (torch.bfloat16, torch.float16) and d % 16 == 0
            and (device.type == "cuda" or _INTERPRET))


def backward(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, x2d, W, *, dqkv, dx2d, dw, gcos, gsin, gwq, gwk,
             exact=True, norm_after_rope=True, saved_rotated=True, eps=None):
    """Everything of the block backward in one launch (two under the CPU interpreter)."""
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    M = B * S
    NQKV, HIDDEN = W.shape
    dev = gq.device
    nprog = sm_count(dev)
    n_prog_t = -(-M // BLOCK_T)
    # dX split along the QKV axis so that every program has a tile to work on
    n_dx_tiles = -(-M // BM) * -(-HIDDEN // BN)
    split = max(1, min(8, round(nprog / n_dx_tiles)))
    k_per_split = -(-NQKV // (split * BK)) * BK
    split = -(-NQKV // k_per_split)
    grad_cos_sin = gcos is not None
    recompute = rq is None
    # every allocation before the launch
    n_w = n_prog_t * 2 * D
    n_x = split * M * HIDDEN if split > 1 else 1
    scratch = torch.empty(n_w + n_x, device=dev, dtype=torch.float32)
    w_part = scratch[:n_w]
    x_part = scratch[n_w: n_w + n_x]
    tick = ticket_buffer(dev, n_dx_tiles + 2)
    if not grad_cos_sin:
        gcos = gsin = cos
    common = (
        *stage_tensor_args(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                           w_part, w_part, tick),
        x2d, *x2d.stride(), W, *W.stride(), dx2d, *dx2d.stride(), dw, *dw.stride(),
        x_part,
        M, S, HQ, HKV, n_prog_t, NQKV, HIDDEN, k_per_split, float(eps) if recompute else 0.0,
    )
    meta = dict(D=D, HALF=D // 2, HALF_P2=_next_pow2(D // 2), D_P2=_next_pow2(D), BLOCK_T=BLOCK_T, HB=HB,
                PF=PREFETCH, EXACT=exact, NORM_AFTER_ROPE=norm_after_rope, SAVED_ROTATED=saved_rotated,
                GRAD_COS_SIN=grad_cos_sin, RECOMPUTE_RSTD=recompute,
                BM=BM, BN=BN, BK=BK, SPLIT=split, BJ=BJ, BKW=BKW, STAGES=STAGES, LP2=sm90_or_newer(dev),
                num_warps=NUM_WARPS, enable_fp_fusion=not exact)
    k = kernel("gqa_bwd_single_launch", "gqa_bwd_single_launch_kernel")
    if _INTERPRET or dev.type != "cuda" or SPLIT_PHASES:
        # programs run one after another here: no grid barrier, two launches
        k[(nprog,)](*common, PHASE=1, **meta)
        k[(nprog,)](*common, PHASE=2, **meta)
    else:
        # cooperative: the driver refuses the launch rather than let the barrier deadlock
        k[(nprog,)](*common, PHASE=3, launch_cooperative_grid=True, **meta)
