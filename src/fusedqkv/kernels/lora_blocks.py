"""The LoRA adapters' block-diagonal B ``[n_tot, R]`` in one launch (``ops/lora.py``).

Up to four pairs per launch, each ``(B_i [rows_i, r_i], row_i, col_i, s_i)``: rows ``[row_i,
row_i + rows_i)`` and columns ``[col_i, col_i + r_i)`` of the block get ``s_i * B_i``, the product
in fp32 rounded once to the block's dtype (what ``torch.mul(B_i, s_i, out=block_view)`` gives).
``WRITE_ZEROS``: the rest of the block gets zeros (the first launch); off, only the pairs'
rectangles are written (the launches after it, for more than four pairs). The rectangles do not
overlap (each pair has its own columns).
"""

import triton
import triton.language as tl

MAX_PAIRS = 4


@triton.jit
def _scaled_pair(val, i, j, b_ptr, b_s0, b_s1, row, rows, col, r, scale):
    """``val`` with pair's ``scale * B`` where (i, j) falls in its rectangle (a select, not a sum:
    a product of -0.0 keeps its sign), and the rectangle's mask."""
    inside = (i >= row) & (i < row + rows) & (j >= col) & (j < col + r)
    offs = (i - row).to(tl.int64) * b_s0 + (j - col).to(tl.int64) * b_s1
    b = tl.load(b_ptr + offs, mask=inside, other=0.0)
    return tl.where(inside, b.to(tl.float32) * scale, val), inside


@triton.jit
def lora_block_kernel(out_ptr, n_rows, n_cols, stride_out,
                      b0_ptr, b0_s0, b0_s1, row0, rows0, col0, r0, scale0,
                      b1_ptr, b1_s0, b1_s1, row1, rows1, col1, r1, scale1,
                      b2_ptr, b2_s0, b2_s1, row2, rows2, col2, r2, scale2,
                      b3_ptr, b3_s0, b3_s1, row3, rows3, col3, r3, scale3,
                      N_PAIRS: tl.constexpr, WRITE_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    i = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    j = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R))[None, :]
    val = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    val, written = _scaled_pair(val, i, j, b0_ptr, b0_s0, b0_s1, row0, rows0, col0, r0, scale0)
    if N_PAIRS > 1:
        val, inside = _scaled_pair(val, i, j, b1_ptr, b1_s0, b1_s1, row1, rows1, col1, r1, scale1)
        written = written | inside
    if N_PAIRS > 2:
        val, inside = _scaled_pair(val, i, j, b2_ptr, b2_s0, b2_s1, row2, rows2, col2, r2, scale2)
        written = written | inside
    if N_PAIRS > 3:
        val, inside = _scaled_pair(val, i, j, b3_ptr, b3_s0, b3_s1, row3, rows3, col3, r3, scale3)
        written = written | inside
    mask = (i < n_rows) & (j < n_cols)
    if not WRITE_ZEROS:
        mask = mask & written
    tl.store(out_ptr + i.to(tl.int64) * stride_out + j, val.to(out_ptr.dtype.element_ty), mask=mask)
