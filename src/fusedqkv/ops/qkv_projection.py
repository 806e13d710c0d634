"""Launcher of the training forward in one launch: the QKV projection GEMM with RoPE + RMSNorm
in its epilogue (:mod:`fusedqkv.kernels.qkv_projection_fwd`), and the plan-time choice between
it and cuBLAS + the forward stage.

``fused_gemm_supported`` says whether the kernel can run a block at all (Hopper or newer,
16-bit dtypes, head_dim a tile width, a rotary width the tile can rotate, operands TMA can
address, no norm over all heads); ``fused_gemm_wanted`` whether the plan takes it, from the
measurements in benchmarks/NOTES.md ("Session 11").
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import INTERPRET, Config
from .device import capability, sm_count
from .launch import BoundLaunch, Desc, Ptr
from .plan_cache import as_matrix
from .variant import Variant

try:  # Triton is a dependency on Linux only
    from ..kernels.qkv_projection_fwd import qkv_rope_norm_gemm_kernel
except ImportError:  # pragma: no cover
    qkv_rope_norm_gemm_kernel = None

def tile_config(M: int, N: int, K: int, D: int, cfg: Config) -> tuple:
    """(BM, BK, warps, stages, GROUP_M, programs per SM) of the fused GEMM: one head per tile column."""
    if cfg.fused_gemm_tile is not None:
        return cfg.fused_gemm_tile
    if D > 128:
        return (64, 64, 8, 3, 8, 1)
    return (128, 64, 8, 4, 8, 1)


def _p2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported_variant(D: int, rot: int, variant: Variant) -> Optional[str]:
    """None where the fused GEMM's epilogue can do this head shape and variant, else why not."""
    half, tail = rot // 2, D - rot
    if variant.all_heads:
        return "a norm over all heads needs every head tile of a row"
    if variant.interleaved:
        return "interleaved RoPE pairs are not the accumulators' halves"
    if not (_p2(half) and half >= 16 and half <= 128):
        return f"half the rotary width ({half}) is no tile width (a power of two from 16 to 128)"
    if tail and not (_p2(tail) and tail >= 16):
        return f"the unrotated tail ({tail} of head_dim {D}) is no tile width (a power of two from 16)"
    return None


def fused_gemm_supported(x: torch.Tensor, w: torch.Tensor, D: int, rot: int, variant: Variant) -> Optional[str]:
    """None where the fused GEMM can run this block, else why not (for the plan's record)."""
    if qkv_rope_norm_gemm_kernel is None:
        return "no Triton"
    if x.device.type != "cuda" and not INTERPRET:
        return "not on CUDA"
    if x.device.type == "cuda" and capability(x.device)[0] < 9:
        return "TMA and wgmma need sm_90 or newer"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (16-bit only)"
    why = supported_variant(D, rot, variant)
    if why:
        return why
    es = x.element_size()
    K = x.shape[-1]
    xm = as_matrix(x, -1, K)
    if xm is None or xm.stride(1) != 1 or (xm.stride(0) * es) % 16 or w.stride(1) != 1 or (w.stride(0) * es) % 16 \
            or x.data_ptr() % 16 or w.data_ptr() % 16:
        return "operands TMA cannot address (unit last stride, 16-byte aligned rows and base)"
    return None


def fused_gemm_wanted(M: int, cfg: Config) -> bool:
    """Whether a supported block takes the fused GEMM (the config's switch; NOTES "Session 11")."""
    if cfg.fused_gemm == "off":
        return False
    if cfg.fused_gemm == "on":
        return True
    return M >= cfg.fused_gemm_min_tokens and not INTERPRET


def plan_fused_forward(x: Ptr, w: Ptr, qkv: Ptr, q: Ptr, k: Ptr, v: Optional[Ptr], bias: Optional[Ptr],
                       wq: Optional[Ptr], wk: Optional[Ptr], cos: Ptr, sin: Ptr, rq: Ptr, rk: Ptr,
                       hq: int, hkv: int, D: int, eps: float, norm_after_rope: bool, variant: Variant,
                       cfg: Config, epilogue: bool = True) -> BoundLaunch:
    """The fused forward's launch over table slots: ``x`` ``[B, S, K]`` (viewable as ``[M, K]``,
    ``fused_gemm_supported``), ``w`` ``[N, K]``, ``qkv`` ``[B, S, N]``, q/k (and v with ``variant.v_norm``)
    ``[B, H, S, D]`` token-major, rstd ``[B, H, S]``, cos/sin ``[B, S, rot]`` (expanded views
    allowed). ``epilogue`` off: the plain GEMM into ``qkv`` (benchmarks)."""
    xm = as_matrix(x.like, -1, x.like.shape[-1])
    M, K = xm.shape
    N = w.like.shape[0]
    S = qkv.like.shape[1]
    bm, bk, num_warps, num_stages, group_m, per_sm = tile_config(M, N, K, D, cfg)
    n_tiles = -(-M // bm) * (N // D)
    sms = sm_count(x.like.device) if x.like.device.type == "cuda" else 4
    nprog = max(1, min(per_sm * sms, n_tiles))

    def heads(t: Ptr) -> tuple:  # [B, H, S, D] with unit last stride: pointer and (b, h, s) strides
        assert t.like.stride(3) == 1, "q/k/v need a unit last stride"
        return (t, *t.like.stride()[:3])

    rot = cos.like.shape[-1]
    half, tail = rot // 2, D - rot
    if wq is None:  # unweighted: placeholders never read
        wq = wk = cos
        w_strides = (0, 0)
    else:
        w_strides = (wq.like.stride(0), wk.like.stride(0))
    return BoundLaunch(
        qkv_rope_norm_gemm_kernel, (nprog,),
        (Desc(x, [bm, bk], shape=[M, K], strides=list(xm.stride())), Desc(w, [half, bk]),
         Desc(w, [tail or 16, bk]), Desc(qkv, [bm, half], shape=[M, N], strides=[N, 1]),
         Desc(qkv, [bm, tail or 16], shape=[M, N], strides=[N, 1]),
         *heads(q), *heads(k), *heads(v if v is not None else k),
         bias if bias is not None else cos,
         wq, w_strides[0], wk, w_strides[1],
         cos, *cos.like.stride(), sin, *sin.like.stride(),
         rq, *rq.like.stride(), rk, *rk.like.stride(),
         float(eps), M, N, K, S, hq, hkv),
        dict(BM=bm, BK=bk, D=D, HALF=half, PASS=tail, GROUP_M=group_m, NPROG=nprog,
             NORM_AFTER_ROPE=bool(norm_after_rope), NORM_WEIGHT=variant.norm_weight, Q_GATE=variant.q_gate,
             V_NORM=variant.v_norm, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
             num_warps=num_warps, num_stages=num_stages),
    )
