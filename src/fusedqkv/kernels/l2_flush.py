"""A uniquely named kernel that overwrites a buffer twice the size of L2.

The benchmark harness flushes L2 before every timed iteration the way the official
harness does (zeroing a 2x-L2 buffer); a kernel of our own, rather than ``zero_()``,
lets the kernel-span timer find the iteration boundaries in a profiler trace by name.
"""

import triton
import triton.language as tl


@triton.jit
def l2_flush_kernel(buf_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(buf_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)
