"""FP8 casts of the block's GEMM operands, scaled as torchao's float8 scales them.

A scale is ``fp8_max / max(amax, 1e-12)`` formed in fp64 and rounded to fp32 (torchao's
``amax_to_scale``), optionally rounded down to a power of two (the rowwise recipes); the
data is ``clamp(x * scale, -fp8_max, fp8_max)`` cast with round-to-nearest-even; the GEMM
takes the reciprocal of the scale.

* ``rowwise_cast_kernel``: one scale per row of ``x [R, C]``, data row-major ``[R, C]``;
  one program per ``ROWS`` rows: the whole row in registers up to 8192 columns (one read),
  else an amax loop over the row, then a cast loop.
* ``rowwise_cast_colamax_kernel``: ``rowwise_cast_kernel``'s cast that also stores the column amaxes
  of each block of rows it casts (partials for a later per-column cast of the same tensor).
* ``rowwise_cast_parts_kernel``: ``rowwise_cast_kernel``'s cast with each row's amax from row partials
  found beforehand (the backward stage's): one read of the operand, no amax pass.
* ``tile_amax_kernel``: the amax of each ``[BR, BC]`` tile's columns, ``part [cdiv(R, BR), C]``
  (per-column scales reduce it; a tensor's scale is its max).
* ``cast_kernel``: one scale per column (from ``part``) or one for the tensor (``amax``),
  data row-major ``[R, C]`` or transposed ``[C, R_pad]`` (the column-major operand a scaled
  GEMM needs; columns ``R..R_pad`` written as zeros: a GEMM's inner dimension padded to 16).
"""

import triton
import triton.language as tl


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), 1e-12)).to(tl.float32)
    if POW2:  # 2^floor(log2(scale)): the exponent bits alone (scale > 0, normal)
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _column_amax(part_ptr, n_part, C, cols, cmask, BP: tl.constexpr, W: tl.constexpr):
    """The amax of columns ``cols`` over the ``n_part`` partial rows ``[n_part, C]`` at ``part_ptr``
    (fp32, or the operand's 16-bit dtype: partials of its values, exact in it), ``BP`` rows a step in
    a fixed order."""
    amax = tl.zeros([W], tl.float32)
    for p0 in range(0, n_part, BP):
        ps = p0 + tl.arange(0, BP)
        t = tl.load(part_ptr + ps[:, None] * C + cols[None, :], mask=(ps < n_part)[:, None] & cmask[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(t.to(tl.float32), 0))
    return amax


@triton.jit
def _rows_amax(x_row, rmask, C, cols, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The amax of each of ``ROWS`` rows (``x_row``: their pointers, ``rmask``: which exist) over
    their ``C`` columns, ``BLOCK_C`` at a time."""
    amax = tl.zeros([ROWS], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        m = rmask[:, None] & (c0 + cols < C)[None, :]
        x = tl.load(x_row + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    return amax


@triton.jit
def rowwise_cast_kernel(x_ptr, y_ptr, inv_ptr, R, C, stride_xr, stride_yr, FP8_MAX: tl.constexpr,
                        POW2: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, WHOLE_ROW: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    cols = tl.arange(0, BLOCK_C)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    y_row = y_ptr + rows.to(tl.int64)[:, None] * stride_yr
    if WHOLE_ROW:  # BLOCK_C >= C: the rows stay in registers between the amax and the cast (one read)
        m = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(x_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(x), 1), FP8_MAX, POW2)
        y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        scale = _scale_of(_rows_amax(x_row, rmask, C, cols, ROWS, BLOCK_C), FP8_MAX, POW2)
        for c0 in range(0, C, BLOCK_C):
            m = rmask[:, None] & (c0 + cols < C)[None, :]
            x = tl.load(x_row + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX)
            tl.store(y_row + c0 + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(inv_ptr + rows, tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), mask=rmask)


@triton.jit
def rowwise_cast_colamax_kernel(x_ptr, y_ptr, inv_ptr, cpart_ptr, R, C, stride_xr, stride_yr,
                                FP8_MAX: tl.constexpr, POW2: tl.constexpr, PART_ROWS: tl.constexpr,
                                ROWS: tl.constexpr, BLOCK_C: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """``rowwise_cast_kernel``'s cast (the same codes and scales), ``PART_ROWS`` rows per program, which
    also stores those rows' column amaxes to ``cpart[pid, :]`` (``[cdiv(R, PART_ROWS), C]``, fp32 or x's dtype) from
    the same read: the column scales of a later per-column cast of x then need no pass over x.
    ``WHOLE_ROW``: ``ROWS`` whole rows at a time, a running column max in registers; else
    ``ROWS == PART_ROWS`` rows, an amax loop over column chunks, then a cast loop that stores each
    chunk's column amaxes."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    part_row = cpart_ptr + pid.to(tl.int64) * C
    if WHOLE_ROW:
        cmax = tl.zeros([BLOCK_C], tl.float32)
        for r0 in range(0, PART_ROWS, ROWS):
            rows = pid * PART_ROWS + r0 + tl.arange(0, ROWS)
            rmask = rows < R
            m = rmask[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=m,
                        other=0.0).to(tl.float32)
            a = tl.abs(x)
            scale = _scale_of(tl.max(a, 1), FP8_MAX, POW2)
            y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_yr + cols[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=m)
            tl.store(inv_ptr + rows, tl.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), mask=rmask)
            cmax = tl.maximum(cmax, tl.max(a, 0))  # rows past R load 0: no effect on a max of |x|
        tl.store(part_row + cols, cmax.to(cpart_ptr.dtype.element_ty), mask=cols < C)
    else:
        rows = pid * PART_ROWS + tl.arange(0, PART_ROWS)
        rmask = rows < R
        x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
        y_row = y_ptr + rows.to(tl.int64)[:, None] * stride_yr
        scale = _scale_of(_rows_amax(x_row, rmask, C, cols, PART_ROWS, BLOCK_C), FP8_MAX, POW2)
        for c0 in range(0, C, BLOCK_C):
            cm = c0 + cols < C
            m = rmask[:, None] & cm[None, :]
            x = tl.load(x_row + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX)
            tl.store(y_row + c0 + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(part_row + c0 + cols, tl.max(tl.abs(x), 0).to(cpart_ptr.dtype.element_ty), mask=cm)
        tl.store(inv_ptr + rows, tl.div_rn(tl.full([PART_ROWS], 1.0, tl.float32), scale), mask=rmask)


@triton.jit
def rowwise_cast_parts_kernel(x_ptr, y_ptr, part_ptr, inv_ptr, R, C, stride_xr, n_part, FP8_MAX: tl.constexpr,
                              POW2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
    """``rowwise_cast_kernel``'s cast (the same codes and scales) of tile ``(pr, pc)`` of ``x [R, C]``
    into ``y [R, C]`` row-major, each row's amax the max of its partials ``part [n_part, R]`` (fp32, or
    x's 16-bit dtype: maxima of its values, exact in it), ``BP`` a step: x is read once. Every column
    tile reduces its rows' few partials (cheaper than a launch of its own); those of column tile 0
    store the inverse scales."""
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    rm, cm = rows < R, cols < C
    amax = tl.zeros([BR], tl.float32)
    for p0 in range(0, n_part, BP):
        ps = p0 + tl.arange(0, BP)
        t = tl.load(part_ptr + ps.to(tl.int64)[:, None] * R + rows[None, :], mask=(ps < n_part)[:, None] & rm[None, :],
                    other=0.0)
        amax = tl.maximum(amax, tl.max(t.to(tl.float32), 0))
    scale = _scale_of(amax, FP8_MAX, POW2)
    if pc == 0:
        tl.store(inv_ptr + rows, tl.div_rn(tl.full([BR], 1.0, tl.float32), scale), mask=rm)
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def tile_amax_kernel(x_ptr, part_ptr, R, C, stride_xr, BR: tl.constexpr, BC: tl.constexpr):
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=m, other=0.0)
    tl.store(part_ptr + pr * C + cols, tl.max(tl.abs(x.to(tl.float32)), 0), mask=cols < C)


@triton.jit
def cast_kernel(x_ptr, y_ptr, part_ptr, inv_ptr, R, R_pad, C, stride_xr, n_part, PER_COLUMN: tl.constexpr,
                TRANSPOSE: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr, BR: tl.constexpr,
                BC: tl.constexpr, BP: tl.constexpr):
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    cmask = cols < C
    if PER_COLUMN:  # the column's amax over every row block's
        scale = _scale_of(_column_amax(part_ptr, n_part, C, cols, cmask, BP, BC), FP8_MAX, POW2)
        if pr == 0:
            tl.store(inv_ptr + cols, tl.div_rn(tl.full([BC], 1.0, tl.float32), scale), mask=cmask)
        scale = scale[None, :]
    else:  # the tensor's amax, reduced beforehand
        scale = _scale_of(tl.load(part_ptr), FP8_MAX, POW2)
        if (pr == 0) & (pc == 0):
            tl.store(inv_ptr, tl.div_rn(1.0, scale))
    m = (rows < R)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX).to(y_ptr.dtype.element_ty)
    if TRANSPOSE:  # y [C, R_pad]: rows R..R_pad of x (masked to 0) become zero columns; the tile transposed
        # in registers so that the store runs along y's rows (coalesced)
        mt = cmask[:, None] & (rows < R_pad)[None, :]
        tl.store(y_ptr + cols.to(tl.int64)[:, None] * R_pad + rows[None, :], tl.trans(y), mask=mt)
    else:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], y, mask=m)


@triton.jit
def outer_scale_kernel(y_ptr, a_ptr, b_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """``y[r, c] *= a[r] * b[c]`` in fp32, rounded once to y's dtype (a rowwise scaled GEMM run
    as a unit-scaled one, then scaled: torchao's way without fast accumulation)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rm, cm = rows < R, cols < C
    m = rm[:, None] & cm[None, :]
    ptr = y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :]
    s = tl.load(a_ptr + rows, mask=rm, other=0.0)[:, None] * tl.load(b_ptr + cols, mask=cm, other=0.0)[None, :]
    y = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    tl.store(ptr, (y * s).to(y_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------ one operand, two casts (session 21)
# dQKV is cast twice in the backward: per row (dX's first operand, row-major) and per column (dW's first
# operand, transposed). ``dual_amax_kernel`` reads it once for both amaxes' partials, ``dual_finish_kernel``
# reduces the partials (a fixed order: a max is exact whatever the order; no atomics), ``dual_cast_kernel``
# reads it once more and writes both casts. Every scale and every fp8 code equals the one-cast kernels'
# (the same amax, the same ``_scale_of``, the same product and clamp).


@triton.jit
def dual_amax_kernel(x_ptr, rpart_ptr, cpart_ptr, R, C, stride_xr, n_rpart, ROW_PART: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr):
    """Tile ``(pr, pc)`` of ``x [R, C]``: its columns' amax to ``cpart[pr, :]`` (``[cdiv(R, BR), C]``)
    and, ``ROW_PART``, its rows' amax to ``rpart[pc, :]`` (``[n_rpart, R]``, ``n_rpart = cdiv(C, BC)``:
    both stores contiguous)."""
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    rm, cm = rows < R, cols < C
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=rm[:, None] & cm[None, :],
                other=0.0)
    a = tl.abs(x.to(tl.float32))
    tl.store(cpart_ptr + pr * C + cols, tl.max(a, 0), mask=cm)
    if ROW_PART:
        tl.store(rpart_ptr + pc.to(tl.int64) * R + rows, tl.max(a, 1), mask=rm)


@triton.jit
def dual_finish_kernel(rpart_ptr, cpart_ptr, rscale_ptr, rinv_ptr, cscale_ptr, cinv_ptr, R, C, n_rpart, n_cpart,
                       n_row_prog, ROW_PER: tl.constexpr, COL_PER: tl.constexpr, FP8_MAX_R: tl.constexpr,
                       FP8_MAX_C: tl.constexpr, POW2: tl.constexpr, FB: tl.constexpr, BP: tl.constexpr,
                       FBC: tl.constexpr, BPC: tl.constexpr):
    """Programs ``0..n_row_prog``: ``FB`` rows' scales from ``rpart [n_rpart, R]`` (``ROW_PER``,
    ``BP`` partials a step); the others ``FBC`` columns' from ``cpart [n_cpart, C]`` (``COL_PER``,
    ``BPC`` a step). Partials in fp32 or in the operand's dtype (the backward stage's: maxima of its
    stored values, exact in it). Scale to ``*scale`` (the cast's), its reciprocal to ``*inv`` (the
    GEMM's)."""
    pid = tl.program_id(0)
    if ROW_PER:
        if pid < n_row_prog:
            rows = pid * FB + tl.arange(0, FB)
            rm = rows < R
            amax = tl.zeros([FB], tl.float32)
            for p0 in range(0, n_rpart, BP):
                ps = p0 + tl.arange(0, BP)
                t = tl.load(rpart_ptr + ps.to(tl.int64)[:, None] * R + rows[None, :],
                            mask=(ps < n_rpart)[:, None] & rm[None, :], other=0.0)
                amax = tl.maximum(amax, tl.max(t.to(tl.float32), 0))
            scale = _scale_of(amax, FP8_MAX_R, POW2)
            tl.store(rscale_ptr + rows, scale, mask=rm)
            tl.store(rinv_ptr + rows, tl.div_rn(tl.full([FB], 1.0, tl.float32), scale), mask=rm)
    if COL_PER:
        if pid >= n_row_prog:
            cols = (pid - n_row_prog) * FBC + tl.arange(0, FBC)
            cm = cols < C
            scale = _scale_of(_column_amax(cpart_ptr, n_cpart, C, cols, cm, BPC, FBC), FP8_MAX_C, POW2)
            tl.store(cscale_ptr + cols, scale, mask=cm)
            tl.store(cinv_ptr + cols, tl.div_rn(tl.full([FBC], 1.0, tl.float32), scale), mask=cm)


@triton.jit
def dual_cast_kernel(x_ptr, yr_ptr, yt_ptr, rscale_ptr, cscale_ptr, tamax_ptr, rinv_ptr, cinv_ptr, R, R_pad, C,
                     stride_xr, ROW_PER: tl.constexpr, COL_PER: tl.constexpr, FP8_MAX_R: tl.constexpr,
                     FP8_MAX_C: tl.constexpr, POW2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Tile ``(pr, pc)`` of ``x [R, C]`` read once, cast twice: with its rows' scales (``ROW_PER``) or
    the tensor's to ``yr [R, C]`` row-major, with its columns' scales (``COL_PER``) or the tensor's to
    ``yt [C, R_pad]`` (rows ``R..R_pad`` of x as zeros: the GEMM's inner dimension padded). The tensor's
    scale from its amax (``tamax``: fp32 or x's dtype), its reciprocal written by program (0, 0)."""
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    rm, cm = rows < R, cols < C
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if ROW_PER:
        rs = tl.load(rscale_ptr + rows, mask=rm, other=1.0)[:, None]
    else:
        rs = _scale_of(tl.load(tamax_ptr).to(tl.float32), FP8_MAX_R, POW2)
        if (pr == 0) & (pc == 0):
            tl.store(rinv_ptr, tl.div_rn(1.0, rs))
    yr = tl.clamp(x * rs, -FP8_MAX_R, FP8_MAX_R).to(yr_ptr.dtype.element_ty)
    tl.store(yr_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], yr, mask=m)
    if COL_PER:
        cs = tl.load(cscale_ptr + cols, mask=cm, other=1.0)[None, :]
    else:
        cs = _scale_of(tl.load(tamax_ptr).to(tl.float32), FP8_MAX_C, POW2)
        if (pr == 0) & (pc == 0):
            tl.store(cinv_ptr, tl.div_rn(1.0, cs))
    yt = tl.clamp(x * cs, -FP8_MAX_C, FP8_MAX_C).to(yt_ptr.dtype.element_ty)
    mt = cm[:, None] & (rows < R_pad)[None, :]
    tl.store(yt_ptr + cols.to(tl.int64)[:, None] * R_pad + rows[None, :], tl.trans(yt), mask=mt)
