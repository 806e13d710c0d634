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

import functools
from typing import Optional

import torch

from .ops.training_backward import training_backward
from .ops.training_forward import forward_plan, run_forward
from .ops import fp8 as _fp8
from .ops import internals as _internals
from .ops import validation as V
from .ops.gqa_forward import Variant, validate_forward_inputs
from .ops.lora import LoRAUpdate

Tensor = torch.Tensor

_EMPTY_SHAPE = (0,)
_any_autocast = _internals.any_autocast_enabled


def _backend_arg(backend: Optional[str]) -> str:
    if backend is None:
        return "auto"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    return backend


def _position(norm_after_rope: bool) -> str:
    return "after_rope" if norm_after_rope else "before_rope"


# ------------------------------------------------------------------------ implementations


def _variant_of(q_gate: bool, interleaved: bool, all_heads: bool, v_norm: bool, weighted: bool, rot: int,
                d: int, k_eq_v: bool = False) -> Variant:
    return Variant(rot=0 if rot == d else rot, interleaved=interleaved, q_gate=q_gate, norm_weight=weighted,
                   all_heads=all_heads, v_norm=v_norm, k_eq_v=k_eq_v)


def _head_dim(n_cols: int, num_heads: int, num_kv_heads: int, q_gate: bool, k_eq_v: bool) -> int:
    return n_cols // ((2 * num_heads if q_gate else num_heads) + (1 if k_eq_v else 2) * num_kv_heads)


def _fwd_impl(hidden_states: Tensor, qkv_weight: Tensor, q_norm_weight: Optional[Tensor],
              k_norm_weight: Optional[Tensor], cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float,
              norm_after_rope: bool, backend: str, qkv_bias: Optional[Tensor] = None, q_gate: bool = False,
              interleaved: bool = False, all_heads: bool = False, v_norm: bool = False,
              qkv_residual: Optional[Tensor] = None, k_eq_v: bool = False,
              fp8: str = "") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    plan = forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                        num_kv_heads, eps, _position(norm_after_rope), backend, qkv_bias, q_gate,
                        "interleaved" if interleaved else "neox", "all_heads" if all_heads else "head", v_norm,
                        qkv_residual is not None, k_eq_v, fp8)
    q, k, qkv, rq, rk, v = run_forward(plan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                       qkv_bias, qkv_residual)
    # a custom op returns tensors: an empty one stands for v when it is a view of qkv
    return q, k, qkv, rq, rk, hidden_states.new_empty(_EMPTY_SHAPE) if v is None else v


def _bwd_impl(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, hidden_states: Tensor, qkv_weight: Tensor,
              qkv: Tensor, q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor],
              cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, eps: float, norm_after_rope: bool,
              need_hidden_grad: bool, need_weight_grad: bool, need_cos_sin_grad: bool,
              backend: str, need_bias_grad: bool = False, grad_gate: Optional[Tensor] = None, q_gate: bool = False,
              interleaved: bool = False, all_heads: bool = False, v_norm: bool = False,
              need_residual_grad: bool = False, k_eq_v: bool = False,
              fp8: str = "") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    d = _head_dim(qkv.shape[2], num_heads, num_kv_heads, q_gate, k_eq_v)
    variant = _variant_of(q_gate, interleaved, all_heads, v_norm, q_norm_weight is not None, cos.shape[2], d, k_eq_v)
    out = training_backward(
        grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads,
        num_kv_heads, eps, norm_after_rope, need_hidden_grad, need_weight_grad, need_cos_sin_grad, backend,
        need_bias_grad, grad_gate if q_gate else None, variant, keep_dqkv=need_residual_grad, fp8_key=fp8)
    g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = out[:7]
    # a custom op returns tensors: empty ones stand for the gradients not needed (or absent)
    empty = qkv_weight.new_empty
    return (hidden_states.new_empty(_EMPTY_SHAPE) if g_x is None else g_x, empty(_EMPTY_SHAPE) if g_w is None else g_w,
            empty(_EMPTY_SHAPE) if g_qw is None else g_qw, empty(_EMPTY_SHAPE) if g_kw is None else g_kw,
            cos.new_empty(_EMPTY_SHAPE) if g_cos is None else g_cos,
            sin.new_empty(_EMPTY_SHAPE) if g_sin is None else g_sin, empty(_EMPTY_SHAPE) if g_b is None else g_b,
            out[7] if need_residual_grad else qkv.new_empty(_EMPTY_SHAPE))


# ------------------------------------------------------------------------ custom ops

_fwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_fwd", mutates_args=())(_fwd_impl)
_bwd_op = torch.library.custom_op("fusedqkv::gqa_qkv_rope_qk_norm_bwd", mutates_args=())(_bwd_impl)


@_fwd_op.register_fake
def _fwd_fake(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
              norm_after_rope, backend, qkv_bias=None, q_gate=False, interleaved=False, all_heads=False,
              v_norm=False, qkv_residual=None, k_eq_v=False, fp8=""):
    B, S, _ = hidden_states.shape
    n_tot = qkv_weight.shape[0]
    D = _head_dim(n_tot, num_heads, num_kv_heads, q_gate, k_eq_v)
    q = hidden_states.new_empty((B, S, num_heads, D)).transpose(1, 2)  # token-major, as the real op's
    k = hidden_states.new_empty((B, S, num_kv_heads, D)).transpose(1, 2)
    qkv = hidden_states.new_empty((B, S, n_tot))
    rq = hidden_states.new_empty((B, num_heads, S), dtype=torch.float32)
    rk = hidden_states.new_empty((B, num_kv_heads, S), dtype=torch.float32)
    v = hidden_states.new_empty((B, S, num_kv_heads, D)).transpose(1, 2) if v_norm else \
        hidden_states.new_empty(_EMPTY_SHAPE)
    return q, k, qkv, rq, rk, v


@_bwd_op.register_fake
def _bwd_fake(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight,
              cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, need_hidden_grad, need_weight_grad,
              need_cos_sin_grad, backend, need_bias_grad=False, grad_gate=None, q_gate=False, interleaved=False,
              all_heads=False, v_norm=False, need_residual_grad=False, k_eq_v=False, fp8=""):
    B, S, n_tot = qkv.shape
    rot = cos.shape[2]
    g_x = hidden_states.new_empty(tuple(hidden_states.shape) if need_hidden_grad else _EMPTY_SHAPE)
    g_w = qkv_weight.new_empty(tuple(qkv_weight.shape) if need_weight_grad else _EMPTY_SHAPE)
    if q_norm_weight is None:
        g_qw, g_kw = qkv_weight.new_empty(_EMPTY_SHAPE), qkv_weight.new_empty(_EMPTY_SHAPE)
    else:
        g_qw = q_norm_weight.new_empty(q_norm_weight.shape)
        g_kw = k_norm_weight.new_empty(k_norm_weight.shape)
    g_cos = cos.new_empty((B, S, rot) if need_cos_sin_grad else _EMPTY_SHAPE)
    g_sin = sin.new_empty((B, S, rot) if need_cos_sin_grad else _EMPTY_SHAPE)
    g_b = qkv_weight.new_empty((n_tot,) if need_bias_grad else _EMPTY_SHAPE)
    g_res = qkv.new_empty((B, S, n_tot) if need_residual_grad else _EMPTY_SHAPE)
    return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b, g_res


# ------------------------------------------------------------------------ autograd


def _call(op, impl, *args):
    # eager: call the implementation directly (the dispatcher round trip costs host time
    # on every step); under torch.compile: the custom op, which the compiler treats as a
    # black box with the fake implementation's shapes
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


def _op_flags(variant: Variant) -> tuple:
    """The variant as the custom ops' flags (partial rotary: cos/sin's width; weights: given or None)."""
    return variant.q_gate, variant.interleaved, variant.all_heads, variant.v_norm


SECOND_ORDER_REFUSED = (
    "fusedqkv: the fused block's backward is not itself differentiable: a backward through the gradients that "
    "backward(create_graph=True) computed through the block (a gradient penalty, a Hessian-vector product) is not "
    "supported. For higher-order gradients use the unfused model or fusedqkv.ReferenceGQAQKVRoPEQKNorm")


class _OnceDifferentiable(torch.autograd.Function):
    """Aliases of gradients that a fused block's backward computed under ``create_graph=True``: a
    backward through them raises :data:`SECOND_ORDER_REFUSED` (what ``torch.autograd.function.
    once_differentiable`` does, with the reason named)."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_ORDER_REFUSED)


def differentiable_once(backward):
    """An autograd Function's ``backward`` run with grad mode off where grad mode is on
    (``backward(create_graph=True)``), its gradients returned through :func:`refuse_second_order`."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            with torch.no_grad():
                out = backward(ctx, *grads)
            return refuse_second_order(out)
        return backward(ctx, *grads)

    return wrapper


def refuse_second_order(grads: tuple) -> tuple:
    """``grads``, a backward's return computed with grad mode off, each tensor replaced by an alias
    whose backward raises: for a backward run under ``create_graph=True`` (grad mode on), whose
    kernels and out= products build no graph of their own."""
    at = [i for i, g in enumerate(grads) if isinstance(g, Tensor)]
    if not at:
        return grads
    aliases = _OnceDifferentiable.apply(*(grads[i].detach().requires_grad_() for i in at))
    out = list(grads)
    for i, a in zip(at, aliases):
        out[i] = a
    return tuple(out)


class GQAQKVRoPEQKNormFunction(torch.autograd.Function):
    """(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual, meta)
    -> (q, k, v), each [B, H, S, D]; with a gate (q, k, v, gate), gate [B, S, H, D].

    cos/sin must already be [batch, seq, rot] (expand a shared [1, seq, rot] first; autograd
    then sums its gradient over the batch). ``qkv_bias`` and ``qkv_residual`` optional (None;
    the residual's gradient is dQKV); the norm weights None
    for unweighted norms. ``meta``: ``(num_heads, num_kv_heads, eps, norm_after_rope, backend,
    plan, variant, weight_source, fp8, keep_fp8_weight, keep_fp8_input_amax)``, one argument (``apply``
    costs host time per argument);
    ``plan`` the forward's plan (eager calls), or None (under torch.compile: the custom ops);
    ``variant`` the block's :class:`~fusedqkv.ops.gqa_forward.Variant`; ``weight_source`` None, or a
    callable that gives qkv_weight again in the backward (which then does not keep it); ``fp8`` an
    FP8 recipe's key (:mod:`fusedqkv.ops.fp8`), "" for none; ``keep_fp8_weight`` True where the
    forward casts qkv_weight for the backward's dX GEMM too and keeps that cast (eager FP8 calls that
    will need dX: ``fp8.weight_casts``); ``keep_fp8_input_amax`` True where the forward's cast of
    hidden_states keeps x's amaxes for the dW GEMM's cast of x (eager FP8 calls that will need dW:
    ``fp8.input_cast_keeping_amax``)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual, meta):
        return _forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias,
                        qkv_residual, meta)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_q, grad_k, grad_v, grad_gate=None):
        need = ctx.needs_input_grad
        need_res = bool(need[7])
        out = _backward(ctx, ctx.saved_tensors, grad_q, grad_k, grad_v, grad_gate, need[:7], need_res)
        g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = out[:7]
        return (g_x if need[0] else None, g_w if need[1] else None, g_qw if need[2] else None,
                g_kw if need[3] else None, g_cos if need[4] else None, g_sin if need[5] else None,
                g_b if need[6] else None, out[7] if need_res else None, None)


class GQAQKVRoPEQKNormLoRAFunction(torch.autograd.Function):
    """The block with LoRA adapters inside (:class:`fusedqkv.ops.lora.LoRAUpdate`): (hidden_states,
    qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, lora, meta, *lora.params) -> as
    :class:`GQAQKVRoPEQKNormFunction`. The adapters' update is accumulated into the projection
    output before the stage, their share of dX into the block's dX; the backward returns dA, dB
    (and the dropout inputs' gradients) itself. Eager calls only (``meta``'s plan set)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, lora, meta,
                *params):
        out = _forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, None, meta,
                       lora)
        ctx.lora = lora
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_q, grad_k, grad_v, grad_gate=None):
        need = ctx.needs_input_grad
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor one time
        g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b, dqkv = _backward(ctx, saved, grad_q, grad_k, grad_v, grad_gate,
                                                                  need[:7], True)
        x = saved[0]
        m = dqkv.shape[0] * dqkv.shape[1]
        grads = ctx.lora.backward(dqkv.view(m, -1), g_x.view(m, -1) if need[0] else None, x.reshape(m, -1),
                                  list(need[9:]))
        ctx.lora = None
        return (g_x if need[0] else None, g_w if need[1] else None, g_qw if need[2] else None,
                g_kw if need[3] else None, g_cos if need[4] else None, g_sin if need[5] else None,
                g_b if need[6] else None, None, None, *grads)


_apply_block = _internals.autograd_apply(GQAQKVRoPEQKNormFunction, refuse_transforms=True)
_apply_lora_block = _internals.autograd_apply(GQAQKVRoPEQKNormLoRAFunction, refuse_transforms=True)


def _forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual, meta,
             lora=None):
    """The Functions' forward: (q, k, v[, gate]); ``lora``: a LoRAUpdate whose update goes into the
    projection output before the stage (eager plans only)."""
    (num_heads, num_kv_heads, eps, norm_after_rope, backend, plan, variant, source, fp8, keep_fp8_weight,
     keep_fp8_input_amax) = meta
    w_fwd = w_dx = x_fwd = x_amax = None
    if keep_fp8_weight:  # W cast for both its GEMMs from one pass; the dX GEMM's copy kept for the backward
        casts = (_fp8.FROZEN_WEIGHT_CASTS.get(qkv_weight, plan.fp8) if plan.cfg.fp8_frozen_weight_cache
                 else _fp8.weight_casts(qkv_weight, plan.fp8))
        if casts is not None:
            w_fwd, w_dx = casts
    if keep_fp8_input_amax:  # x's amaxes for dW's cast of x found by the forward's cast of x, and kept
        kept = _fp8.input_cast_keeping_amax(hidden_states.reshape(-1, hidden_states.shape[-1]), plan.fp8)
        if kept is not None:
            x_fwd, x_amax = kept
    if plan is not None:
        q, k, qkv, _, _, v = run_forward(plan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                         cos, sin, qkv_bias, qkv_residual, keep_rstd=False, lora=lora,
                                         fp8_weight=w_fwd, fp8_input=x_fwd)
    else:
        q, k, qkv, _, _, v = _call(_fwd_op, _fwd_impl, hidden_states, qkv_weight, q_norm_weight, k_norm_weight,
                                   cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, backend, qkv_bias,
                                   *_op_flags(variant), qkv_residual, variant.k_eq_v, fp8)
    # v: the value columns, or (k_eq_v) the raw k's; normed (v_norm): the run's own tensor
    if plan is not None:
        if plan.v_view is not None:  # one view op (qkv is the plan's contiguous [B, S, n_tot])
            size, stride, offset = plan.v_view
            v = qkv.as_strided(size, stride, qkv.storage_offset() + offset)
    elif not variant.v_norm:
        B, S, n_tot = qkv.shape
        n_heads = variant.qkv_heads(num_heads, num_kv_heads)
        v0 = (2 * num_heads if variant.q_gate else num_heads) + (0 if variant.k_eq_v else num_kv_heads)
        v = qkv.view(B, S, n_heads, n_tot // n_heads)[:, :, v0:v0 + num_kv_heads].transpose(1, 2)
    # rstd is not kept: the backward recomputes it from qkv (and v's norm from its columns)
    ctx.save_for_backward(hidden_states, None if source is not None else qkv_weight, q_norm_weight,
                          k_norm_weight, cos, sin, qkv, *(w_dx if w_dx is not None else (None, None)), x_amax)
    ctx.meta = meta
    if variant.q_gate:  # the gate: the second half of each query head's columns, unnormed
        B, S, n_tot = qkv.shape
        n_heads = variant.qkv_heads(num_heads, num_kv_heads)
        return q, k, v, qkv.view(B, S, n_heads, n_tot // n_heads)[:, :, 1:2 * num_heads:2]
    return q, k, v


def _backward(ctx, saved, grad_q, grad_k, grad_v, grad_gate, need: tuple, keep_dqkv: bool) -> tuple:
    """The Functions' backward: ``(g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b[, dqkv])`` for ``need``,
    the needs of (hidden_states, qkv_weight, q/k norm weights, cos, sin, qkv_bias); ``saved``:
    ``ctx.saved_tensors``."""
    hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv, w_dx, w_dx_inv, x_amax = saved
    num_heads, num_kv_heads, eps, norm_after_rope, backend, plan, variant, source, fp8, _, _ = ctx.meta
    if source is not None:  # rebuilt rather than held since the forward (QLoRA's dequantized weight)
        qkv_weight = source()
    need_cs = bool(need[4] or need[5])
    args = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
            num_heads, num_kv_heads, eps, norm_after_rope, bool(need[0]), bool(need[1]), need_cs, backend,
            bool(need[6]))
    if plan is not None and not torch.compiler.is_compiling():
        return training_backward(*args, grad_gate, variant, keep_dqkv=keep_dqkv, fp8_key=fp8,
                                 fp8_weight=None if w_dx is None else (w_dx, w_dx_inv), fp8_x_amax=x_amax)
    return _call(_bwd_op, _bwd_impl, *args, grad_gate, *_op_flags(variant), keep_dqkv, variant.k_eq_v, fp8)


def _qkv_rows(variant: Variant) -> str:
    return f"({'2*' if variant.q_gate else ''}num_heads + {'' if variant.k_eq_v else '2*'}num_kv_heads)*head_dim"


def _check_residual(r, hidden_states, sz) -> None:
    rows = _qkv_rows(sz["variant"])
    V.require_tensor("qkv_residual", r)
    V.require_shape("qkv_residual", r, (sz["batch"], sz["seq"], sz["qkv"]), f"[batch, seq, {rows}]")
    V.require_same_dtype([("hidden_states", hidden_states), ("qkv_residual", r)])
    V.require_same_device([("hidden_states", hidden_states), ("qkv_residual", r)])


def _check_lora(lora, hidden_states, sz) -> None:
    if not isinstance(lora, LoRAUpdate):
        raise TypeError(f"qkv_lora: expected a fusedqkv.ops.lora.LoRAUpdate, got {type(lora).__name__}")
    if lora.n_tot != sz["qkv"] or lora.dtype != hidden_states.dtype:
        raise ValueError(f"qkv_lora: built for {lora.n_tot} rows in {lora.dtype}; this call has {sz['qkv']} rows in "
                         f"{hidden_states.dtype}")
    if lora.device != hidden_states.device:
        raise ValueError(f"qkv_lora: its adapters are on {lora.device}, hidden_states on {hidden_states.device}")


def gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, *, num_heads,
                         num_kv_heads, eps=1e-6, qk_norm_position="after_rope", backend: Optional[str] = None,
                         qkv_bias: Optional[Tensor] = None, norm_weight_offset: float = 0.0, q_gate: bool = False,
                         rope_style: str = "neox", norm_scope: str = "head", v_norm: bool = False,
                         qkv_residual: Optional[Tensor] = None, qkv_weight_source=None, qkv_lora=None,
                         k_eq_v: bool = False, fp8=None):
    """QKV projection + RoPE + RMSNorm of q and k, differentiable.

    hidden_states ``[batch, seq, hidden]``; qkv_weight ``[(num_heads + 2*num_kv_heads)*head_dim,
    hidden]`` (rows ``[Q | K | V]``); q/k_norm_weight ``[head_dim]``; cos/sin ``[batch, seq,
    rot]`` or ``[1, seq, rot]`` (HF layout), ``rot`` the rotary width: head_dim, or an even size
    below it for partial rotary (the leading rot dims of each head rotate, the rest pass through).
    ``qk_norm_position``: ``"after_rope"`` (RoPE, then RMSNorm: HunyuanImage-3.0, 091) or
    ``"before_rope"`` (RMSNorm, then RoPE: Qwen3, OLMo 2).
    ``qkv_bias``: optional ``[(num_heads + 2*num_kv_heads)*head_dim]`` bias of the projection
    (``x W^T + b``; qkv_weight's dtype), as HF's ``attention_bias``.
    ``norm_weight_offset``: the norms scale by ``norm_weight + offset`` (Gemma3: ``1 + w``,
    offset 1.0), formed in fp32 as HF's Gemma3 norm does.
    ``qkv_residual``: optional ``[batch, seq, qkv rows]`` tensor added to the projection output
    before RoPE and the norms (``x W^T [+ b] + r``; hidden_states' dtype): the LoRA update of
    :mod:`fusedqkv.integrations.peft`. Its gradient is dQKV.
    ``qkv_weight_source``: optional callable returning qkv_weight again (the same values, shape,
    dtype and device; called once in the backward), for a frozen qkv_weight that is cheaper to
    rebuild than to keep between forward and backward: the 4-bit weights of
    :mod:`fusedqkv.integrations.qlora`, dequantized into a reused workspace. Under torch.compile
    qkv_weight is kept as usual.
    ``qkv_lora``: optional :class:`fusedqkv.ops.lora.LoRAUpdate` (eager calls; instead of a
    ``qkv_residual``): LoRA adapters computed inside the block, their update accumulated into the
    projection output in place and their share of dX into dX; the adapters' gradients come from
    the block's backward (:func:`fusedqkv.integrations.peft.lora_operands` builds it).
    ``fp8``: the projection's three GEMMs in FP8 (``torch._scaled_mm``), scaled and cast as
    torchao's ``Float8Linear`` does for the recipe: ``"tensorwise"``, ``"rowwise"`` or
    ``"rowwise_with_gw_hp"`` (dW in high precision); ``"mxfp8"`` / ``"mxfp8_rceil"``: torchao's
    MX training (e4m3 with one e8m0 scale per 32 values, FLOOR / RCEIL scales; Blackwell, sm_100,
    only on CUDA, emulated on the CPU); or an :class:`~fusedqkv.ops.fp8.Fp8Recipe`;
    None (default): no FP8. RoPE and the norms stay in hidden_states' dtype. CUDA needs sm_89+.

    The block's variants: ``q_norm_weight=None`` and ``k_norm_weight=None``: unweighted norms
    (Llama 4, nanochat); ``rope_style="interleaved"``: RoPE pairs ``(2i, 2i+1)`` (GPT-J / Llama 4;
    cos/sin per element); ``norm_scope="all_heads"``: the RMS over all ``num_heads*head_dim``
    channels of q per token, and all of k's (OLMo 2/3; weights ``[num_heads*head_dim]`` and
    ``[num_kv_heads*head_dim]``); ``q_gate=True``: the Q rows of qkv_weight are per head
    ``[q | gate]`` (``2*num_heads`` blocks; Qwen3-Next), and the call returns ``(q, k, v, gate)``
    with gate ``[batch, seq, num_heads, head_dim]`` (a view of the projection output, unnormed);
    ``v_norm=True``: v RMS-normed per head without a weight (Gemma 3n); ``k_eq_v=True``: v is the
    raw k projection (Gemma 4's global layers, ``attention_k_eq_v``): qkv_weight (and the bias, the
    residual) has rows ``[Q | K]`` only, ``(num_heads + num_kv_heads)*head_dim`` of them, and v is k
    before its norm and RoPE (normed with ``v_norm``). An unsupported combination raises ValueError
    naming the arguments.

    Returns ``(q, k, v)`` as ``[batch, heads, seq, head_dim]`` in hidden_states' dtype, laid out
    token-major as HF attention's are (``[batch, seq, heads, head_dim]`` in memory; v is a view
    of the projection output unless normed), so an attention kernel's output needs no copy
    before o_proj. ``backend`` forces ``"triton"`` or ``"torch"``; by default CUDA uses Triton,
    CPU PyTorch. The work is planned once per input signature (validation included).

    Under ``torch.autocast`` the block runs in the autocast dtype (hidden_states, qkv_weight,
    the bias, cos and sin cast to it, as ``F.linear`` would; the norm weights keep theirs) with
    autocast off inside: its GEMMs write preallocated outputs of one dtype.
    """
    dev_type = hidden_states.device.type if _any_autocast() and isinstance(hidden_states, torch.Tensor) else None
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        options = dict(q_gate=q_gate, rope_style=rope_style, norm_scope=norm_scope, v_norm=v_norm, k_eq_v=k_eq_v)
        dt = torch.get_autocast_dtype(dev_type)
        hidden_states, qkv_weight, qkv_bias, cos, sin, qkv_residual = (
            t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in (hidden_states, qkv_weight, qkv_bias, cos, sin, qkv_residual))
        with torch.autocast(dev_type, enabled=False):
            if qkv_weight_source is not None and isinstance(qkv_weight, torch.Tensor):
                src, want = qkv_weight_source, qkv_weight.dtype
                qkv_weight_source = lambda: src().to(want)  # noqa: E731 - what the cast above gave
            return gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                        qk_norm_position=qk_norm_position, backend=backend, qkv_bias=qkv_bias,
                                        norm_weight_offset=norm_weight_offset, qkv_residual=qkv_residual,
                                        qkv_weight_source=qkv_weight_source, qkv_lora=qkv_lora, fp8=fp8,
                                        **options)
    if norm_weight_offset != 0.0 or type(norm_weight_offset) not in (float, int):
        offset = V.require_number("norm_weight_offset", norm_weight_offset)
        if offset != 0.0:
            if q_norm_weight is None and k_norm_weight is None:
                raise ValueError(f"norm_weight_offset: {offset} needs norm weights; with q_norm_weight and "
                                 "k_norm_weight None (unweighted norms) expected 0.0")
            # w + offset as a differentiable op before the Function (its gradient w.r.t. w is the
            # identity), in fp32 as HF's Gemma3RMSNorm forms 1 + w: the kernels take fp32 norm weights
            if not isinstance(q_norm_weight, torch.Tensor) or not isinstance(k_norm_weight, torch.Tensor):
                V.require_tensor("q_norm_weight", q_norm_weight)
                V.require_tensor("k_norm_weight", k_norm_weight)
            q_norm_weight = q_norm_weight.float() + offset
            k_norm_weight = k_norm_weight.float() + offset
    backend = "auto" if backend is None else _backend_arg(backend)
    fp8_recipe = None if fp8 is None else _fp8.recipe(fp8)
    fp8_key = "" if fp8_recipe is None else fp8_recipe.key
    compiling = torch.compiler.is_compiling()
    if qkv_lora is not None and (qkv_residual is not None or compiling):
        raise ValueError("qkv_lora: " + ("give qkv_residual or qkv_lora, not both" if qkv_residual is not None else
                                         "eager calls only; under torch.compile pass the update as qkv_residual"))
    if compiling:  # traced: plain validation, then the custom ops
        sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                     num_heads, num_kv_heads, eps, qk_norm_position, q_gate=q_gate,
                                     rope_style=rope_style, norm_scope=norm_scope, v_norm=v_norm, k_eq_v=k_eq_v)
        if qkv_bias is not None:
            V.require_shape("qkv_bias", qkv_bias, (sz["qkv"],), f"[{_qkv_rows(sz['variant'])}]")
        if fp8_recipe is not None:
            _fp8.check_supported(sz["device"], sz["hidden"], sz["qkv"], fp8_recipe)
        plan = None
        b, s, rot = sz["batch"], sz["seq"], sz["rot"]
    else:
        plan = forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                            num_kv_heads, eps, qk_norm_position, backend, qkv_bias, q_gate, rope_style, norm_scope,
                            v_norm, qkv_residual is not None or qkv_lora is not None, k_eq_v, fp8_key)
        sz = plan.sz
        b, s, rot = plan.cs_shape
    if qkv_residual is not None:
        _check_residual(qkv_residual, hidden_states, sz)
    if qkv_weight_source is not None:
        if not callable(qkv_weight_source):
            raise TypeError(f"qkv_weight_source: expected a callable returning qkv_weight, got "
                            f"{type(qkv_weight_source).__name__}")
        if qkv_weight.requires_grad:
            raise ValueError("qkv_weight_source: qkv_weight requires grad; a rebuilt weight must be frozen "
                             "(its gradient would not reach the tensor the source rebuilds it from)")
        if compiling:
            qkv_weight_source = None  # traced: the graph keeps qkv_weight
    if cos.shape[0] != b:
        cos = cos.expand(b, s, rot)
    if sin.shape[0] != b:
        sin = sin.expand(b, s, rot)
    # the dX GEMM's cast of W made in the forward and kept: eager calls whose backward will need dX (the
    # custom ops under torch.compile cast W in the backward, as does a weight the backward rebuilds)
    keep_fp8_weight = (fp8_recipe is not None and plan is not None and qkv_weight_source is None
                       and hidden_states.requires_grad and torch.is_grad_enabled())
    # x's amaxes for the dW GEMM's cast of x found by the forward's cast of x and kept: eager calls whose
    # backward will need dW in FP8 (fp8.input_cast_keeping_amax declines the other recipes)
    keep_fp8_input_amax = (fp8_recipe is not None and plan is not None and qkv_weight.requires_grad
                           and torch.is_grad_enabled())
    meta = (sz["num_heads"], sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"], backend, plan, sz["variant"],
            qkv_weight_source, fp8_key, keep_fp8_weight, keep_fp8_input_amax)
    if qkv_lora is not None:
        _check_lora(qkv_lora, hidden_states, sz)
        return _apply_lora_block(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_lora,
                                 meta, *qkv_lora.params)
    if plan is None:  # traced: the public apply (what torch.compile expects to see)
        return GQAQKVRoPEQKNormFunction.apply(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                              qkv_bias, qkv_residual, meta)
    return _apply_block(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual, meta)
