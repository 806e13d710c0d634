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

from . import projection, single_launch
from . import validation as V
from .rope_qk_norm import pick_backend, rope_qk_norm_backward, sm_count

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


def _as_matrix(t: torch.Tensor, rows: int, cols: int) -> Optional[torch.Tensor]:
    """``t`` as a [rows, cols] view (no copy), or None when its strides do not allow one."""
    try:
        return t.view(rows, cols)
    except RuntimeError:
        return None


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if out.is_contiguous():
        torch.mm(a, b, out=out)
    else:  # a strided destination: cuBLAS writes contiguous memory
        out.copy_(torch.mm(a, b).view(out.shape))


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
    and cuBLAS, CPU tensors the vectorised PyTorch path.
    """
    with torch.no_grad():  # a backward: inputs may carry autograd history (mm(out=) refuses it)
        args = (grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight, q_norm_weight, k_norm_weight,
                query_pre_norm, key_pre_norm, q_rstd, k_rstd, eps)
        sz = validate_backward_inputs(args)
        specs = output_specs(sz)
        device = sz["device"]
        backend = pick_backend(device, backend)
        if out is None:
            out = tuple(torch.empty(shape, dtype=dt, device=device) for _, shape, dt in specs)
        else:
            out = V.require_out(out, specs, device)
        g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = out
        M = sz["batch"] * sz["seq"]
        # every allocation before the first launch: the GPU must not wait on the host
        dqkv = torch.empty((M, sz["qkv"]), dtype=sz["dtype"], device=device)
        if backend == "triton" and single_launch.eligible(M, sz["head_dim"], sz["dtype"], device):
            x2d = _as_matrix(hidden_states, M, sz["hidden"])
            dx2d = _as_matrix(g_hidden, M, sz["hidden"])
            if x2d is not None and dx2d is not None:
                # few tokens: stage and both products in one persistent launch
                single_launch.backward(grad_query, grad_key, grad_value, query_pre_norm, key_pre_norm, q_rstd, k_rstd,
                                       q_norm_weight, k_norm_weight, cos, sin, x2d, qkv_weight, dqkv=dqkv, dx2d=dx2d,
                                       dw=g_weight, gcos=g_cos, gsin=g_sin, gwq=g_qw, gwk=g_kw)
                return out
        # the products' operands and launches prepared before the stage's launch: between the
        # launches the host does nothing but enqueue (at a few hundred tokens the GPU waits for it)
        x2d = _as_matrix(hidden_states, M, sz["hidden"])  # None: no view; cuBLAS then reads a copy
        x = x2d if x2d is not None else hidden_states.reshape(M, sz["hidden"])
        dx = g_hidden.view(M, sz["hidden"]) if g_hidden.is_contiguous() else g_hidden
        sms = sm_count(device)
        # which products run where: "chain" (few tokens: both products as Triton launches chained
        # behind the stage -- a torch.mm costs the host ~15 us before its kernel is queued, and the
        # GPU would wait -- dX and dW side by side on the GPU), "hybrid" (to ~2.5k tokens: dW in
        # Triton right behind the stage, the cuBLAS dX queued while it runs), or cuBLAS both
        path = "cublas"
        if backend == "triton" and x2d is not None:
            if dx.dim() == 2 and projection.chain_eligible(M, sz["dtype"], device, sms, dqkv, qkv_weight, x2d, dx,
                                                           g_weight):
                path = "chain"
            elif projection.hybrid_eligible(M, sz["dtype"], device, dqkv, x2d, g_weight):
                path = "hybrid"
        # with a Triton dW the stage leaves its norm-weight finish (a chain of L2 round trips at
        # its end) to dW, which runs it on a program with a tile less
        finish_in_dw = path != "cublas" and projection.NORM_FINISH_IN_DW
        launch_stage, finish = rope_qk_norm_backward(
            grad_query, grad_key, grad_value, query_pre_norm, key_pre_norm, q_rstd, k_rstd,
            q_norm_weight, k_norm_weight, cos, sin,
            dqkv=dqkv, grad_cos=g_cos, grad_sin=g_sin, grad_q_norm_weight=g_qw, grad_k_norm_weight=g_kw,
            exact=True, norm_after_rope=True, saved_rotated=True, backend=backend, scratch=g_hidden, deferred=True,
            finish_outside=finish_in_dw,
        )
        launch_dx = launch_dw = None  # None: torch.mm (cuBLAS)
        if path == "chain":
            launch_dx, launch_dw = projection.chain_launches(dqkv, qkv_weight, x2d, dx, g_weight, sms,
                                                             finish=finish if finish_in_dw else None)
        elif path == "hybrid":
            launch_dw = projection.hybrid_dw_launch(dqkv, x2d, g_weight, sms, finish=finish if finish_in_dw else None)
        launch_stage()
        if launch_dx is not None:
            launch_dx()
        if launch_dw is not None:
            launch_dw()
        if launch_dx is None:
            _mm_into(dqkv, qkv_weight, dx)
        if launch_dw is None:
            _mm_into(dqkv.t(), x, g_weight)
        if not finish_in_dw:  # (else dW has run it)
            finish()
        return out
