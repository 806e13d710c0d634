"""Launcher of the Hopper forward GEMM with RoPE + RMSNorm in its epilogue
(:mod:`fusedqkv.kernels.qkv_rope_norm_gemm_sm90`, Gluon).

``plan_fused_forward`` decides at plan time whether the training forward takes it (the variant,
the device, Triton's Gluon gate, and the shape: where each consumer warpgroup gets fewer than
``config.fused_forward_min_rounds`` tiles, cuBLAS + the forward stage is faster -- NOTES, session
13; with LoRA adapters, ``config.fused_forward_lora_min_rounds``, session 22);
``fused_gemm_unsupported`` says why a call cannot take it. FP8 plans (``recipe``: issue 35, session
23) take the kernel's FP8 build under the same rules: its GEMM on the casts of x and W the split path
makes (e4m3 codes, K-major), their inverse scales applied to the accumulator in the epilogue
(:func:`fp8_scales`; ``config.fused_forward_fp8``: "auto" takes it for tensorwise recipes only --
rowwise measured 1.01-1.03x the split path, session 23 -- "off" never). ``FusedGemmForward`` holds
the launch of one plan: tile config, layouts and grid decided once; its ``bound_launch`` fixes every
argument but the addresses, and after the first launch calls the compiled kernel's launcher
directly (``ops/launch.py``), re-encoding a descriptor only when its tensor moved.
"""

from __future__ import annotations

import math

import torch

TILE = dict(BM=128, BK=64, GROUP_M=8, STAGES=5, RC=32)
# FP8 operands (one byte each): twice the K step, the same 16 KB per operand tile and ring stage
FP8_BK = 128
CONSUMER_REGS, PRODUCER_REGS = 240, 24
# 4 default warps + a 4-warp consumer + a 1-warp producer, padded to 12 warps: maxnreg x 12 x 32 <= 65536.
# setmaxnreg then gives each consumer 240 registers and the producer 24.
MAXNREG = 168
# the call tensors of a launch (``FusedGemmForward.bound_launch``): x and W as matrices, qkv, q and k as
# token-major [tokens, heads * head_dim] matrices, the norm weights (absent where unweighted), rstd, cos/sin
ENTRIES = ("x", "w", "qkv", "q", "k", "q_norm_weight", "k_norm_weight", "rstd_q", "rstd_k", "cos", "sin")
# with LoRA adapters in the GEMM (``FusedGemmForward(lora=True)``): their U and B (``ops/lora.LoRAUpdate.gemm_operands``)
LORA_ENTRIES = ENTRIES + ("u", "b")
# with FP8 operands (``FusedGemmForward(scales=...)``): x and w are the e4m3 casts, these their inverse scales
FP8_ENTRIES = ENTRIES + ("x_scale", "w_scale")


def call_entries(out_dims, x, w, qkv, q, k, wq, wk, rq, rk, cos, sin) -> dict:
    """A launch's call tensors by :data:`ENTRIES` name from the block's (``out_dims``: ``forward_outputs``'
    batch, seq, query heads, key/value heads, head_dim; ``q``/``k`` its token-major ``[B, H, S, D]``
    views; ``wq``/``wk`` None where unweighted)."""
    b, s, hq, hkv, d = out_dims
    named = dict(x=x.view(b * s, -1), w=w, qkv=qkv.view(b * s, -1), q=q.transpose(1, 2).view(b * s, hq * d),
                 k=k.transpose(1, 2).view(b * s, hkv * d), rstd_q=rq, rstd_k=rk, cos=cos, sin=sin)
    if wq is not None:
        named.update(q_norm_weight=wq, k_norm_weight=wk)
    return named


def fp8_scales(r) -> int:
    """The kernel's ``SCALES`` for FP8 recipe ``r``'s forward GEMM: 1 where x is scaled per token and W per
    output column (rowwise), 2 where each by one scale (tensorwise); 0 where the kernel cannot give
    ``fp8._mm``'s values (:func:`fp8_unsupported`)."""
    if fp8_unsupported(r) is not None:
        return 0
    return 2 if r.input.tensorwise else 1


def fp8_unsupported(r) -> str | None:
    """Why FP8 recipe ``r``'s forward GEMM cannot run in the kernel (None: it can). The kernel's wgmma
    accumulates in its own fp32 registers (fast accumulation) and scales the accumulator once: what
    ``fp8._mm`` runs for a forward with fast accumulation and both scales of one granularity. Without
    fast accumulation ``_scaled_mm`` promotes partial sums (and rowwise scales without powers of two are
    applied after a first rounding, ``fp8._outer_scale``); a mixed granularity repeats the scalar."""
    from . import fp8
    if r.mx:
        return "MX block scales (mxfp8, mxfp8_rceil: Blackwell's block-scaled GEMMs; the kernel is sm_90's wgmma)"
    if r.input.dtype != fp8.E4M3 or r.weight.dtype != fp8.E4M3:
        return "FP8 operands other than e4m3"
    if not r.fast_accum[0]:
        return "a forward GEMM without fast accumulation"
    if r.input.tensorwise != r.weight.tensorwise:
        return "x and W scaled with different granularities"
    return None


def fused_gemm_unsupported(x, w, head_dim: int, rot: int, variant, bias, device_capability,
                           recipe=None) -> str | None:
    """Why the fused forward GEMM cannot run this call (None: it can); ``recipe``: the FP8 recipe of an
    FP8 plan (its forward's operands the casts of x and W; bf16 activations only, as ``fp8._mm``
    rounds a rowwise GEMM to bf16 whatever the activations' dtype)."""
    if device_capability != (9, 0):
        return "needs an sm_90 GPU (wgmma, TMA)"
    if head_dim != 128:
        return "head_dim must be 128 (one head per 128-column tile)"
    if rot != head_dim:
        return "partial rotary"
    if variant.q_gate or variant.interleaved or variant.all_heads or variant.v_norm or variant.k_eq_v:
        return "variant other than the plain per-head block"
    if bias is not None:
        return "qkv_bias"
    if recipe is not None:
        if x.dtype != torch.bfloat16 or w.dtype != x.dtype:
            return "FP8 with activations other than bf16"
        return fp8_unsupported(recipe)  # (hidden and qkv rows multiples of 16: fp8.check_supported)
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return "dtype other than bf16/fp16"
    if x.shape[-1] % 8:
        return "hidden size not a multiple of 8 (TMA rows of 16 bytes)"
    return None


def consumer_rounds(M: int, N: int, D: int, sms: int, BM: int = TILE["BM"]) -> float:
    """Tiles per consumer warpgroup: the output tiles over two consumers per SM."""
    return (-(-M // BM) * (N // D)) / (2 * sms)


def plan_fused_forward(sz: dict, x, w, bias, cfg, small=(), lora: bool = False,
                       recipe=None) -> "FusedGemmForward | None":
    """The fused forward of a plan, or None (cuBLAS + the stage). ``sz``: the validated sizes;
    ``small``: cos, sin and the norm weights (None where absent), which must have unit last strides
    (the epilogue spills with other strides: offline ptxas, NOTES session 13); ``lora``: the
    kernel that takes LoRA adapters' U and B as more inner columns (the calls' ranks decide the
    rest: :meth:`FusedGemmForward.bound_launch`); ``recipe``: an FP8 plan's recipe (its FP8 build,
    where ``cfg.fused_forward_fp8`` takes it -- "auto": tensorwise recipes; none with ``lora``), the same
    rules otherwise."""
    from . import internals
    from .plan_cache import as_matrix
    device = sz["device"]
    if cfg.fused_forward == "off" or device.type != "cuda":
        return None
    if recipe is not None and (lora or cfg.fused_forward_fp8 == "off"
                               or (cfg.fused_forward_fp8 == "auto" and not recipe.input.tensorwise)):
        return None
    capability = torch.cuda.get_device_capability(device)
    if fused_gemm_unsupported(x, w, sz["head_dim"], sz["rot"], sz["variant"], bias, capability, recipe):
        return None
    M, N, D = sz["batch"] * sz["seq"], sz["qkv"], sz["head_dim"]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    min_rounds = cfg.fused_forward_lora_min_rounds if lora else cfg.fused_forward_min_rounds
    if cfg.fused_forward == "auto" and consumer_rounds(M, N, D, sms) < min_rounds:
        return None
    if any(t is not None and t.stride(-1) != 1 for t in small):
        return None
    x2d = as_matrix(x, M, sz["hidden"])
    if recipe is None and (x2d is None or x2d.stride(1) != 1 or (x2d.stride(0) * x.element_size()) % 16
                           or x.data_ptr() % 16 or w.stride(1) != 1 or (w.stride(0) * w.element_size()) % 16
                           or w.data_ptr() % 16):
        return None  # TMA needs 16-byte aligned rows (FP8: the casts' contiguous codes, whatever x's layout)
    if internals.gluon_gate(instead="cuBLAS + the forward stage for the training forward (up to ~6% slower at "
                            "large token counts)") is not None:
        return None
    return FusedGemmForward(M, N, sz["hidden"], sz["seq"], sz["num_heads"], sz["num_kv_heads"], D, sz["eps"],
                            sz["norm_after_rope"], sz["variant"].norm_weight, x.dtype, device, sms=sms, lora=lora,
                            scales=0 if recipe is None else fp8_scales(recipe), **dict(cfg.fused_forward_tile or ()))


def _gl_dtype(dtype):
    from triton.experimental.gluon import language as gl
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]


def layouts(dtype, BM: int, BN: int, BK: int, operands=None):
    """(x tile, W tile, output half-tile) shared layouts (128-byte swizzle); ``operands``: x's and W's
    dtype where it is not the output's (FP8)."""
    from triton.experimental.gluon import language as gl
    t, a = _gl_dtype(dtype), _gl_dtype(operands or dtype)
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], a), gl.NVMMASharedLayout.get_default_for([BN, BK], a),
            gl.NVMMASharedLayout.get_default_for([BM, BN // 2], t))


class FusedGemmForward:
    """The fused forward of one plan: ``run(named)``. ``scales`` (FP8, :func:`fp8_scales`): x and W
    given as e4m3 casts, their inverse scales as more entries (:data:`FP8_ENTRIES`); the tile's K step
    :data:`FP8_BK` unless configured."""

    def __init__(self, M: int, N: int, K: int, S: int, hq: int, hkv: int, D: int, eps: float,
                 norm_after_rope: bool, norm_weight: bool, dtype, device, fuse: bool = True, sms: int | None = None,
                 lora: bool = False, scales: int = 0, **tile):
        from ..kernels.qkv_rope_norm_gemm_sm90 import qkv_rope_norm_gemm_sm90_kernel
        self.kernel = qkv_rope_norm_gemm_sm90_kernel
        self.M, self.N, self.K, self.S, self.hq, self.hkv, self.D, self.eps = M, N, K, S, hq, hkv, D, float(eps)
        unknown = set(tile) - set(TILE)
        if unknown:
            raise ValueError(f"tile: unknown options {sorted(unknown)}; expected some of {sorted(TILE)}")
        if lora and scales:
            raise ValueError("FusedGemmForward: LoRA adapters with FP8 operands are not built")
        self.tile = {**TILE, **({"BK": FP8_BK} if scales else {}), **tile}
        BM, BK = self.tile["BM"], self.tile["BK"]
        self.x_l, self.w_l, self.o_l = layouts(dtype, BM, D, BK, torch.float8_e4m3fn if scales else None)
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        # one program per SM, fewer where there are fewer than two tiles (two consumers) per SM
        self.grid = (max(1, min(sms, math.ceil(consumer_rounds(M, N, D, 1, BM)))), )
        self.lora, self.scales = lora, scales
        self.entries = LORA_ENTRIES if lora else FP8_ENTRIES if scales else ENTRIES  # its call tensors, in order
        self.constexprs = dict(BM=BM, BN=D, BK=BK, GROUP_M=self.tile["GROUP_M"], STAGES=self.tile["STAGES"],
                               FUSE=fuse, NORM_AFTER_ROPE=norm_after_rope, NORM_WEIGHT=norm_weight, RC=self.tile["RC"],
                               LORA=lora, SCALES=scales, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)

    @staticmethod
    def takes_rank(rank: int, dtype) -> bool:
        """Whether U ``[tokens, rank]`` and B ``[N, rank]`` can be TMA operands (rows of 16-byte multiples)."""
        return rank > 0 and (rank * torch.empty((), dtype=dtype).element_size()) % 16 == 0

    def bound_launch(self, like: dict):
        """``(Table, BoundLaunch)``: this kernel's launch over the call tensors ``like`` (by
        :data:`ENTRIES` name; the norm weights None where unweighted), every argument but the
        addresses fixed -- descriptors' shapes, strides, the sizes -- from ``like``. After its first
        launch (the JIT's) a launch given addresses calls the compiled kernel's launcher directly,
        re-encoding only the descriptors whose tensor moved."""
        from .launch import BoundLaunch, Desc, Table
        table = Table()
        slot = {name: table.add(name, like[name]) for name in self.entries if like.get(name) is not None}
        BM, BK, D = self.tile["BM"], self.tile["BK"], self.D
        if self.lora:  # U's columns are the adapters' ranks: one launch per rank sum
            lora = (Desc(slot["u"], [BM, BK], self.x_l), Desc(slot["b"], [D, BK], self.w_l))
            rank = like["u"].shape[1]
        else:
            lora, rank = (None, None), 0
        half = [BM, D // 2]
        wq = slot.get("q_norm_weight", slot["q"])  # unweighted: q stands in, never read
        wk = slot.get("k_norm_weight", slot["q"])
        rq, rk, cos, sin = (like[n] for n in ("rstd_q", "rstd_k", "cos", "sin"))
        scales = (slot["x_scale"], slot["w_scale"]) if self.scales else (None, None)
        args = (Desc(slot["x"], [BM, BK], self.x_l), Desc(slot["w"], [D, BK], self.w_l),
                Desc(slot["qkv"], half, self.o_l), Desc(slot["q"], half, self.o_l), Desc(slot["k"], half, self.o_l),
                *lora, *scales, wq, wq.like.stride(0) if wq.like.dim() == 1 else 1, wk,
                wk.like.stride(0) if wk.like.dim() == 1 else 1,
                slot["rstd_q"], *rq.stride(), slot["rstd_k"], *rk.stride(), slot["cos"], *cos.stride(), slot["sin"],
                *sin.stride(), self.eps, self.M, self.N, self.K, rank, self.S, self.hq, self.hkv)
        launch = BoundLaunch(self.kernel, self.grid, args, dict(self.constexprs, num_warps=4, maxnreg=MAXNREG))
        table.release()
        return table, launch

    def run(self, named: dict):
        """One launch through the JIT over the call tensors ``named`` (:func:`call_entries`, plus ``u``
        and ``b`` with ``lora``, ``x_scale`` and ``w_scale`` with ``scales``; tests and benchmarks: a
        plan launches :meth:`bound_launch`'s)."""
        table, launch = self.bound_launch(named)
        launch.raw_disabled = True
        launch.launch(table.tensors(named), None, 0)
