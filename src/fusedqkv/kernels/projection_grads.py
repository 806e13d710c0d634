"""Triton kernel for the two projection gradients of the block backward, from dQKV
``[tokens, NQKV]`` (token-major, as the RoPE/QK-norm stage writes it):
``tma_matmul_kernel``, a persistent TMA matmul (host descriptors, the tile and K loops
flattened into one software pipeline, fp32, one rounding, no split: deterministic), used
for dX = dQKV . W and dW = dQKV^T . X at few tokens, chained behind the stage by
programmatic dependent launch (``ops/projection.py``).
"""

import triton
import triton.language as tl

from .rope_qk_norm import _SOFT_BF16_ROUND, _finish_norm_weight, _to_lp

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
def tma_matmul_kernel(a_desc, b_desc, c_desc, R, C, K,
                      fin_part_ptr, fin_rows, fin_gwq_ptr, fin_sgwq, fin_gwk_ptr, fin_sgwk,
                      BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      TRANS_A: tl.constexpr, NPROG: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
                      WAIT_AT_END: tl.constexpr, FINISH: tl.constexpr, FIN_D: tl.constexpr,
                      FIN_D_P2: tl.constexpr, FIN_ROWS: tl.constexpr):
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
    gradients, FIN_ROWS rows per step -- off the stage's critical path; the stage must have
    completed before this kernel started reading (as for its operands)."""
    if PDL and not WAIT_AT_END:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if FINISH:
        if pid == NPROG - 1:
            _finish_norm_weight(fin_part_ptr, fin_rows, fin_gwq_ptr, fin_sgwq, fin_gwk_ptr, fin_sgwk, FIN_D,
                                FIN_D_P2, FIN_ROWS, ".cg")
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
