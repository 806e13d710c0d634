"""The training-ready GQA input block: QKV projection + RoPE + per-head RMSNorm of q and k.

``gqa_qkv_rope_qk_norm`` is differentiable (``GQAQKVRoPEQKNormFunction``) and
``torch.compile(fullgraph=True)``-safe: the forward and the backward are torch custom
ops (``fusedqkv::gqa_qkv_rope_qk_norm_fwd`` / ``..._bwd``) with fake implementations.

Forward: one GEMM (``qkv = x W^T``, or ``x W^T + b`` with the optional q/k/v bias, input
dtype) and one fused RoPE + RMSNorm kernel (fp32 math, one rounding). Saved for the
backward: hidden_states and qkv_weight (the user's tensors), the projection output ``qkv``
(whose last third *is* the returned v, a view) -- nothing else: the backward recomputes
rstd from it in fp32 (cheap, in-kernel), so no fp32 tensor is held between forward and
backward.

Backward: the RoPE/QK-norm backward kernel of the 091 work in its accurate mode
(``exact=False``: fp32 math, one rounding; ``saved_rotated=False``: it recomputes the
rotation from the raw projection output, so grad_cos/grad_sin are the true gradients),
writing dQKV token-major, then dX = dQKV W and dW = dQKV^T X on cuBLAS (and the bias
gradient, dQKV summed over tokens in fp32). grad_cos/sin are computed only when cos/sin
require grad; dX/dW only when needed.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops import validation as V
from .ops.gqa_forward import gqa_forward, rope_qk_norm_forward, validate_forward_inputs
from .ops.rope_qk_norm import pick_backend, rope_qk_norm_backward

Tensor = torch.Tensor

_EMPTY_SHAPE = (0,)


def _backend_arg(backend: Optional[str]) -> str:
    if backend is None:
        return "auto"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    return backend


def _backend(device: torch.device, backend: str) -> str:
    return pick_backend(device, None if backend == "auto" else backend)


# ------------------------------------------------------------------------ implementations


def _fwd_impl(hidden_states: Tensor, qkv_weight: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              backend: str, qkv_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    be = _backend(hidden_states.device, backend)
    if qkv_bias is None:
        return gqa_forward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                           num_kv_heads, eps, norm_after_rope, be)
    # the bias rides in the one GEMM (addmm), so RoPE/norm see x W^T + b as HF's Linear gives it
    B, S, hidden = hidden_states.shape
    n_tot = qkv_weight.shape[0]
    qkv = torch.addmm(qkv_bias, hidden_states.reshape(B * S, hidden), qkv_weight.t()).view(B, S, n_tot)
    q, k, rq, rk = rope_qk_norm_forward(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads,
                                        eps, norm_after_rope, be)
    return q, k, qkv, rq, rk


def _bwd_impl(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, hidden_states: Tensor, qkv_weight: Tensor,
              qkv: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              need_hidden_grad: bool, need_weight_grad: bool, need_cos_sin_grad: bool,
              backend: str, need_bias_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                   Tensor]:
    B, S, n_tot = qkv.shape
    hq, hkv = num_heads, num_kv_heads
    D = n_tot // (hq + 2 * hkv)
    M = B * S
    hidden = hidden_states.shape[-1]
    dt = qkv.dtype
    dev = qkv.device
    # gradients arrive in the output dtype; keep one activation dtype for the kernel
    grad_q, grad_k, grad_v = (g if g.dtype == dt else g.to(dt) for g in (grad_q, grad_k, grad_v))
    heads = qkv.view(B, S, hq + 2 * hkv, D)
    saved_q = heads[:, :, :hq].transpose(1, 2)  # the raw projection output, a view
    saved_k = heads[:, :, hq: hq + hkv].transpose(1, 2)
    # every allocation before the first launch
    dqkv = torch.empty((M, n_tot), dtype=dt, device=dev)
    g_qw = torch.empty_like(q_norm_weight, memory_format=torch.contiguous_format)
    g_kw = torch.empty_like(k_norm_weight, memory_format=torch.contiguous_format)
    if need_cos_sin_grad:
        g_cos = torch.empty((B, S, D), dtype=cos.dtype, device=dev)
        g_sin = torch.empty((B, S, D), dtype=sin.dtype, device=dev)
    else:
        g_cos = cos.new_empty(_EMPTY_SHAPE)
        g_sin = sin.new_empty(_EMPTY_SHAPE)
    g_x = (torch.empty((B, S, hidden), dtype=hidden_states.dtype, device=dev) if need_hidden_grad
           else hidden_states.new_empty(_EMPTY_SHAPE))
    g_w = (torch.empty(qkv_weight.shape, dtype=qkv_weight.dtype, device=dev) if need_weight_grad
           else qkv_weight.new_empty(_EMPTY_SHAPE))
    x2d = hidden_states.reshape(M, hidden) if need_weight_grad else None
    finish = rope_qk_norm_backward(
        grad_q, grad_k, grad_v, saved_q, saved_k, None, None, q_norm_weight, k_norm_weight, cos, sin,
        dqkv=dqkv, grad_cos=g_cos if need_cos_sin_grad else None, grad_sin=g_sin if need_cos_sin_grad else None,
        grad_q_norm_weight=g_qw, grad_k_norm_weight=g_kw,
        exact=False, norm_after_rope=norm_after_rope, saved_rotated=False,
        backend=_backend(dev, backend), scratch=g_x if need_hidden_grad else None, eps=eps,
    )
    if need_hidden_grad:
        torch.mm(dqkv, qkv_weight, out=g_x.view(M, hidden))
    if need_weight_grad:
        torch.mm(dqkv.t(), x2d, out=g_w)
    # the bias gradient: dQKV summed over tokens, accumulated in fp32 (torch's reduction:
    # a fixed order, no atomics)
    g_b = (dqkv.sum(0, dtype=torch.float32).to(qkv_weight.dtype) if need_bias_grad
           else qkv_weight.new_empty(_EMPTY_SHAPE))
    finish()
    return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b


# ------------------------------------------------------------------------ custom ops

_fwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _fwd_fake(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
              norm_after_rope, backend, qkv_bias=None):
    B, S, _ = hidden_states.shape
    n_tot = qkv_weight.shape[0]
    D = n_tot // (num_heads + 2 * num_kv_heads)
    q = hidden_states.new_empty((B, num_heads, S, D))
    k = hidden_states.new_empty((B, num_kv_heads, S, D))
    qkv = hidden_states.new_empty((B, S, n_tot))
    rq = hidden_states.new_empty((B, num_heads, S), dtype=torch.float32)
    rk = hidden_states.new_empty((B, num_kv_heads, S), dtype=torch.float32)
    return q, k, qkv, rq, rk


@_bwd_op.register_fake
def _bwd_fake(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight,
              cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, need_hidden_grad, need_weight_grad,
              need_cos_sin_grad, backend, need_bias_grad=False):
    B, S, n_tot = qkv.shape
    D = n_tot // (num_heads + 2 * num_kv_heads)
    g_x = hidden_states.new_empty(tuple(hidden_states.shape) if need_hidden_grad else _EMPTY_SHAPE)
    g_w = qkv_weight.new_empty(tuple(qkv_weight.shape) if need_weight_grad else _EMPTY_SHAPE)
    g_qw = q_norm_weight.new_empty(q_norm_weight.shape)
    g_kw = k_norm_weight.new_empty(k_norm_weight.shape)
    g_cos = cos.new_empty((B, S, D) if need_cos_sin_grad else _EMPTY_SHAPE)
    g_sin = sin.new_empty((B, S, D) if need_cos_sin_grad else _EMPTY_SHAPE)
    g_b = qkv_weight.new_empty((n_tot,) if need_bias_grad else _EMPTY_SHAPE)
    return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b


# ------------------------------------------------------------------------ autograd


def _call(op, impl, *args):
    # eager: call the implementation directly (the dispatcher round trip costs host time
    # on every step); under torch.compile: the custom op, which the compiler treats as a
    # black box with the fake implementation's shapes
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


class GQAQKVRoPEQKNormFunction(torch.autograd.Function):
    """(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
    num_kv_heads, eps, norm_after_rope, backend[, qkv_bias]) -> (q, k, v), each [B, H, S, D].

    cos/sin must already be [batch, seq, head_dim] (expand a shared [1, seq, head_dim]
    first; autograd then sums its gradient over the batch)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool, backend: str, qkv_bias=None):
        q, k, qkv, rq, rk = _call(_fwd_op, _fwd_impl, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                  cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, backend, qkv_bias)
        B, S, n_tot = qkv.shape
        D = n_tot // (num_heads + 2 * num_kv_heads)
        v = qkv.view(B, S, num_heads + 2 * num_kv_heads, D)[:, :, num_heads + num_kv_heads:].transpose(1, 2)
        # rq/rk are not kept: the backward recomputes them from qkv
        ctx.save_for_backward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv)
        ctx.eps = eps
        ctx.num_heads = num_heads
        ctx.num_kv_heads = num_kv_heads
        ctx.norm_after_rope = norm_after_rope
        ctx.backend = backend
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_cs = bool(need[4] or need[5])
        need_b = len(need) > 11 and bool(need[11])
        g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = _call(
            _bwd_op, _bwd_impl, grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv,
            q_norm_weight, k_norm_weight, cos, sin, ctx.num_heads, ctx.num_kv_heads, ctx.eps, ctx.norm_after_rope,
            bool(need[0]), bool(need[1]), need_cs, ctx.backend, need_b)
        return (g_x if need[0] else None, g_w if need[1] else None, g_qw if need[2] else None,
                g_kw if need[3] else None, g_cos if need[4] else None, g_sin if need[5] else None,
                None, None, None, None, None, g_b if need_b else None)[:len(need)]


def gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, *, num_heads,
                         num_kv_heads, eps=1e-6, qk_norm_position="after_rope", backend: Optional[str] = None,
                         qkv_bias: Optional[Tensor] = None, norm_weight_offset: float = 0.0):
    """QKV projection + RoPE + per-head RMSNorm of q and k, differentiable.

    hidden_states ``[batch, seq, hidden]``; qkv_weight ``[(num_heads + 2*num_kv_heads)*head_dim,
    hidden]`` (rows ``[Q | K | V]``); q/k_norm_weight ``[head_dim]``; cos/sin ``[batch, seq,
    head_dim]`` or ``[1, seq, head_dim]`` (HF layout, NeoX rotate-half).
    ``qk_norm_position``: ``"after_rope"`` (RoPE, then RMSNorm: HunyuanImage-3.0, 091) or
    ``"before_rope"`` (RMSNorm, then RoPE: Qwen3, OLMo 2).
    ``qkv_bias``: optional ``[(num_heads + 2*num_kv_heads)*head_dim]`` bias of the projection
    (``x W^T + b``; qkv_weight's dtype), as HF's ``attention_bias``.
    ``norm_weight_offset``: the norms scale by ``norm_weight + offset`` (Gemma3: ``1 + w``,
    offset 1.0), formed in fp32 as HF's Gemma3 norm does.

    Returns ``(q, k, v)`` as ``[batch, heads, seq, head_dim]`` in hidden_states' dtype; q and
    k are contiguous, v is a view of the projection output (as in HF attention).
    ``backend`` forces ``"triton"`` or ``"torch"``; by default CUDA uses Triton, CPU PyTorch.
    """
    sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                 num_heads, num_kv_heads, eps, qk_norm_position)
    offset = V.require_number("norm_weight_offset", norm_weight_offset)
    if qkv_bias is not None:
        V.require_tensor("qkv_bias", qkv_bias)
        V.require_shape("qkv_bias", qkv_bias, (sz["qkv"],), "[(num_heads + 2*num_kv_heads)*head_dim]")
        V.require_same_dtype([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
        V.require_same_device([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
    b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
    if cos.shape[0] != b:
        cos = cos.expand(b, s, d)
    if sin.shape[0] != b:
        sin = sin.expand(b, s, d)
    if offset != 0.0:
        # w + offset as a differentiable op before the Function (its gradient w.r.t. w is the
        # identity), in fp32 as HF's Gemma3RMSNorm forms 1 + w: the kernels take fp32 norm weights
        q_norm_weight = q_norm_weight.float() + offset
        k_norm_weight = k_norm_weight.float() + offset
    return GQAQKVRoPEQKNormFunction.apply(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                          sz["num_heads"], sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"],
                                          _backend_arg(backend), qkv_bias)
