"""SOL-ExecBench 091: backward of the fused GQA QKV projection + RoPE + QK-norm.

``gqa_qkv_rope_qk_norm_backward`` takes the definition's 14 inputs and returns
its 6 outputs. It reproduces the eager reference's low-precision rounding points
(``exact`` mode of the RoPE/QK-norm stage), so dQKV matches the reference's
``grad_qkv_states`` and the result passes the official tolerance check; then
dX = dQKV . W and dW = dQKV^T . X run on cuBLAS, or to ~2.5k tokens partly as Triton TMA kernels chained
behind the stage (``ops/projection.py``).

Head counts and sizes come from the tensors: 091's configuration (32 query heads,
8 KV heads, head_dim 128, hidden 4096) is one of many.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import plan
from . import validation as V

OUTPUT_NAMES = (
    "grad_hidden_states", "grad_cos", "grad_sin", "grad_qkv_weight", "grad_q_norm_weight", "grad_k_norm_weight",
)
INPUT_NAMES = (
    "grad_query", "grad_key", "grad_value", "hidden_states", "cos", "sin", "qkv_weight",
    "q_norm_weight", "k_norm_weight", "query_pre_norm", "key_pre_norm", "q_rstd", "k_rstd", "eps",
)


def _check_rstd(name: str, r: torch.Tensor, b: int, h: int, s: int) -> None:
    if r.dim() == 4:
        V.require_shape(name, r, (b, h, s, 1), "[batch, heads, seq, 1]")
    elif r.dim() == 3:
        V.require_shape(name, r, (b, h, s), "[batch, heads, seq]")
    else:
        raise ValueError(f"{name}: expected shape [{b}, {h}, {s}, 1] ([batch, heads, seq, 1]) or [{b}, {h}, {s}], "
                         f"got [{', '.join(map(str, r.shape))}]")


def validate_backward_inputs(args: Sequence) -> dict:
    """Check the 14 inputs of the 091 backward; returns the derived sizes.

    Order: types and layouts, eps, shapes (sizes are derived from grad_query and
    grad_key and every other argument is checked against them), dtypes, devices.
    """
    if len(args) != len(INPUT_NAMES):
        raise TypeError(f"gqa_qkv_rope_qk_norm_backward: expected {len(INPUT_NAMES)} inputs "
                        f"({', '.join(INPUT_NAMES)}), got {len(args)}")
    named = dict(zip(INPUT_NAMES, args))
    tensors = [(n, V.require_tensor(n, named[n])) for n in INPUT_NAMES if n != "eps"]
    V.require_number("eps", named["eps"], min_value=0.0)
    gq, gk, gv = named["grad_query"], named["grad_key"], named["grad_value"]
    V.require_ndim("grad_query", gq, 4, "[batch, num_heads, seq, head_dim]")
    V.require_ndim("grad_key", gk, 4, "[batch, num_kv_heads, seq, head_dim]")
    b, hq, s, d = gq.shape
    hkv = gk.shape[1]
    if gk.shape[0] != b or gk.shape[2] != s or gk.shape[3] != d:
        raise ValueError(
            f"grad_key: expected shape [{b}, num_kv_heads, {s}, {d}] (batch, seq and head_dim of grad_query), "
            f"got [{', '.join(map(str, gk.shape))}]"
        )
    V.require_head_config(hq, hkv, d, "num_heads from grad_query.shape[1], num_kv_heads from grad_key.shape[1], "
                                      "head_dim from grad_query.shape[3]")
    V.require_shape("grad_value", gv, (b, hkv, s, d), "like grad_key")
    V.require_shape("query_pre_norm", named["query_pre_norm"], (b, hq, s, d), "like grad_query")
    V.require_shape("key_pre_norm", named["key_pre_norm"], (b, hkv, s, d), "like grad_key")
    hs = named["hidden_states"]
    V.require_ndim("hidden_states", hs, 3, "[batch, seq, hidden_size]")
    if hs.shape[0] != b or hs.shape[1] != s:
        raise ValueError(f"hidden_states: expected shape [{b}, {s}, hidden_size] (batch and seq of grad_query), got [{', '.join(map(str, hs.shape))}]")
    hidden = hs.shape[2]
    qkv = (hq + 2 * hkv) * d
    V.require_matching_hidden(hs, named["qkv_weight"], rows=qkv)
    V.require_shape("qkv_weight", named["qkv_weight"], (qkv, hidden),
                    f"[(num_heads + 2*num_kv_heads)*head_dim, hidden_size] = [({hq} + 2*{hkv})*{d}, {hidden}]")
    V.require_shape("cos", named["cos"], (b, s, d), "[batch, seq, head_dim]")
    V.require_shape("sin", named["sin"], (b, s, d), "[batch, seq, head_dim]")
    V.require_shape("q_norm_weight", named["q_norm_weight"], (d,), "[head_dim]")
    V.require_shape("k_norm_weight", named["k_norm_weight"], (d,), "[head_dim]")
    _check_rstd("q_rstd", named["q_rstd"], b, hq, s)
    _check_rstd("k_rstd", named["k_rstd"], b, hkv, s)
    for n, t in tensors:
        V.require_float_dtype(n, t)
    act = [(n, named[n]) for n in ("grad_query", "grad_key", "grad_value", "hidden_states", "cos", "sin",
                                   "qkv_weight", "query_pre_norm", "key_pre_norm")]
    dtype = V.require_same_dtype(act)
    # one dtype for both norm-weight gradients (they follow the weights' dtype)
    V.require_same_dtype([("q_norm_weight", named["q_norm_weight"]), ("k_norm_weight", named["k_norm_weight"])])
    device = V.require_same_device(tensors)
    return dict(batch=b, seq=s, num_heads=hq, num_kv_heads=hkv, head_dim=d, hidden=hidden, qkv=qkv,
                dtype=dtype, device=device, norm_dtype=named["q_norm_weight"].dtype,
                inputs=tensors)


def output_specs(sizes: dict) -> list:
    b, s, d, h, qkv, dt = sizes["batch"], sizes["seq"], sizes["head_dim"], sizes["hidden"], sizes["qkv"], sizes["dtype"]
    return V.OutputSpecs([
        ("grad_hidden_states", (b, s, h), dt),
        ("grad_cos", (b, s, d), dt),
        ("grad_sin", (b, s, d), dt),
        ("grad_qkv_weight", (qkv, h), dt),
        ("grad_q_norm_weight", (d,), sizes["norm_dtype"]),
        ("grad_k_norm_weight", (d,), sizes["norm_dtype"]),
    ], inputs=sizes.get("inputs", ()))


def gqa_qkv_rope_qk_norm_backward(
    grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight, q_norm_weight, k_norm_weight,
    query_pre_norm, key_pre_norm, q_rstd, k_rstd, eps, *, out: Optional[Sequence[torch.Tensor]] = None,
    backend: Optional[str] = None,
):
    """Backward of SOL-ExecBench 091 ``fused_gqa_qkv_rope_qk_norm_backward``.

    Returns ``(grad_hidden_states, grad_cos, grad_sin, grad_qkv_weight,
    grad_q_norm_weight, grad_k_norm_weight)``. With ``out=`` (six tensors of those
    shapes and dtypes) the results are written there and the same tensors returned.
    ``backend`` forces ``"triton"`` or ``"torch"``; by default CUDA tensors use Triton
    and cuBLAS, CPU tensors the vectorised PyTorch path. The work is planned once per
    input signature (:mod:`fusedqkv.ops.plan`).
    """
    args = (grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight, q_norm_weight, k_norm_weight,
            query_pre_norm, key_pre_norm, q_rstd, k_rstd, eps)
    if torch.is_grad_enabled():  # a backward: inputs may carry autograd history (mm(out=) refuses it)
        torch._C._set_grad_enabled(False)
        try:
            return plan.backward_091(args, out, backend)
        finally:
            torch._C._set_grad_enabled(True)
    return plan.backward_091(args, out, backend)
