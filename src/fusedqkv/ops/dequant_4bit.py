"""bitsandbytes NF4 weights dequantized into one buffer in one launch (:mod:`fusedqkv.kernels.dequant_4bit`).

QLoRA's fused forward and backward each rebuild the fused ``[Q | K | V]`` weight from the three 4-bit
projections (:class:`fusedqkv.integrations.qlora.DequantizedQKV`). bitsandbytes' ``dequantize_4bit``
does it one projection a call, each call ~40-50 us of Python and dispatch on the H200's host
(session 23's profile), which a host-bound QLoRA step pays six times a layer. :class:`Dequant4bit`
is that work for up to four parts as one bound launch: planned once per geometry (the parts' value
counts, blocksize, output dtype), a call writes only the addresses. It takes NF4 parts with an fp32
absmax (the kept one of a double-quantized weight, or a plain one) and computes what bitsandbytes'
CUDA kernel computes for them, bitwise (``code[nibble] * absmax`` in fp32, rounded once); FP4 and
anything else stay with bitsandbytes' own function.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import INTERPRET
from .launch import BoundLaunch, Table

BYTES_PER_PROGRAM = 1024  # packed bytes (2048 values) per program
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' 4-bit blocksizes
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(values: Sequence[int], blocksize: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """None where :class:`Dequant4bit` takes parts of these value counts, else why not."""
    from ..kernels.dequant_4bit import MAX_PARTS

    if device.type != "cuda" and not INTERPRET:
        return "not a CUDA device"
    if not 1 <= len(values) <= MAX_PARTS:
        return f"{len(values)} parts; at most {MAX_PARTS}"
    if any(n <= 0 or n % 2 for n in values):
        return f"value counts {list(values)}: each must be even and positive (two values a byte)"
    if blocksize not in BLOCKSIZES:
        return f"blocksize {blocksize}"
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    return None


class Dequant4bit:
    """One launch dequantizing ``len(values)`` NF4 parts into consecutive stretches of a buffer:
    part ``p`` (``values[p]`` values) at element offset ``sum(values[:p])``. Planned from the tensors
    of a first call (their dtypes; nothing of them is kept)."""

    def __init__(self, values: Sequence[int], blocksize: int, dtype: torch.dtype, device: torch.device):
        why = supported(values, blocksize, dtype, device)
        if why is not None:
            raise ValueError(f"Dequant4bit: {why}")
        from ..kernels.dequant_4bit import MAX_PARTS, dequant_4bit_kernel

        self.values, self.blocksize, self.dtype, self.device = list(values), blocksize, dtype, device
        self.total = sum(values)
        table = Table()
        out = table.add("out", torch.empty((0,), dtype=dtype, device=device))
        code = table.add("code", torch.empty((0,), dtype=torch.float32, device=device))
        packed = torch.empty((0,), dtype=torch.uint8, device=device)
        absmax = torch.empty((0,), dtype=torch.float32, device=device)
        args, off = [out, code], 0
        slots = []
        for p in range(MAX_PARTS):
            if p < len(values):
                q, a = table.add(f"q{p}", packed), table.add(f"a{p}", absmax)
                slots.append((q, a))
                args += [q, a, values[p] // 2, off]
                off += values[p]
            else:  # placeholders the kernel never reads (N_PARTS)
                args += [slots[0][0], slots[0][1], 0, 0]
        table.release()
        chunks = -(-max(values) // 2 // BYTES_PER_PROGRAM)
        self.launch = BoundLaunch(dequant_4bit_kernel, (chunks, len(values)), args,
                                  dict(N_PARTS=len(values), BLOCKSIZE=blocksize, BYTES=BYTES_PER_PROGRAM,
                                       num_warps=4))

    def __call__(self, out: torch.Tensor, code: torch.Tensor, packed: Sequence[torch.Tensor],
                 absmax: Sequence[torch.Tensor], stream: int) -> None:
        """Dequantize ``packed[p]`` (uint8, ``values[p] / 2`` bytes) with ``absmax[p]`` (fp32, one per
        ``blocksize`` values) and the 16-entry fp32 ``code`` into ``out`` (contiguous, ``total``
        values of the plan's dtype). The caller checks the operands once per state (``check``)."""
        launch = self.launch
        if launch.bound:
            ptrs = [out.data_ptr(), code.data_ptr()]
            for q, a in zip(packed, absmax):
                ptrs += [q.data_ptr(), a.data_ptr()]
            launch.launch(None, ptrs, stream)
        else:
            tensors = [out, code]
            for q, a in zip(packed, absmax):
                tensors += [q, a]
            launch.launch(tensors, None, stream)

    def check(self, out: torch.Tensor, code: torch.Tensor, packed: Sequence[torch.Tensor],
              absmax: Sequence[torch.Tensor]) -> None:
        """Raise ValueError naming the operand that does not fit the plan."""
        want = self.device

        def elsewhere(d: torch.device) -> bool:  # "cuda" stands for the current device, as torch places it
            return d.type != want.type or (want.index is not None and d.index != want.index)

        def bad(name, t, dtype, numel):
            if t.dtype != dtype or elsewhere(t.device) or not t.is_contiguous() or t.numel() < numel:
                raise ValueError(f"Dequant4bit: {name}: expected a contiguous {dtype} tensor of at least {numel} "
                                 f"elements on {self.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        bad("out", out, self.dtype, self.total)
        bad("code", code, torch.float32, 16)
        if len(packed) != len(self.values) or len(absmax) != len(self.values):
            raise ValueError(f"Dequant4bit: expected {len(self.values)} packed weights and absmax, got "
                             f"{len(packed)} and {len(absmax)}")
        for p, (q, a, n) in enumerate(zip(packed, absmax, self.values)):
            bad(f"packed[{p}]", q, torch.uint8, n // 2)
            bad(f"absmax[{p}]", a, torch.float32, -(-n // self.blocksize))
