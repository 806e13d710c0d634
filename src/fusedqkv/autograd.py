"""The training-ready GQA input block: QKV projection + RoPE + per-head RMSNorm of q and k.

``gqa_qkv_rope_qk_norm`` is differentiable (``GQAQKVRoPEQKNormFunction``) and
``torch.compile(fullgraph=True)``-safe: the forward and the backward are torch custom
ops (``fusedqkv::gqa_qkv_rope_qk_norm_fwd`` / ``..._bwd``) with fake implementations.

Forward: one GEMM (``qkv = x W^T``, input dtype) and one fused RoPE + RMSNorm kernel
(fp32 math, one rounding). Saved for the backward: hidden_states and qkv_weight (the
user's tensors), the projection output ``qkv`` (whose last third *is* the returned v,
a view) -- nothing else: the backward recomputes rstd from it in fp32 (cheap, in-kernel),
so no fp32 tensor is held between forward and backward.

Backward: the RoPE/QK-norm backward kernel of the 091 work in its accurate mode
(``exact=False``: fp32 math, one rounding; ``saved_rotated=False``: it recomputes the
rotation from the raw projection output, so grad_cos/grad_sin are the true gradients),
writing dQKV token-major, then dX = dQKV W and dW = dQKV^T X on cuBLAS. grad_cos/sin
are computed only when cos/sin require grad; dX/dW only when needed.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops.gqa_forward import gqa_forward, validate_forward_inputs
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
              backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return gqa_forward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                       num_kv_heads, eps, norm_after_rope, _backend(hidden_states.device, backend))


def _bwd_impl(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, hidden_states: Tensor, qkv_weight: Tensor,
              qkv: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              need_hidden_grad: bool, need_weight_grad: bool, need_cos_sin_grad: bool,
              backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
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
    finish()
    return g_x, g_w, g_qw, g_kw, g_cos, g_sin


# ------------------------------------------------------------------------ custom ops

_fwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _fwd_fake(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
              norm_after_rope, backend):
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
              need_cos_sin_grad, backend):
    B, S, n_tot = qkv.shape
    D = n_tot // (num_heads + 2 * num_kv_heads)
    g_x = hidden_states.new_empty(tuple(hidden_states.shape) if need_hidden_grad else _EMPTY_SHAPE)
    g_w = qkv_weight.new_empty(tuple(qkv_weight.shape) if need_weight_grad else _EMPTY_SHAPE)
    g_qw = q_norm_weight.new_empty(q_norm_weight.shape)
    g_kw = k_norm_weight.new_empty(k_norm_weight.shape)
    g_cos = cos.new_empty((B, S, D) if need_cos_sin_grad else _EMPTY_SHAPE)
    g_sin = sin.new_empty((B, S, D) if need_cos_sin_grad else _EMPTY_SHAPE)
    return g_x, g_w, g_qw, g_kw, g_cos, g_sin


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
    num_kv_heads, eps, norm_after_rope, backend) -> (q, k, v), each [B, H, S, D].

    cos/sin must already be [batch, seq, head_dim] (expand a shared [1, seq, head_dim]
    first; autograd then sums its gradient over the batch)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool, backend: str):
        q, k, qkv, rq, rk = _call(_fwd_op, _fwd_impl, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                  cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, backend)
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
        g_x, g_w, g_qw, g_kw, g_cos, g_sin = _call(
            _bwd_op, _bwd_impl, grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv,
            q_norm_weight, k_norm_weight, cos, sin, ctx.num_heads, ctx.num_kv_heads, ctx.eps, ctx.norm_after_rope,
            bool(need[0]), bool(need[1]), need_cs, ctx.backend)
        return (g_x if need[0] else None, g_w if need[1] else None, g_qw if need[2] else None,
                g_kw if need[3] else None, g_cos if need[4] else None, g_sin if need[5] else None,
                None, None, None, None, None)


def gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, *, num_heads,
                         num_kv_heads, eps=1e-6, qk_norm_position="after_rope", backend: Optional[str] = None):
    """QKV projection + RoPE + per-head RMSNorm of q and k, differentiable.

    hidden_states ``[batch, seq, hidden]``; qkv_weight ``[(num_heads + 2*num_kv_heads)*head_dim,
    hidden]`` (rows ``[Q | K | V]``); q/k_norm_weight ``[head_dim]``; cos/sin ``[batch, seq,
    head_dim]`` or ``[1, seq, head_dim]`` (HF layout, NeoX rotate-half).
    ``qk_norm_position``: ``"after_rope"`` (RoPE, then RMSNorm: HunyuanImage-3.0, 091) or
    ``"before_rope"`` (RMSNorm, then RoPE: Qwen3, OLMo 2).

    Returns ``(q, k, v)`` as ``[batch, heads, seq, head_dim]`` in hidden_states' dtype; q and
    k are contiguous, v is a view of the projection output (as in HF attention).
    ``backend`` forces ``"triton"`` or ``"torch"``; by default CUDA uses Triton, CPU PyTorch.

    Under ``torch.autocast`` the block runs in the autocast dtype (hidden_states, qkv_weight,
    cos and sin cast to it, as ``F.linear`` would; the norm weights keep theirs) with autocast
    off inside: its GEMMs write preallocated outputs of one dtype.
    """
    dev_type = hidden_states.device.type if isinstance(hidden_states, torch.Tensor) else None
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden_states, qkv_weight, cos, sin = (
            t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in (hidden_states, qkv_weight, cos, sin))
        with torch.autocast(dev_type, enabled=False):
            return gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                        qk_norm_position=qk_norm_position, backend=backend)
    sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                 num_heads, num_kv_heads, eps, qk_norm_position)
    b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
    if cos.shape[0] != b:
        cos = cos.expand(b, s, d)
    if sin.shape[0] != b:
        sin = sin.expand(b, s, d)
    return GQAQKVRoPEQKNormFunction.apply(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                          sz["num_heads"], sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"],
                                          _backend_arg(backend))
