"""``nn.Module`` wrappers of the GQA input block: the fused one and a plain-PyTorch reference.

Both hold the same parameters under the same names -- ``qkv_weight``
``[(num_heads + 2*num_kv_heads)*head_dim, hidden_size]`` (rows ``[Q | K | V]``),
``q_norm_weight`` and ``k_norm_weight`` ``[head_dim]`` -- so state dicts move between
them, and both take ``forward(hidden_states, cos, sin)`` with cos/sin in the HF layout
``[batch, seq, head_dim]`` and return ``(q, k, v)`` as ``[batch, heads, seq, head_dim]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autograd import gqa_qkv_rope_qk_norm
from .ops import validation as V
from .ops.gqa_forward import _require_int, norm_after_rope_from_position


class _BlockParams(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6,
                 qk_norm_position: str = "after_rope", *, device=None, dtype=None):
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
        kw = dict(device=device, dtype=dtype)
        self.qkv_weight = nn.Parameter(torch.empty((num_heads + 2 * num_kv_heads) * head_dim, hidden_size, **kw))
        self.q_norm_weight = nn.Parameter(torch.empty(head_dim, **kw))
        self.k_norm_weight = nn.Parameter(torch.empty(head_dim, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))  # as nn.Linear
        nn.init.ones_(self.q_norm_weight)
        nn.init.ones_(self.k_norm_weight)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, eps={self.eps}, qk_norm_position={self.qk_norm_position!r}")


class GQAQKVRoPEQKNorm(_BlockParams):
    """QKV projection + RoPE + per-head RMSNorm of q and k, fused (one GEMM + one Triton
    kernel forward; one Triton kernel + two GEMMs backward). ``torch.compile``-safe."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return gqa_qkv_rope_qk_norm(
            hidden_states, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, eps=self.eps,
            qk_norm_position=self.qk_norm_position)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor: cos/sin [B, S, D] broadcast over heads."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``Qwen3RMSNorm``: statistics in (at least) fp32, normalised value rounded back to
    the input dtype, then scaled by the weight."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(dtype)


class ReferenceGQAQKVRoPEQKNorm(_BlockParams):
    """The same block in plain PyTorch, HF style (eager ops; what the tests and the
    benchmark compare against, also under ``torch.compile``)."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, S, _ = hidden_states.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = nn.functional.linear(hidden_states, self.qkv_weight)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(B, S, hq, d).transpose(1, 2)
        k = k.view(B, S, hkv, d).transpose(1, 2)
        v = v.view(B, S, hkv, d).transpose(1, 2)
        if self.norm_after_rope:
            q = rms_norm(apply_rotary(q, cos, sin), self.q_norm_weight, self.eps)
            k = rms_norm(apply_rotary(k, cos, sin), self.k_norm_weight, self.eps)
        else:
            q = apply_rotary(rms_norm(q, self.q_norm_weight, self.eps), cos, sin)
            k = apply_rotary(rms_norm(k, self.k_norm_weight, self.eps), cos, sin)
        return q, k, v
