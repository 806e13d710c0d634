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

import torch

from . import config
from . import validation as V
from .device import sm_count
from .launch import BoundLaunch, Ptr, next_pow2 as _next_pow2

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


def validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                            num_heads, num_kv_heads, eps, qk_norm_position) -> dict:
    """Check the public forward arguments; returns the derived sizes.

    cos/sin may be ``[batch, seq, head_dim]`` or ``[1, seq, head_dim]`` (shared by the batch).
    """
    for n, t in (("hidden_states", hidden_states), ("qkv_weight", qkv_weight), ("q_norm_weight", q_norm_weight),
                 ("k_norm_weight", k_norm_weight), ("cos", cos), ("sin", sin)):
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
    V.require_ndim("qkv_weight", qkv_weight, 2, "[(num_heads + 2*num_kv_heads)*head_dim, hidden_size]")
    V.require_matching_hidden(hidden_states, qkv_weight)
    n_tot, w_hidden = qkv_weight.shape
    heads_tot = hq + 2 * hkv
    if w_hidden != hidden or n_tot % heads_tot != 0 or n_tot == 0:
        raise ValueError(
            f"qkv_weight: expected shape [(num_heads + 2*num_kv_heads)*head_dim, hidden_size] = "
            f"[({hq} + 2*{hkv})*head_dim, {hidden}], got [{', '.join(map(str, qkv_weight.shape))}]")
    d = n_tot // heads_tot
    V.require_head_config(hq, hkv, d, "from num_heads, num_kv_heads and qkv_weight")
    V.require_shape("q_norm_weight", q_norm_weight, (d,), "[head_dim]")
    V.require_shape("k_norm_weight", k_norm_weight, (d,), "[head_dim]")
    for n, t in (("cos", cos), ("sin", sin)):
        V.require_ndim(n, t, 3, "[batch, seq, head_dim]")
        if tuple(t.shape) not in ((b, s, d), (1, s, d)):
            V.require_shape(n, t, (b, s, d), "[batch, seq, head_dim] or [1, seq, head_dim]")
    for n, t in (("hidden_states", hidden_states), ("qkv_weight", qkv_weight), ("q_norm_weight", q_norm_weight),
                 ("k_norm_weight", k_norm_weight), ("cos", cos), ("sin", sin)):
        V.require_float_dtype(n, t)
    dtype = V.require_same_dtype([("hidden_states", hidden_states), ("qkv_weight", qkv_weight), ("cos", cos), ("sin", sin)])
    device = V.require_same_device([("hidden_states", hidden_states), ("qkv_weight", qkv_weight),
                                    ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight),
                                    ("cos", cos), ("sin", sin)])
    return dict(batch=b, seq=s, hidden=hidden, num_heads=hq, num_kv_heads=hkv, head_dim=d, qkv=n_tot,
                eps=eps, norm_after_rope=norm_after_rope, dtype=dtype, device=device)


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
    # head groups at 2k-8k tokens (benchmarks/forward_sweep.py, NOTES "Session 8")
    return block_t, group, 4


def plan_forward_stage(qkv: Ptr, wq: Ptr, wk: Ptr, cos: Ptr, sin: Ptr, q: Ptr, k: Ptr, rq: Ptr, rk: Ptr,
                       hq: int, hkv: int, eps: float, norm_after_rope: bool, cfg: config.Config) -> BoundLaunch:
    """The forward stage's launch over table slots: RoPE + RMSNorm of the q/k parts of ``qkv``
    ``[B, S, (Hq+2Hkv)*D]`` (last dim contiguous, batch and seq one token axis) into q/k
    ``[B, H, S, D]`` and rstd ``[B, H, S]`` fp32."""
    B, S, n_tot = qkv.like.shape
    D = n_tot // (hq + 2 * hkv)
    M = B * S
    block_t, group, num_warps = cfg.forward_tile or forward_launch_config(M, hq, hkv, D, qkv.like.device)
    s_t = qkv.like.stride(1)
    nqg = -(-hq // group)
    return BoundLaunch(
        rope_qk_norm_fwd_kernel, (-(-M // block_t), nqg + -(-hkv // group)),
        (qkv, s_t, wq, wq.like.stride(0), wk, wk.like.stride(0),
         cos, *cos.like.stride(), sin, *sin.like.stride(),
         q, *q.like.stride(), k, *k.like.stride(),
         rq, *rq.like.stride(), rk, *rk.like.stride(),
         float(eps), M, S, hq, hkv, nqg),
        dict(D=D, HALF=D // 2, HALF_P2=_next_pow2(D // 2), BLOCK_T=block_t, GROUP=group,
             NORM_AFTER_ROPE=bool(norm_after_rope), num_warps=num_warps),
    )


def token_major(B: int, H: int, S: int, D: int, dtype, device) -> torch.Tensor:
    """A [B, H, S, D] tensor laid out token-major ([B, S, H, D] in memory), as HF's q/k/v
    views of a projection output: attention kernels then return their output token-major too,
    and HF's ``transpose(1, 2).contiguous()`` before o_proj copies nothing."""
    return torch.empty((B, S, H, D), dtype=dtype, device=device).transpose(1, 2)


def forward_torch(qkv, wq, wk, cos, sin, hq, hkv, eps, norm_after_rope):
    """The forward stage on the torch backend: (q, k, rstd_q, rstd_k) as the Triton stage
    returns them (fp32 math, one rounding)."""
    B, S, n_tot = qkv.shape
    D = n_tot // (hq + 2 * hkv)
    q = token_major(B, hq, S, D, qkv.dtype, qkv.device)
    k = token_major(B, hkv, S, D, qkv.dtype, qkv.device)
    rq = torch.empty((B, hq, S), dtype=torch.float32, device=qkv.device)
    rk = torch.empty((B, hkv, S), dtype=torch.float32, device=qkv.device)
    _forward_torch(qkv, wq, wk, cos, sin, q, k, rq, rk, hq, hkv, D, eps, norm_after_rope)
    return q, k, rq, rk


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _forward_torch(qkv, wq, wk, cos, sin, q, k, rq, rk, hq, hkv, D, eps, norm_after_rope):
    B, S, _ = qkv.shape
    heads = qkv.view(B, S, hq + 2 * hkv, D)  # sizes, not -1: zero tokens are valid
    c = cos.float().unsqueeze(1)
    s = sin.float().unsqueeze(1)

    def head_set(x, w, out, r_out):
        x = x.transpose(1, 2).float()
        if norm_after_rope:
            x = x * c + _rotate_half(x) * s
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = x * r * w.float()
        if not norm_after_rope:
            y = y * c + _rotate_half(y) * s
        out.copy_(y)
        r_out.copy_(r[..., 0])

    head_set(heads[:, :, :hq], wq, q, rq)
    head_set(heads[:, :, hq: hq + hkv], wk, k, rk)
