"""Forward of the GQA attention input block: QKV projection, RoPE, per-head RMSNorm.

``gqa_forward`` runs one cuBLAS GEMM (``qkv = hidden_states @ qkv_weight.T``, in the
input dtype) and one fused RoPE + RMSNorm stage that writes q/k as
``[batch, heads, seq, head_dim]`` (contiguous) and the per-(token, head) rstd in fp32.
v needs no math: it is a view of the projection output.

Two backends with one semantics (fp32 math, one rounding to the input dtype):

* ``"triton"``: :func:`fusedqkv.kernels.rope_qk_norm_fwd.rope_qk_norm_fwd_kernel`
  (CUDA, or the CPU under ``TRITON_INTERPRET=1``, which the tests use);
* ``"torch"``: vectorised PyTorch, the CPU path.

``validate_forward_inputs`` checks the public arguments and raises ``TypeError`` /
``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import config
from . import validation as V
from .device import current_stream, sm_count
from .launch import BoundLaunch, Ptr, Table, next_pow2 as _next_pow2
from .variant import (NORM_SCOPES, PLAIN, ROPE_STYLES, Variant, all_heads_warps, heads_of, pad_rotary,  # noqa: F401
                      rotate)

try:  # Triton is a dependency on Linux only; the torch backend serves without it
    from ..kernels.rope_qk_norm_fwd import rope_qk_norm_fwd_kernel
except ImportError:  # pragma: no cover
    rope_qk_norm_fwd_kernel = None

QK_NORM_POSITIONS = ("after_rope", "before_rope")




# ----------------------------------------------------------------------------- validation


def _require_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    return int(x)


def norm_after_rope_from_position(qk_norm_position) -> bool:
    if not isinstance(qk_norm_position, str):
        raise TypeError(f"qk_norm_position: expected a str ('after_rope' or 'before_rope'), got {type(qk_norm_position).__name__}")
    if qk_norm_position not in QK_NORM_POSITIONS:
        raise ValueError(f"qk_norm_position: expected 'after_rope' (RoPE, then RMSNorm: HunyuanImage-3.0) or "
                         f"'before_rope' (RMSNorm, then RoPE: Qwen3, OLMo 2), got {qk_norm_position!r}")
    return qk_norm_position == "after_rope"


def _require_bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return x


def _require_choice(name: str, x, choices: tuple, what: str) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected a str ({what}), got {type(x).__name__}")
    if x not in choices:
        raise ValueError(f"{name}: expected {what}, got {x!r}")
    return x


def _head_dim_of_norm_weights(q_norm_weight, k_norm_weight, hq: int, hkv: int, all_heads: bool):
    """(head_dim, what gives it) where both norm weights are 1-d tensors that agree on one head_dim,
    else (None, ""): they disagree, and the shape checks against qkv_weight's head_dim name the odd one."""
    if not (isinstance(q_norm_weight, torch.Tensor) and isinstance(k_norm_weight, torch.Tensor)
            and q_norm_weight.dim() == 1 and k_norm_weight.dim() == 1):
        return None, ""
    nq, nk = q_norm_weight.shape[0], k_norm_weight.shape[0]
    if all_heads:
        if nq % hq or nk % hkv or nq // hq != nk // hkv or nq == 0:
            return None, ""
        return nq // hq, (f"q_norm_weight [{nq}] and k_norm_weight [{nk}] "
                          "([num_heads*head_dim], [num_kv_heads*head_dim])")
    if nq != nk or nq == 0:
        return None, ""
    return nq, f"q_norm_weight and k_norm_weight [{nq}] ([head_dim])"


def validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                            num_heads, num_kv_heads, eps, qk_norm_position, *, q_gate=False, rope_style="neox",
                            norm_scope="head", v_norm=False, k_eq_v=False) -> dict:
    """Check the public forward arguments; returns the derived sizes and the :class:`Variant`.

    cos/sin may be ``[batch, seq, rot]`` or ``[1, seq, rot]`` (shared by the batch), ``rot`` the
    rotary width (even, 2..head_dim; head_dim unless partial rotary). ``q_norm_weight`` and
    ``k_norm_weight`` both None: unweighted norms. ``k_eq_v``: qkv_weight has no V rows (v is the raw k).
    """
    q_gate = _require_bool("q_gate", q_gate)
    v_norm = _require_bool("v_norm", v_norm)
    k_eq_v = _require_bool("k_eq_v", k_eq_v)
    interleaved = _require_choice("rope_style", rope_style, ROPE_STYLES,
                                  "'neox' (rotate-half pairs (i, i + rot/2)) or 'interleaved' (pairs (2i, 2i+1))"
                                  ) == "interleaved"
    all_heads = _require_choice("norm_scope", norm_scope, NORM_SCOPES,
                                "'head' (RMSNorm per head) or 'all_heads' (over all heads of a token)") == "all_heads"
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight / k_norm_weight: give both (weighted norms) or neither (None: unweighted "
                         f"norms); got q_norm_weight {'None' if q_norm_weight is None else 'a tensor'} and "
                         f"k_norm_weight {'None' if k_norm_weight is None else 'a tensor'}")
    weighted = q_norm_weight is not None
    named = [("hidden_states", hidden_states), ("qkv_weight", qkv_weight)]
    if weighted:
        named += [("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)]
    named += [("cos", cos), ("sin", sin)]
    for n, t in named:
        V.require_tensor(n, t)
    hq = _require_int("num_heads", num_heads)
    hkv = _require_int("num_kv_heads", num_kv_heads)
    eps = V.require_number("eps", eps)
    if not eps >= 0.0:
        raise ValueError(f"eps: expected a non-negative number, got {eps}")
    norm_after_rope = norm_after_rope_from_position(qk_norm_position)
    if hq < 1 or hkv < 1:
        raise ValueError(f"head configuration: num_heads={hq} and num_kv_heads={hkv} must be >= 1")
    V.require_ndim("hidden_states", hidden_states, 3, "[batch, seq, hidden_size]")
    b, s, hidden = hidden_states.shape
    q_rows = "2*num_heads" if q_gate else "num_heads"
    kv_rows, kv = ("num_kv_heads", 1) if k_eq_v else ("2*num_kv_heads", 2)  # k_eq_v: no V rows
    V.require_ndim("qkv_weight", qkv_weight, 2, f"[({q_rows} + {kv_rows})*head_dim, hidden_size]")
    V.require_matching_hidden(hidden_states, qkv_weight)
    n_tot, w_hidden = qkv_weight.shape
    q_heads = 2 * hq if q_gate else hq
    heads_tot = q_heads + kv * hkv
    gate = " (q_gate: the Q rows are num_heads blocks of [q | gate], 2*head_dim rows each)" if q_gate else ""
    gate += " (k_eq_v: rows [Q | K], v is the raw k)" if k_eq_v else ""
    expected_rows = f"[({q_rows} + {kv_rows})*head_dim, hidden_size]"
    kv_n = f"{hkv}" if k_eq_v else f"2*{hkv}"
    # the head counts are the arguments; head_dim is the norm weights' where they give one, so a
    # qkv_weight a head short or long is named itself, not as a norm weight "of the wrong size"
    d_norm, d_from = _head_dim_of_norm_weights(q_norm_weight, k_norm_weight, hq, hkv, all_heads) if weighted \
        else (None, "")
    if w_hidden == hidden and d_norm is not None and n_tot != heads_tot * d_norm:
        held = (f"; its {n_tot} rows are {n_tot // d_norm} heads of head_dim {d_norm}, not {heads_tot}"
                if n_tot % d_norm == 0 else "")
        raise ValueError(
            f"qkv_weight: expected shape {expected_rows} = [({q_heads} + {kv_n})*{d_norm}, {hidden}] = "
            f"[{heads_tot * d_norm}, {hidden}]{gate} (head counts from num_heads={hq} and num_kv_heads={hkv}, "
            f"head_dim from {d_from}), got [{', '.join(map(str, qkv_weight.shape))}]{held}")
    if w_hidden != hidden or n_tot % heads_tot != 0 or n_tot == 0:
        raise ValueError(
            f"qkv_weight: expected shape {expected_rows} = [({q_heads} + {kv_n})*head_dim, {hidden}]{gate}, "
            f"got [{', '.join(map(str, qkv_weight.shape))}] (head counts from num_heads={hq} and "
            f"num_kv_heads={hkv}: {n_tot} rows are not a whole number of {heads_tot} heads)")
    d = n_tot // heads_tot
    d_src = (f"head_dim from qkv_weight's {n_tot} rows / {heads_tot} heads"
             + (f" and from {d_from}" if d_norm is not None else ""))
    V.require_head_config(hq, hkv, d, "from num_heads, num_kv_heads and qkv_weight")
    if all_heads:
        V.require_all_heads_head_dim(d, "from num_heads, num_kv_heads and qkv_weight")
    if weighted:
        if all_heads:
            V.require_shape("q_norm_weight", q_norm_weight, (hq * d,), "[num_heads*head_dim] for norm_scope='all_heads'")
            V.require_shape("k_norm_weight", k_norm_weight, (hkv * d,),
                            "[num_kv_heads*head_dim] for norm_scope='all_heads'")
        else:
            V.require_shape("q_norm_weight", q_norm_weight, (d,), "[head_dim]")
            V.require_shape("k_norm_weight", k_norm_weight, (d,), "[head_dim]")
    for n, t in (("cos", cos), ("sin", sin)):
        V.require_ndim(n, t, 3, "[batch, seq, rot] (rot: the rotary width, head_dim unless partial rotary)")
    if sin.shape[2] == d != cos.shape[2]:  # sin is head_dim wide: cos is the odd one out
        V.require_shape("cos", cos, (cos.shape[0], cos.shape[1], d), f"the rotary width of sin, {d_src}")
    rot = cos.shape[2]
    last = "head_dim" if rot == d else "rot"
    for n, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape[:2]) not in ((b, s), (1, s)):
            V.require_shape(n, t, (b, s, rot),
                            f"[batch, seq, {last}] or [1, seq, {last}], batch and seq from hidden_states")
    if sin.shape[2] != rot:
        V.require_shape("sin", sin, (sin.shape[0], s, rot), "the rotary width of cos")
    if rot > d and not weighted:
        # no norm weight says which is right: head_dim from the weight's rows, or cos/sin's width
        raise ValueError(
            f"qkv_weight / cos: qkv_weight's {n_tot} rows give head_dim {d} ({n_tot} / ({q_heads} + {kv_n}) heads "
            f"from num_heads and num_kv_heads), narrower than cos/sin's rotary width {rot}; expected qkv_weight "
            f"[{heads_tot * rot}, {hidden}] for head_dim {rot}, or cos/sin of an even width up to {d} (partial rotary)")
    if rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"cos/sin: rotary width {rot} (their last size) is not supported; expected an even size "
                         f"from 2 to head_dim={d} (partial rotary below head_dim; {d_src})")
    for n, t in named:
        V.require_float_dtype(n, t)
    dtype = V.require_same_dtype([("hidden_states", hidden_states), ("qkv_weight", qkv_weight), ("cos", cos), ("sin", sin)])
    device = V.require_same_device(named)
    variant = Variant(rot=0 if rot == d else rot, interleaved=interleaved, q_gate=q_gate, norm_weight=weighted,
                      all_heads=all_heads, v_norm=v_norm, k_eq_v=k_eq_v)
    return dict(batch=b, seq=s, hidden=hidden, num_heads=hq, num_kv_heads=hkv, head_dim=d, qkv=n_tot,
                eps=eps, norm_after_rope=norm_after_rope, dtype=dtype, device=device, variant=variant, rot=rot)


# ----------------------------------------------------------------------------- forward


def forward_launch_config(M: int, hq: int, hkv: int, d: int, device: torch.device) -> tuple[int, int, int]:
    """(tokens per program, heads per program, num_warps).

    A tile is [BLOCK_T, head_dim/2] ~ 1k elements. Head groups amortise the cos/sin loads; they
    shrink when the grid would otherwise leave SMs idle.
    """
    half_p2 = _next_pow2(d // 2)
    block_t = max(1, min(32, 1024 // half_p2))
    n_tb = -(-M // block_t)
    target = 4 * sm_count(device) if device.type == "cuda" else 1
    group = 1
    # 4 heads per program where the grid allows: on the H200 (16, 4, 4) beat (16, 8, 4) by 3-7 us at
    # 8192 tokens and trailed it by < 1 us at 2048 (NOTES "Session 8", forward stage tiles)
    for g in (4, 2):
        if n_tb * (-(-hq // g) + -(-hkv // g)) >= target:
            group = g
            break
    # 4 warps for every group: on the H200 the stage ran 8-25 % faster than with 8 warps for the
    # head groups at 2k-8k tokens (NOTES "Session 8"; the sweep: benchmarks/forward_sweep.py at 0333ee3)
    return block_t, group, 4


def plan_forward_stage(qkv: Ptr, wq: Optional[Ptr], wk: Optional[Ptr], cos: Ptr, sin: Ptr, q: Ptr, k: Ptr, rq: Ptr,
                       rk: Ptr, hq: int, hkv: int, eps: float, norm_after_rope: bool, cfg: config.Config,
                       variant: Variant = PLAIN, v: Optional[Ptr] = None) -> BoundLaunch:
    """The forward stage's launch over table slots: RoPE + RMSNorm of the q/k parts of ``qkv``
    ``[B, S, (Hq+2Hkv)*D]`` (last dim contiguous, batch and seq one token axis; ``2*Hq`` with a
    gate) into q/k ``[B, H, S, D]`` and rstd ``[B, H, S]`` fp32; with ``variant.v_norm`` also v
    into ``v`` ``[B, Hkv, S, D]``. ``wq``/``wk`` None: unweighted norms."""
    B, S, n_tot = qkv.like.shape
    D = n_tot // variant.qkv_heads(hq, hkv)
    M = B * S
    block_t, group, num_warps = cfg.forward_tile or forward_launch_config(M, hq, hkv, D, qkv.like.device)
    s_t = qkv.like.stride(1)
    if variant.all_heads:  # one program per token and head set, all its heads in one tile
        block_t = 1
        num_warps = cfg.forward_tile[2] if cfg.forward_tile else all_heads_warps(hq, hkv, variant.rotary(D) // 2, 32)
        nqg, nkg = 1, 1
    else:
        nqg, nkg = -(-hq // group), -(-hkv // group)
    nvg = -(-hkv // group) if variant.v_norm else 0
    if wq is None:  # unweighted: placeholders the kernel never reads
        wq = wk = cos
        w_strides = (0, 0)
    else:
        w_strides = (wq.like.stride(0), wk.like.stride(0))
    if v is None:
        v = q
    return BoundLaunch(
        rope_qk_norm_fwd_kernel, (-(-M // block_t), nqg + nkg + nvg),
        (qkv, s_t, wq, w_strides[0], wk, w_strides[1],
         cos, *cos.like.stride(), sin, *sin.like.stride(),
         q, *q.like.stride(), k, *k.like.stride(),
         rq, *rq.like.stride(), rk, *rk.like.stride(), v, *v.like.stride(),
         float(eps), M, S, hq, hkv, nqg),
        dict(D=D, BLOCK_T=block_t, GROUP=group, NORM_AFTER_ROPE=bool(norm_after_rope), D_P2=_next_pow2(D),
             **variant.constexprs(D), ALL_HEADS=variant.all_heads, **variant.head_tiles(hq, hkv),
             K_EQ_V=variant.k_eq_v, num_warps=num_warps),
    )


def rope_qk_norm_forward(qkv, wq, wk, cos, sin, hq, hkv, eps, norm_after_rope, variant: Variant = PLAIN,
                         backend: str = "triton"):
    """The forward stage, one unplanned call (the public entry point keeps plans): (q, k, rstd_q,
    rstd_k, v) as :func:`forward_torch` returns them. Arguments are already validated; cos/sin
    ``[B, S, rot]``."""
    if backend == "torch":
        return forward_torch(qkv, wq, wk, cos, sin, hq, hkv, eps, norm_after_rope, variant)
    B, S, n_tot = qkv.shape
    D = n_tot // variant.qkv_heads(hq, hkv)
    q, k, rq, rk, v = forward_outputs(B, S, hq, hkv, D, qkv.dtype, qkv.device, variant.v_norm)
    table = Table()
    named = dict(qkv=qkv, q_norm_weight=wq, k_norm_weight=wk, cos=cos, sin=sin, q=q, k=k, rstd_q=rq, rstd_k=rk, v=v)
    slots = [None if t is None else table.add(name, t) for name, t in named.items()]
    launch = plan_forward_stage(*slots[:9], hq, hkv, eps, norm_after_rope, config.current(), variant, slots[9])
    launch.launch(table.tensors(named), None, current_stream(qkv.device))
    return q, k, rq, rk, v


def token_major(B: int, H: int, S: int, D: int, dtype, device) -> torch.Tensor:
    """A [B, H, S, D] tensor laid out token-major ([B, S, H, D] in memory), as HF's q/k/v
    views of a projection output: attention kernels then return their output token-major too,
    and HF's ``transpose(1, 2).contiguous()`` before o_proj copies nothing."""
    # one call (not an empty [B, S, H, D] and a transpose), the strides torch gives that pair, zero sizes too
    return torch.empty_strided((B, H, S, D), (max(S, 1) * H * D, D, H * D, 1), dtype=dtype, device=device)


def forward_outputs(B: int, S: int, hq: int, hkv: int, D: int, dtype, device, v_norm: bool) -> tuple:
    """The forward stage's outputs, unfilled: q, k (token-major), rstd_q, rstd_k (fp32) and v
    (token-major where the variant norms it, else None)."""
    return (token_major(B, hq, S, D, dtype, device), token_major(B, hkv, S, D, dtype, device),
            torch.empty((B, hq, S), dtype=torch.float32, device=device),
            torch.empty((B, hkv, S), dtype=torch.float32, device=device),
            token_major(B, hkv, S, D, dtype, device) if v_norm else None)


def forward_torch(qkv, wq, wk, cos, sin, hq, hkv, eps, norm_after_rope, variant: Variant = PLAIN):
    """The forward stage on the torch backend: (q, k, rstd_q, rstd_k, v) as the Triton stage
    returns them (fp32 math, one rounding); v None unless ``variant.v_norm``."""
    B, S, n_tot = qkv.shape
    D = n_tot // variant.qkv_heads(hq, hkv)
    q, k, rq, rk, v = forward_outputs(B, S, hq, hkv, D, qkv.dtype, qkv.device, variant.v_norm)
    _forward_torch(qkv, wq, wk, cos, sin, q, k, rq, rk, v, hq, hkv, D, eps, norm_after_rope, variant)
    return q, k, rq, rk, v


def _forward_torch(qkv, wq, wk, cos, sin, q, k, rq, rk, v, hq, hkv, D, eps, norm_after_rope, variant):
    rot, il = variant.rotary(D), variant.interleaved
    xq, xk, xv, _ = heads_of(qkv, hq, hkv, D, variant.q_gate, variant.k_eq_v)
    ct = torch.promote_types(qkv.dtype, torch.float32)  # fp32 math (fp64 for fp64 inputs: the gradient checks)
    c = pad_rotary(cos.to(ct), D, 1.0).unsqueeze(1)
    s = pad_rotary(sin.to(ct), D, 0.0).unsqueeze(1)

    def head_set(x, w, out, r_out):
        x = x.to(ct)
        H = x.shape[1]
        if norm_after_rope:
            x = x * c + rotate(x, rot, il) * s
        if variant.all_heads:  # one RMS over every head of a token
            r = torch.rsqrt(x.pow(2).mean(dim=(1, 3), keepdim=True) + eps).expand(-1, H, -1, -1)
        else:
            r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = x * r
        if w is not None:
            y = y * (w.to(ct).view(H, 1, D) if variant.all_heads else w.to(ct))
        if not norm_after_rope:
            y = y * c + rotate(y, rot, il) * s
        out.copy_(y)
        r_out.copy_(r[..., 0])

    head_set(xq, wq, q, rq)
    head_set(xk, wk, k, rk)
    if v is not None:
        x = xv.to(ct)
        v.copy_(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))
