"""bitsandbytes NF4 weights dequantized into one buffer in one launch (``ops/dequant_4bit.py``).

Up to four parts, each a 4-bit weight as bitsandbytes packs it: two values a byte, the high
nibble first, in the row-major order of the weight, ``BLOCKSIZE`` consecutive values sharing one
fp32 absmax. Value ``e`` of a part is ``code[nibble] * absmax[e // BLOCKSIZE]`` in fp32, rounded
once to the output's dtype: what bitsandbytes' ``kDequantizeBlockwise`` computes for NF4. Part
``p``'s values go to ``out + off_p`` (its rows of the fused weight), contiguous. Grid: (chunks of
``BYTES`` packed bytes of the largest part, parts).
"""

import triton
import triton.language as tl

MAX_PARTS = 4


@triton.jit
def _dequant_part(q_ptr, absmax_ptr, code_ptr, out_ptr, n_bytes, chunk, BLOCKSIZE: tl.constexpr,
                  BYTES: tl.constexpr):
    j = chunk * BYTES + tl.arange(0, BYTES)  # this program's packed bytes of the part
    mask = j < n_bytes
    b = tl.load(q_ptr + j, mask=mask, other=0).to(tl.int32)
    # both values of a byte share a block (BLOCKSIZE is even)
    am = tl.load(absmax_ptr + (2 * j) // BLOCKSIZE, mask=mask, other=0.0)
    hi = tl.load(code_ptr + (b >> 4)) * am
    lo = tl.load(code_ptr + (b & 15)) * am
    v = tl.reshape(tl.join(hi, lo), [2 * BYTES])  # value 2j the high nibble's, 2j + 1 the low one's
    e = chunk * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + e, v.to(out_ptr.dtype.element_ty), mask=e < 2 * n_bytes)


@triton.jit
def dequant_4bit_kernel(out_ptr, code_ptr,
                        q0_ptr, a0_ptr, n0, off0, q1_ptr, a1_ptr, n1, off1,
                        q2_ptr, a2_ptr, n2, off2, q3_ptr, a3_ptr, n3, off3,
                        N_PARTS: tl.constexpr, BLOCKSIZE: tl.constexpr, BYTES: tl.constexpr):
    chunk = tl.program_id(0)
    part = tl.program_id(1)
    if part == 0:
        if chunk * BYTES < n0:
            _dequant_part(q0_ptr, a0_ptr, code_ptr, out_ptr + off0, n0, chunk, BLOCKSIZE, BYTES)
    if N_PARTS > 1:
        if part == 1:
            if chunk * BYTES < n1:
                _dequant_part(q1_ptr, a1_ptr, code_ptr, out_ptr + off1, n1, chunk, BLOCKSIZE, BYTES)
    if N_PARTS > 2:
        if part == 2:
            if chunk * BYTES < n2:
                _dequant_part(q2_ptr, a2_ptr, code_ptr, out_ptr + off2, n2, chunk, BLOCKSIZE, BYTES)
    if N_PARTS > 3:
        if part == 3:
            if chunk * BYTES < n3:
                _dequant_part(q3_ptr, a3_ptr, code_ptr, out_ptr + off3, n3, chunk, BLOCKSIZE, BYTES)
