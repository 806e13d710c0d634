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
from .ops.fp8 import recipe as fp8_recipe
from .ops.gqa_forward import NORM_SCOPES, ROPE_STYLES, _require_bool, _require_choice, _require_int, \
    norm_after_rope_from_position


class _BlockParams(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6,
                 qk_norm_position: str = "after_rope", *, bias: bool = False, norm_weight_offset: float = 0.0,
                 q_gate: bool = False, rope_style: str = "neox", norm_scope: str = "head", norm_weight: bool = True,
                 v_norm: bool = False, device=None, dtype=None):
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
        self.q_gate = _require_bool("q_gate", q_gate)
        self.rope_style = _require_choice("rope_style", rope_style, ROPE_STYLES, "'neox' or 'interleaved'")
        self.norm_scope = _require_choice("norm_scope", norm_scope, NORM_SCOPES, "'head' or 'all_heads'")
        if self.norm_scope == "all_heads":
            V.require_all_heads_head_dim(head_dim)
        self.v_norm = _require_bool("v_norm", v_norm)
        if not _require_bool("norm_weight", norm_weight) and self.norm_weight_offset:
            raise ValueError(f"norm_weight_offset: {self.norm_weight_offset} needs norm weights (norm_weight=False "
                             "gives unweighted norms); expected 0.0")
        kw = dict(device=device, dtype=dtype)
        n_tot = ((2 if q_gate else 1) * num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_weight = nn.Parameter(torch.empty(n_tot, hidden_size, **kw))
        self.qkv_bias = nn.Parameter(torch.empty(n_tot, **kw)) if bias else None
        all_heads = norm_scope == "all_heads"
        if norm_weight:
            self.q_norm_weight = nn.Parameter(torch.empty(num_heads * head_dim if all_heads else head_dim, **kw))
            self.k_norm_weight = nn.Parameter(torch.empty(num_kv_heads * head_dim if all_heads else head_dim, **kw))
        else:
            self.register_parameter("q_norm_weight", None)
            self.register_parameter("k_norm_weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))  # as nn.Linear
        if self.qkv_bias is not None:
            bound = 1.0 / math.sqrt(self.hidden_size)
            nn.init.uniform_(self.qkv_bias, -bound, bound)
        # an effective norm scale of 1 (Gemma3's offset form: weight 0)
        if self.q_norm_weight is not None:
            nn.init.constant_(self.q_norm_weight, 1.0 - self.norm_weight_offset)
            nn.init.constant_(self.k_norm_weight, 1.0 - self.norm_weight_offset)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, eps={self.eps}, qk_norm_position={self.qk_norm_position!r}, "
                f"bias={self.qkv_bias is not None}, norm_weight_offset={self.norm_weight_offset}, q_gate={self.q_gate}, "
                f"rope_style={self.rope_style!r}, norm_scope={self.norm_scope!r}, "
                f"norm_weight={self.q_norm_weight is not None}, v_norm={self.v_norm}")

    def _variant_kwargs(self) -> dict:
        return dict(q_gate=self.q_gate, rope_style=self.rope_style, norm_scope=self.norm_scope, v_norm=self.v_norm)


class GQAQKVRoPEQKNorm(_BlockParams):
    """QKV projection + RoPE + per-head RMSNorm of q and k, fused (one GEMM + one Triton
    kernel forward; one Triton kernel + two GEMMs backward). ``torch.compile``-safe.
    Returns ``(q, k, v)``, with ``q_gate=True`` ``(q, k, v, gate)``. ``fp8``: the projection's
    GEMMs in FP8 with torchao's recipe of that name (see :func:`fusedqkv.gqa_qkv_rope_qk_norm`)."""

    def __init__(self, *args, fp8=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = fp8_recipe(fp8)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.fp8 is None else f", fp8={self.fp8.key!r}")

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # the parameters from _parameters where they are there, which is what Module.__getattr__ would
        # return (a parametrized or reassigned one is read as an attribute)
        p = self._parameters
        w = p["qkv_weight"] if "qkv_weight" in p else self.qkv_weight
        wq = p["q_norm_weight"] if "q_norm_weight" in p else self.q_norm_weight
        wk = p["k_norm_weight"] if "k_norm_weight" in p else self.k_norm_weight
        bias = p["qkv_bias"] if "qkv_bias" in p else self.qkv_bias
        return gqa_qkv_rope_qk_norm(
            hidden_states, w, wq, wk, cos, sin, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            eps=self.eps, qk_norm_position=self.qk_norm_position, qkv_bias=bias,
            norm_weight_offset=self.norm_weight_offset, fp8=self.fp8, q_gate=self.q_gate, rope_style=self.rope_style,
            norm_scope=self.norm_scope, v_norm=self.v_norm)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J / Llama 4 (interleaved) RoPE: pairs (2i, 2i+1) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor: cos/sin [B, S, rot] broadcast over heads; with
    rot < head_dim (partial rotary) the leading rot dims rotate, the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = x_rot * cos.unsqueeze(1) + (rotate_pairs if interleaved else rotate_half)(x_rot) * sin.unsqueeze(1)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """HF ``Qwen3RMSNorm``: statistics in (at least) fp32, normalised value rounded back to
    the input dtype, then scaled by the weight. With ``weight_offset`` HF's ``Gemma3RMSNorm``:
    scaled by ``offset + weight`` in fp32, then rounded once. ``weight`` None: an unweighted
    norm (Llama 4's L2Norm, Gemma 3n's v_norm), rounded once."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    var = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(var + eps)
    if weight is None:
        return xf.to(dtype)
    if weight_offset:
        return (xf * (weight_offset + weight.to(xf.dtype))).to(dtype)
    return weight * xf.to(dtype)


def reference_block(hidden_states: torch.Tensor, qkv_weight: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                    k_norm_weight: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, eps: float, norm_after_rope: bool, qkv_bias: Optional[torch.Tensor] = None,
                    norm_weight_offset: float = 0.0, *, q_gate: bool = False, rope_style: str = "neox",
                    norm_scope: str = "head", v_norm: bool = False, k_eq_v: bool = False):
    """The block in plain PyTorch, HF style (eager ops): ``(q, k, v)`` as ``[B, H, S, D]`` views of
    the projection output, rotated and normed in the given order; with ``q_gate`` also the gate
    ``[B, S, H, D]`` (Qwen3-Next: the Q projection viewed ``(.., H, 2D)`` and chunked).
    ``rope_style='interleaved'``: GPT-J pairs; cos/sin narrower than head_dim: partial rotary;
    norm weights None: unweighted norms; ``norm_scope='all_heads'``: OLMo 2's norm over all heads
    of a token (weights ``[H*D]``); ``v_norm``: Gemma 3n's unweighted norm of v; ``k_eq_v``: Gemma 4's
    v, the raw k (qkv_weight's rows ``[Q | K]``)."""
    B, S, _ = hidden_states.shape
    hq, hkv = num_heads, num_kv_heads
    nq = 2 * hq if q_gate else hq
    d = qkv_weight.shape[0] // (nq + (1 if k_eq_v else 2) * hkv)
    off = norm_weight_offset
    interleaved = rope_style == "interleaved"
    qkv = nn.functional.linear(hidden_states, qkv_weight, qkv_bias)
    if k_eq_v:
        q, k = qkv.split([nq * d, hkv * d], dim=-1)
        v = k
    else:
        q, k, v = qkv.split([nq * d, hkv * d, hkv * d], dim=-1)
    gate = None
    if q_gate:
        q, gate = torch.chunk(q.view(B, S, hq, 2 * d), 2, dim=-1)
    q = q.reshape(B, S, hq, d).transpose(1, 2)
    k = k.view(B, S, hkv, d).transpose(1, 2)
    v = v.view(B, S, hkv, d).transpose(1, 2)

    def norm(x, w):
        if norm_scope == "all_heads":  # over the token's [H*D] channels, as OLMo 2's q_norm/k_norm
            H = x.shape[1]
            flat = x.transpose(1, 2).reshape(B, S, H * d)
            return rms_norm(flat, w, eps, off).view(B, S, H, d).transpose(1, 2)
        return rms_norm(x, w, eps, off)

    def rope(x):
        return apply_rotary(x, cos, sin, interleaved)

    if norm_after_rope:
        q, k = norm(rope(q), q_norm_weight), norm(rope(k), k_norm_weight)
    else:
        q, k = rope(norm(q, q_norm_weight)), rope(norm(k, k_norm_weight))
    if v_norm:
        v = rms_norm(v, None, eps)
    return (q, k, v, gate) if q_gate else (q, k, v)


class ReferenceGQAQKVRoPEQKNorm(_BlockParams):
    """The same block in plain PyTorch, HF style (eager ops; what the tests and the
    benchmark compare against, also under ``torch.compile``)."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return reference_block(hidden_states, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin,
                               self.num_heads, self.num_kv_heads, self.eps, self.norm_after_rope, self.qkv_bias,
                               self.norm_weight_offset, **self._variant_kwargs())
