"""``nn.Module`` wrappers of the GQA input block: the fused one and a plain-PyTorch reference.

Both hold the same parameters under the same names -- ``qkv_weight``
``[(num_heads + 2*num_kv_heads)*head_dim, hidden_size]`` (rows ``[Q | K | V]``),
``q_norm_weight`` and ``k_norm_weight`` ``[head_dim]``, with ``bias=True`` also ``qkv_bias``
``[(num_heads + 2*num_kv_heads)*head_dim]`` -- so state dicts move between them, and both
take ``forward(hidden_states, cos, sin)`` with cos/sin in the HF layout ``[batch, seq,
head_dim]`` and return ``(q, k, v)`` as ``[batch, heads, seq, head_dim]``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .autograd import gqa_qkv_rope_qk_norm
from .ops import validation as V
from .ops.gqa_forward import _require_int, norm_after_rope_from_position


class _BlockParams(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6,
                 qk_norm_position: str = "after_rope", *, bias: bool = False, norm_weight_offset: float = 0.0,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        num_heads = _require_int("num_heads", num_heads)
        num_kv_heads = _require_int("num_kv_heads", num_kv_heads)
        head_dim = _require_int("head_dim", head_dim)
        V.require_head_config(num_heads, num_kv_heads, head_dim)
        V.require_number("eps", eps, min_value=0.0)
        self.norm_after_rope = norm_after_rope_from_position(qk_norm_position)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eps = float(eps)
        self.qk_norm_position = qk_norm_position
        if not isinstance(bias, bool):
            raise TypeError(f"bias: expected a bool, got {type(bias).__name__}")
        self.norm_weight_offset = V.require_number("norm_weight_offset", norm_weight_offset)
        kw = dict(device=device, dtype=dtype)
        n_tot = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_weight = nn.Parameter(torch.empty(n_tot, hidden_size, **kw))
        self.qkv_bias = nn.Parameter(torch.empty(n_tot, **kw)) if bias else None
        self.q_norm_weight = nn.Parameter(torch.empty(head_dim, **kw))
        self.k_norm_weight = nn.Parameter(torch.empty(head_dim, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))  # as nn.Linear
        if self.qkv_bias is not None:
            bound = 1.0 / math.sqrt(self.hidden_size)
            nn.init.uniform_(self.qkv_bias, -bound, bound)
        # an effective norm scale of 1 (Gemma3's offset form: weight 0)
        nn.init.constant_(self.q_norm_weight, 1.0 - self.norm_weight_offset)
        nn.init.constant_(self.k_norm_weight, 1.0 - self.norm_weight_offset)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, eps={self.eps}, qk_norm_position={self.qk_norm_position!r}, "
                f"bias={self.qkv_bias is not None}, norm_weight_offset={self.norm_weight_offset}")


class GQAQKVRoPEQKNorm(_BlockParams):
    """QKV projection + RoPE + per-head RMSNorm of q and k, fused (one GEMM + one Triton
    kernel forward; one Triton kernel + two GEMMs backward). ``torch.compile``-safe."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return gqa_qkv_rope_qk_norm(
            hidden_states, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, eps=self.eps,
            qk_norm_position=self.qk_norm_position, qkv_bias=self.qkv_bias,
            norm_weight_offset=self.norm_weight_offset)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor: cos/sin [B, S, D] broadcast over heads."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """HF ``Qwen3RMSNorm``: statistics in (at least) fp32, normalised value rounded back to
    the input dtype, then scaled by the weight. With ``weight_offset`` HF's ``Gemma3RMSNorm``:
    scaled by ``offset + weight`` in fp32, then rounded once."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    if weight_offset:
        return (xf * (weight_offset + weight.to(xf.dtype))).to(dtype)
    return weight * xf.to(dtype)


def reference_block(hidden_states: torch.Tensor, qkv_weight: torch.Tensor, q_norm_weight: torch.Tensor,
                    k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, eps: float, norm_after_rope: bool, qkv_bias: Optional[torch.Tensor] = None,
                    norm_weight_offset: float = 0.0):
    """The block in plain PyTorch, HF style (eager ops): ``(q, k, v)`` as ``[B, H, S, D]`` views of
    the projection output, rotated and normed in the given order."""
    B, S, _ = hidden_states.shape
    hq, hkv = num_heads, num_kv_heads
    d = qkv_weight.shape[0] // (hq + 2 * hkv)
    off = norm_weight_offset
    qkv = nn.functional.linear(hidden_states, qkv_weight, qkv_bias)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(B, S, hq, d).transpose(1, 2)
    k = k.view(B, S, hkv, d).transpose(1, 2)
    v = v.view(B, S, hkv, d).transpose(1, 2)
    if norm_after_rope:
        q = rms_norm(apply_rotary(q, cos, sin), q_norm_weight, eps, off)
        k = rms_norm(apply_rotary(k, cos, sin), k_norm_weight, eps, off)
    else:
        q = apply_rotary(rms_norm(q, q_norm_weight, eps, off), cos, sin)
        k = apply_rotary(rms_norm(k, k_norm_weight, eps, off), cos, sin)
    return q, k, v


class ReferenceGQAQKVRoPEQKNorm(_BlockParams):
    """The same block in plain PyTorch, HF style (eager ops; what the tests and the
    benchmark compare against, also under ``torch.compile``)."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return reference_block(hidden_states, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin,
                               self.num_heads, self.num_kv_heads, self.eps, self.norm_after_rope, self.qkv_bias,
                               self.norm_weight_offset)
