"""The GEMMs of the paths that run on the CPU: half-precision operands multiplied in fp32, each
result rounded once to the operands' dtype.

torch's CPU bf16/fp16 GEMM is fast only with AVX-512 BF16 or AMX. Without them (an AVX2-only
x86 host) it falls back to scalar loops for some layouts: ``a @ w`` at 128x6144x4096 took 23 s
there, against 0.13 s in fp32 (benchmarks/NOTES.md, session 16). It accumulates in fp32 anyway,
so the fp32 product of the widened operands, rounded once, keeps the rounding point: one
rounding of an fp32 sum to the result dtype. CUDA tensors and fp32/fp64 operands go to torch as
they are.
"""

from __future__ import annotations

from typing import Optional

import torch

HALF = (torch.bfloat16, torch.float16)


def _widened(a: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.dtype in HALF


def mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` (into ``out`` when given, which may be strided)."""
    if not _widened(a):
        if out is None:
            return torch.mm(a, b)
        if out.is_contiguous():
            return torch.mm(a, b, out=out)
        out.copy_(torch.mm(a, b))  # cuBLAS writes contiguous memory
        return out
    r = torch.mm(a.float(), b.float())
    if out is None:
        return r.to(a.dtype)
    return out.copy_(r)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bias + a @ b``, the bias added before the one rounding (as a half-precision addmm does)."""
    if not _widened(a):
        return torch.addmm(bias, a, b)
    return torch.addmm(bias.float(), a.float(), b.float()).to(a.dtype)
