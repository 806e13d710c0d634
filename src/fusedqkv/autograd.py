"""The training-ready GQA input block: QKV projection + RoPE + per-head RMSNorm of q and k.

``gqa_qkv_rope_qk_norm`` is differentiable (``GQAQKVRoPEQKNormFunction``) and
``torch.compile(fullgraph=True)``-safe: the forward and the backward are torch custom
ops (``fusedqkv::gqa_qkv_rope_qk_norm_fwd`` / ``..._bwd``) with fake implementations.

Forward: one GEMM (``qkv = x W^T``, or ``x W^T + b`` with the optional q/k/v bias, input
dtype) and one fused RoPE + RMSNorm kernel (fp32 math, one rounding). Saved for the backward: hidden_states and qkv_weight (the
user's tensors), the projection output ``qkv`` (whose last third *is* the returned v,
a view) -- nothing else: the backward recomputes rstd from it in fp32 (cheap, in-kernel),
so no fp32 tensor is held between forward and backward.

Backward: the RoPE/QK-norm backward kernel of the 091 work in its accurate mode
(``exact=False``: fp32 math, one rounding; ``saved_rotated=False``: it recomputes the
rotation from the raw projection output, so grad_cos/grad_sin are the true gradients),
writing dQKV token-major, then dX = dQKV W and dW = dQKV^T X on cuBLAS (and the bias
gradient, dQKV summed over tokens in fp32). grad_cos/sin are computed only when cos/sin
require grad; dX/dW only when needed.

Eager calls are planned once per input signature (:mod:`fusedqkv.ops.training_forward`,
:mod:`fusedqkv.ops.training_backward`): the forward's plan travels through the Function, the
backward's is looked up by its own signature.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops.training_backward import training_backward
from .ops.training_forward import forward_plan, run_forward
from .ops import validation as V
from .ops.gqa_forward import validate_forward_inputs

Tensor = torch.Tensor

_EMPTY_SHAPE = (0,)


def _backend_arg(backend: Optional[str]) -> str:
    if backend is None:
        return "auto"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    return backend


def _position(norm_after_rope: bool) -> str:
    return "after_rope" if norm_after_rope else "before_rope"


# ------------------------------------------------------------------------ implementations


def _fwd_impl(hidden_states: Tensor, qkv_weight: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              backend: str, qkv_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    plan = forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                              num_kv_heads, eps, _position(norm_after_rope), backend, qkv_bias)
    return run_forward(plan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias)


def _bwd_impl(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, hidden_states: Tensor, qkv_weight: Tensor,
              qkv: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              need_hidden_grad: bool, need_weight_grad: bool, need_cos_sin_grad: bool,
              backend: str, need_bias_grad: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                   Tensor]:
    g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = training_backward(
        grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads,
        num_kv_heads, eps, norm_after_rope, need_hidden_grad, need_weight_grad, need_cos_sin_grad, backend,
        need_bias_grad)
    # a custom op returns tensors: empty ones stand for the gradients not needed
    empty = qkv_weight.new_empty
    return (hidden_states.new_empty(_EMPTY_SHAPE) if g_x is None else g_x, empty(_EMPTY_SHAPE) if g_w is None else g_w,
            g_qw, g_kw, cos.new_empty(_EMPTY_SHAPE) if g_cos is None else g_cos,
            sin.new_empty(_EMPTY_SHAPE) if g_sin is None else g_sin, empty(_EMPTY_SHAPE) if g_b is None else g_b)


# ------------------------------------------------------------------------ custom ops

_fwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _fwd_fake(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
              norm_after_rope, backend, qkv_bias=None):
    B, S, _ = hidden_states.shape
    n_tot = qkv_weight.shape[0]
    D = n_tot // (num_heads + 2 * num_kv_heads)
    q = hidden_states.new_empty((B, S, num_heads, D)).transpose(1, 2)  # token-major, as the real op's
    k = hidden_states.new_empty((B, S, num_kv_heads, D)).transpose(1, 2)
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
    """(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, meta) ->
    (q, k, v), each [B, H, S, D].

    cos/sin must already be [batch, seq, head_dim] (expand a shared [1, seq, head_dim]
    first; autograd then sums its gradient over the batch). ``qkv_bias`` optional (None).
    ``meta``: ``(num_heads, num_kv_heads, eps, norm_after_rope, backend, plan)``, one argument
    (``apply`` costs host time per argument); ``plan`` the forward's plan (eager calls), or None
    (under torch.compile: the custom ops)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, meta):
        num_heads, num_kv_heads, eps, norm_after_rope, backend, plan = meta
        if plan is not None:
            q, k, qkv, _, _ = run_forward(plan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                                cos, sin, qkv_bias)
        else:
            q, k, qkv, _, _ = _call(_fwd_op, _fwd_impl, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                    cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, backend, qkv_bias)
        B, S, n_tot = qkv.shape
        D = n_tot // (num_heads + 2 * num_kv_heads)
        v = qkv.view(B, S, num_heads + 2 * num_kv_heads, D)[:, :, num_heads + num_kv_heads:].transpose(1, 2)
        # rstd is not kept: the backward recomputes it from qkv
        ctx.save_for_backward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv)
        ctx.meta = meta
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv = ctx.saved_tensors
        num_heads, num_kv_heads, eps, norm_after_rope, backend, plan = ctx.meta
        need = ctx.needs_input_grad
        need_cs = bool(need[4] or need[5])
        need_b = bool(need[6])
        args = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
                num_heads, num_kv_heads, eps, norm_after_rope, bool(need[0]), bool(need[1]), need_cs, backend, need_b)
        if plan is not None and not torch.compiler.is_compiling():
            g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = training_backward(*args)
        else:
            g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = _call(_bwd_op, _bwd_impl, *args)
        return (g_x if need[0] else None, g_w if need[1] else None, g_qw if need[2] else None,
                g_kw if need[3] else None, g_cos if need[4] else None, g_sin if need[5] else None,
                g_b if need_b else None, None)


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

    Returns ``(q, k, v)`` as ``[batch, heads, seq, head_dim]`` in hidden_states' dtype, laid out
    token-major as HF attention's are (``[batch, seq, heads, head_dim]`` in memory; v is a view
    of the projection output), so an attention kernel's output needs no copy before o_proj.
    ``backend`` forces ``"triton"`` or ``"torch"``; by default CUDA uses Triton, CPU PyTorch.
    The work is planned once per input signature (validation included).

    Under ``torch.autocast`` the block runs in the autocast dtype (hidden_states, qkv_weight,
    the bias, cos and sin cast to it, as ``F.linear`` would; the norm weights keep theirs) with
    autocast off inside: its GEMMs write preallocated outputs of one dtype.
    """
    dev_type = hidden_states.device.type if isinstance(hidden_states, torch.Tensor) else None
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden_states, qkv_weight, qkv_bias, cos, sin = (
            t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in (hidden_states, qkv_weight, qkv_bias, cos, sin))
        with torch.autocast(dev_type, enabled=False):
            return gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                        qk_norm_position=qk_norm_position, backend=backend, qkv_bias=qkv_bias,
                                        norm_weight_offset=norm_weight_offset)
    if norm_weight_offset != 0.0 or type(norm_weight_offset) not in (float, int):
        offset = V.require_number("norm_weight_offset", norm_weight_offset)
        if offset != 0.0:
            # w + offset as a differentiable op before the Function (its gradient w.r.t. w is the
            # identity), in fp32 as HF's Gemma3RMSNorm forms 1 + w: the kernels take fp32 norm weights
            if not isinstance(q_norm_weight, torch.Tensor) or not isinstance(k_norm_weight, torch.Tensor):
                V.require_tensor("q_norm_weight", q_norm_weight)
                V.require_tensor("k_norm_weight", k_norm_weight)
            q_norm_weight = q_norm_weight.float() + offset
            k_norm_weight = k_norm_weight.float() + offset
    backend = _backend_arg(backend)
    if torch.compiler.is_compiling():  # traced: plain validation, then the custom ops
        sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                     num_heads, num_kv_heads, eps, qk_norm_position)
        if qkv_bias is not None:
            V.require_shape("qkv_bias", qkv_bias, (sz["qkv"],), "[(num_heads + 2*num_kv_heads)*head_dim]")
        plan = None
        b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
    else:
        plan = forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                                  num_kv_heads, eps, qk_norm_position, backend, qkv_bias)
        sz = plan.sz
        b, s, d = plan.cs_shape
    if cos.shape[0] != b:
        cos = cos.expand(b, s, d)
    if sin.shape[0] != b:
        sin = sin.expand(b, s, d)
    return GQAQKVRoPEQKNormFunction.apply(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias,
                                          (sz["num_heads"], sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"],
                                           backend, plan))
