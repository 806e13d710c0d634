"""Launcher of the Hopper forward GEMM with RoPE + RMSNorm in its epilogue
(:mod:`fusedqkv.kernels.qkv_rope_norm_gemm_sm90`, Gluon).

``fused_gemm_unsupported`` says why a call cannot take it (None when it can); ``FusedGemmForward``
holds the launch of one plan: its tile config, layouts and grid decided once; per call only the
tensor descriptors (they carry the addresses) are made.
"""

from __future__ import annotations

import torch

TILE = dict(BM=128, BK=64, GROUP_M=8, STAGES=5, RC=32)
CONSUMER_REGS, PRODUCER_REGS = 240, 24
# 4 default warps + a 4-warp consumer + a 1-warp producer, padded to 12 warps: maxnreg x 12 x 32 <= 65536.
# setmaxnreg then gives each consumer 240 registers and the producer 24.
MAXNREG = 168


def fused_gemm_unsupported(x, w, head_dim: int, rot: int, variant, bias, device_capability) -> str | None:
    """Why the fused forward GEMM cannot run this call (None: it can)."""
    if device_capability != (9, 0):
        return "needs an sm_90 GPU (wgmma, TMA)"
    if head_dim != 128:
        return "head_dim must be 128 (one head per 128-column tile)"
    if rot != head_dim:
        return "partial rotary"
    if variant.q_gate or variant.interleaved or variant.all_heads or variant.v_norm:
        return "variant other than the plain per-head block"
    if bias is not None:
        return "qkv_bias"
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return "dtype other than bf16/fp16"
    if x.shape[-1] % 8:
        return "hidden size not a multiple of 8 (TMA rows of 16 bytes)"
    return None


def _gl_dtype(dtype):
    from triton.experimental.gluon import language as gl
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def layouts(dtype, BM: int, BN: int, BK: int):
    """(x tile, W tile, output half-tile) shared layouts (128-byte swizzle)."""
    from triton.experimental.gluon import language as gl
    t = _gl_dtype(dtype)
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], t), gl.NVMMASharedLayout.get_default_for([BN, BK], t),
            gl.NVMMASharedLayout.get_default_for([BM, BN // 2], t))


class FusedGemmForward:
    """The fused forward of one plan: ``run(x2d, w, qkv2d, q2d, k2d, wq, wk, rq, rk, cos, sin)``."""

    def __init__(self, M: int, N: int, K: int, S: int, hq: int, hkv: int, D: int, eps: float,
                 norm_after_rope: bool, norm_weight: bool, dtype, device, fuse: bool = True, **tile):
        from ..kernels.qkv_rope_norm_gemm_sm90 import qkv_rope_norm_gemm_sm90_kernel
        self.kernel = qkv_rope_norm_gemm_sm90_kernel
        self.M, self.N, self.K, self.S, self.hq, self.hkv, self.D, self.eps = M, N, K, S, hq, hkv, D, float(eps)
        self.tile = dict(TILE, **tile)
        BM, BK = self.tile["BM"], self.tile["BK"]
        self.x_l, self.w_l, self.o_l = layouts(dtype, BM, D, BK)
        n_tiles = -(-M // BM) * (N // D)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.grid = (max(1, min(sms, -(-n_tiles // 2))), )  # two consumers per program
        self.constexprs = dict(BM=BM, BN=D, BK=BK, GROUP_M=self.tile["GROUP_M"], STAGES=self.tile["STAGES"],
                               FUSE=fuse, NORM_AFTER_ROPE=norm_after_rope, NORM_WEIGHT=norm_weight, RC=self.tile["RC"],
                               CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)

    def run(self, x2d, w, qkv2d, q2d, k2d, wq, wk, rq, rk, cos, sin):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as TD
        BM, BK, D = self.tile["BM"], self.tile["BK"], self.D
        half = [BM, D // 2]
        x_d = TD.from_tensor(x2d, [BM, BK], self.x_l)
        w_d = TD.from_tensor(w, [D, BK], self.w_l)
        qkv_d = TD.from_tensor(qkv2d, half, self.o_l)
        q_d = TD.from_tensor(q2d, half, self.o_l)
        k_d = TD.from_tensor(k2d, half, self.o_l)
        wq = q2d if wq is None else wq
        wk = q2d if wk is None else wk
        self.kernel[self.grid](
            x_d, w_d, qkv_d, q_d, k_d, wq, wq.stride(0) if wq.dim() == 1 else 1, wk,
            wk.stride(0) if wk.dim() == 1 else 1, rq, *rq.stride(), rk, *rk.stride(), cos, *cos.stride(), sin,
            *sin.stride(), self.eps, self.M, self.N, self.K, self.S, self.hq, self.hkv, **self.constexprs,
            num_warps=4, maxnreg=MAXNREG)
