"""MXFP8 cast of a GEMM operand: e4m3 codes with one e8m0 scale per 32 values along the GEMM's inner
dimension, scaled as torchao's ``to_mx`` scales them: ``ScaleCalculationMode.FLOOR`` (recipe ``mxfp8``)
or ``RCEIL`` (``mxfp8_rceil``).

FLOOR: a block's scale is ``2^(floor(log2(amax)) - 8)`` (8: e4m3's largest power of two), its exponent
clamped to e8m0's range; an all-zero block gets the smallest (code 0) and is cast with 2^-126, as
torchao does. RCEIL: ``2^ceil(log2(amax / 448))``, the exponent clamped to [-127, 127]; found exactly
from amax's bits (its exponent, plus one where its mantissa is above 448's), where torchao's CPU path
takes a float log2 of a rounded quotient (one code low for some amaxes just above 448 * 2^k: NOTES,
session 26). Code 0 casts with 1/scale 1.0 and an infinite amax gets code 254 (1/scale 2^-127), as
torchao's RCEIL does. The data is ``clamp(x / scale, -448, 448)`` rounded to nearest even. A block with
a NaN gets code 255 in both modes (its data NaN where torchao's is).

* ``mx_cast_kernel``: the operand ``A [R, C]`` read through strides (``A = t`` or a transposed view
  ``t^T``: the dW GEMM's operands, blocked over the tokens), codes row-major ``[R, C_pad]`` (columns
  ``C..C_pad`` zeros), scales straight into cuBLAS's blocked layout for ``torch._scaled_mm``: the
  scale matrix ``[R, C_pad / 32]`` zero-padded to 128 rows x 4 columns, each such tile stored as
  ``32 x 16`` bytes (row ``r`` of the tile at ``(r % 32) * 16 + (r // 32) * 4``). One read of A.
"""

import triton
import triton.language as tl

MX_BLOCK = 32


@triton.jit
def _e4m3_code(y):
    """The e4m3 code (an int32 in 0..255) of fp32 ``y`` (|y| <= 448), rounded to nearest even, from
    integer steps: the interpreter's fp8 casts do not round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    # normal codes (a >= 2^-6): the mantissa rounded to 3 bits, the exponent rebiased 127 -> 7
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20
    normal = r - ((127 - 7) << 3)
    # subnormal codes (a < 2^-6): a / 2^-9 rounded to nearest even (2^23: fp32's integer step 1)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    return tl.where(y != y, 0x7F, code | sign)


@triton.jit
def mx_cast_kernel(x_ptr, y_ptr, s_ptr, R, C, C_pad, stride_xr, stride_xc, n_scale_cols,
                   FP8_MAX: tl.constexpr, SOFT_ROUND: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                   RCEIL: tl.constexpr = False):
    """Program ``(i, j)``: rows ``i*BR..`` and columns ``j*BC..`` of ``A`` (``BC`` a multiple of 128, so
    that the programs write every padded scale once); ``y``: uint8 codes ``[R, C_pad]``; ``s``: uint8
    e8m0 codes, blocked (``n_scale_cols``: the scale matrix's columns padded to 4). ``SOFT_ROUND``:
    the codes from integer steps (the interpreter), else the hardware's cast. ``RCEIL``: torchao's
    RCEIL scales (exact), else FLOOR."""
    NB: tl.constexpr = BC // 32
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols.to(tl.int64)[None, :] * stride_xc,
                mask=m, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, [BR, NB, 32])
    # amax as the max of |x|'s bit patterns: integers order non-negative floats as floats do and keep
    # a NaN (its pattern is above inf's), which a float max drops (on the GPU and in the interpreter)
    bits = tl.max(x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 2)
    nan = bits > 0x7F800000
    if RCEIL:
        # ceil(log2(amax / 448)) exactly: amax = 1.m * 2^E, 448 = 1.75 * 2^8, so E - 8, plus one where
        # 1.m > 1.75 (mantissa bits above 0x600000); +127 bias, clamped to 0..254; inf 254
        e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, 0), 254)
        e = tl.where(bits == 0x7F800000, 254, e)
        # 1 / scale = 2^(127 - e) exactly; torchao's 1.0 for e == 0 and 2^-127 for e == 254, the latter
        # as 2^-126 * 0.5 (two normal factors: a subnormal constant could be flushed to zero)
        inv = (tl.where(e == 0, 127, tl.where(e == 254, 1, 254 - e)) << 23).to(tl.float32, bitcast=True)
        inv = tl.where(nan, float("nan"), inv)  # torchao's NaN block: NaN data throughout
        y = x3 * inv[:, :, None]
        y = tl.where((e == 254)[:, :, None], y * 0.5, y)
    else:
        # e8m0 code: amax's exponent field less 8, clamped to 0..255 (torchao's clamp of the unbiased
        # exponent to [-127, 128])
        e = tl.minimum(tl.maximum((bits >> 23) - 8, 0), 255)
        # 1 / scale, exactly: 2^(127 - e), the scale floored at 2^-126 for e == 0 (0.0 for a NaN block:
        # torchao divides by an infinite scale, so zeros but for NaN and inf)
        inv = (tl.maximum(tl.where(e == 0, 253, 254 - e), 0) << 23).to(tl.float32, bitcast=True)
        inv = tl.where(nan, 0.0, inv)
        y = x3 * inv[:, :, None]
    e = tl.where(nan, 255, e)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)  # (the default maps NaN to a bound)
    y = tl.reshape(y, [BR, BC])
    if SOFT_ROUND:
        code = _e4m3_code(y).to(tl.uint8)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C_pad + cols[None, :], code,
             mask=(rows < R)[:, None] & (cols < C_pad)[None, :])
    # the blocked layout: tile (rows // 128, blocks // 4) of 512 bytes
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    tile = (rows // 128)[:, None] * (n_scale_cols // 4) + (blocks // 4)[None, :]
    within = ((rows % 32) * 16 + ((rows % 128) // 32) * 4)[:, None] + (blocks % 4)[None, :]
    tl.store(s_ptr + tile.to(tl.int64) * 512 + within, e.to(tl.uint8))
