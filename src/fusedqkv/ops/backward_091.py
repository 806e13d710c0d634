"""SOL-ExecBench 091: backward of the fused GQA QKV projection + RoPE + QK-norm, planned.

``gqa_qkv_rope_qk_norm_backward`` takes the definition's 14 inputs and returns its 6 outputs.
It reproduces the eager reference's low-precision rounding points (``exact`` mode of the
RoPE/QK-norm stage, :mod:`fusedqkv.ops.rope_qk_norm`), so dQKV matches the reference's
``grad_qkv_states`` and the result passes the official tolerance check; then dX = dQKV . W and
dW = dQKV^T . X run on cuBLAS, or to ~2.5k tokens partly as Triton TMA kernels chained behind
the stage (:mod:`fusedqkv.ops.projection`).

Head counts and sizes come from the tensors: 091's configuration (32 query heads, 8 KV heads,
head_dim 128, hidden 4096) is one of many. This module is the exported solution's entry point:
what it imports is what the solution ships (no training code).

A call is planned once per input signature (:mod:`fusedqkv.ops.plan_cache`): the plan holds
the path, the launches (their tensor arguments are named table entries) and the planned
cuBLASLt products; a call passes addresses.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import config as _config
from . import device as _device
from . import validation as V
from .cublaslt import lt_matmul
from .device import current_stream, sm_count
from .internals import refuse_functorch_wrapped, set_grad_enabled
from .launch import Table
from .plan_cache import PlanCache, as_matrix, mm_into
from .projection import chain_launches, choose_products, hybrid_dw_launch, hybrid_dx_first
from .rope_qk_norm import backward_torch, pick_backend, plan_backward_stage

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


def _require_head_counts_agree(named: dict, b: int, s: int, d: int) -> None:
    """Head counts come from grad_query and grad_key; where the two other tensors of their side
    agree with each other and not with them, the gradient is the odd one out: name it."""
    for grad, others, what in (("grad_key", ("grad_value", "key_pre_norm", "k_rstd"), "num_kv_heads"),
                               ("grad_query", ("query_pre_norm", "q_rstd"), "num_heads")):
        heads = [named[n].shape[1] for n in others if named[n].dim() >= 3]
        if len(heads) == len(others) and len(set(heads)) == 1 and heads[0] != named[grad].shape[1]:
            raise ValueError(f"{grad}: expected shape [{b}, {heads[0]}, {s}, {d}] ({what} from "
                             f"{' and '.join(others)}), got [{', '.join(map(str, named[grad].shape))}]")


def _require_grad_query_agrees(named: dict) -> None:
    """Batch, seq and head_dim come from grad_query; where grad_key disagrees with it but agrees
    with grad_value, query_pre_norm and key_pre_norm, grad_query is the odd one out: name it."""
    others = ("grad_key", "grad_value", "query_pre_norm", "key_pre_norm")
    dims = {(t.shape[0], t.shape[2], t.shape[3]) for t in (named[n] for n in others)
            if isinstance(t, torch.Tensor) and t.dim() == 4}
    gq = named["grad_query"]
    if len(dims) == 1 and all(named[n].dim() == 4 for n in others):
        (b, s, d), = dims
        if (gq.shape[0], gq.shape[2], gq.shape[3]) != (b, s, d):
            raise ValueError(f"grad_query: expected shape [{b}, num_heads, {s}, {d}] (batch, seq and head_dim from "
                             f"{', '.join(others[:-1])} and {others[-1]}), got [{', '.join(map(str, gq.shape))}]")


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
        _require_grad_query_agrees(named)
        raise ValueError(
            f"grad_key: expected shape [{b}, num_kv_heads, {s}, {d}] (batch, seq and head_dim of grad_query), "
            f"got [{', '.join(map(str, gk.shape))}]"
        )
    # before the head configuration: a gradient one head off is named, not "num_heads=3 is not divisible"
    _require_head_counts_agree(named, b, s, d)
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
    w = named["qkv_weight"]
    if w.dim() == 2 and w.shape[1] == hidden and w.shape[0] != qkv:
        held = f"; its {w.shape[0]} rows are {w.shape[0] // d} heads, not {hq + 2 * hkv}" if w.shape[0] % d == 0 else ""
        raise ValueError(f"qkv_weight: expected shape [{qkv}, {hidden}] ([(num_heads + 2*num_kv_heads)*head_dim, "
                         f"hidden_size] = [({hq} + 2*{hkv})*{d}, {hidden}]), got [{w.shape[0]}, {w.shape[1]}] "
                         f"(num_heads from grad_query, num_kv_heads from grad_key, head_dim from grad_query{held})")
    V.require_shape("qkv_weight", w, (qkv, hidden),
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



# the stage's inputs, named as the table entries they are (INPUT_NAMES' tensors, in stage order)
STAGE_INPUTS = ("grad_query", "grad_key", "grad_value", "query_pre_norm", "key_pre_norm", "q_rstd", "k_rstd",
                "q_norm_weight", "k_norm_weight", "cos", "sin")
# a bound call's addresses, in this order (then the stage's own entries, ``StagePlan.call_inputs``' order)
RUN_ORDER = STAGE_INPUTS + OUTPUT_NAMES + ("hidden_states", "qkv_weight", "dqkv")
AT_X, AT_W, AT_DQKV = 17, 18, 19
AT_DX, AT_DW = 11, 14  # grad_hidden_states, grad_qkv_weight


class Backward091Plan:
    """The 091 backward of one input signature. ``path``: ``"torch"`` (the CPU path, or no
    tokens), or the products' placement behind the Triton stage: ``"chain"``, ``"hybrid"`` or
    ``"cublas"``."""

    def __init__(self, cfg, path, out_specs, device, backend, stage=None, table=None, launches=(),
                 mm_dx=False, mm_dw=False, finish=None, x_view=None, dx_view=None, in_spans=(),
                 out_spans=(), aligned=True, dqkv_shape=None, dtype=None, lt_dx=None, lt_dw=None):
        self.cfg, self.path, self.out_specs, self.device, self.backend = cfg, path, out_specs, device, backend
        self.lt_dx, self.lt_dw = lt_dx, lt_dw  # the cuBLAS products as planned cuBLASLt calls, or None
        self.stage, self.table, self.launches = stage, table, list(launches)
        # the launches queued before and after the dX product (the hybrid's dW, its last, behind a cuBLAS dX)
        split = len(self.launches) - (1 if path == "hybrid" and hybrid_dx_first(dqkv_shape[0], cfg) else 0)
        self.before_dx, self.after_dx = self.launches[:split], self.launches[split:]
        self.mm_dx, self.mm_dw, self.finish = mm_dx, mm_dw, finish
        self.x_view, self.dx_view = x_view, dx_view  # (rows, cols) views, or None
        self.in_spans, self.out_spans = in_spans, out_spans
        self.aligned = aligned
        self.dqkv_shape, self.dtype = dqkv_shape, dtype
        self.is_cuda = device.type == "cuda"
        self.dqkv_bytes = dqkv_shape[0] * dqkv_shape[1] * dtype.itemsize if dqkv_shape is not None else 0
        self._checked = None  # the addresses of the last call that passed the address checks
        self._gather = None  # RUN_ORDER's addresses -> the table's, once every launch is bound to its kernel
        self._kept = None  # (the stream's dQKV buffer, dQKV: a view of it)

    def _workspace(self, stream: int, capturing: bool) -> torch.Tensor:
        """dQKV: where it is small, a view of the stream's kept buffer (calls on one stream never
        overlap on the GPU, so the next call's stage writes it only after this call's products
        read it, whichever plan made either call); per call, and not remembered, where it is large
        or while a CUDA graph is being captured (the plan must not keep a graph's memory alive)."""
        if capturing or self.dqkv_bytes > _device.DQKV_KEPT_BYTES:
            return torch.empty(self.dqkv_shape, dtype=self.dtype, device=self.device)
        buf = _device.workspace("dqkv", self.device, stream, self.dqkv_bytes, False)
        kept = self._kept
        if kept is None or kept[0] is not buf:
            kept = self._kept = (buf, buf[:self.dqkv_bytes].view(self.dtype).view(self.dqkv_shape))
        return kept[1]

    def _outputs(self, args, out):
        if out is not None:
            return tuple(out)
        # each like the input of its dtype (validated: hidden_states, cos, sin, qkv_weight share one, the norm
        # weights theirs): new_empty skips torch.empty's dtype and device arguments
        (_, _, _, hs, cos, sin, W, wq, wk) = args[:9]
        s_x, s_cos, s_sin, s_w, s_qw, s_kw = (shape for _, shape, _ in self.out_specs)
        return (hs.new_empty(s_x), cos.new_empty(s_cos), sin.new_empty(s_sin), W.new_empty(s_w), wq.new_empty(s_qw),
                wk.new_empty(s_kw))

    def needs_no_grad(self) -> bool:
        """Whether a call may reach ``torch.mm(out=)`` (which refuses inputs with autograd history):
        the torch path, the first call (through the JIT), a product without a planned cuBLASLt call."""
        return (self._gather is None or (self.mm_dx and self.lt_dx is None) or (self.mm_dw and self.lt_dw is None))

    def run(self, args, out):
        if self.path == "torch":
            return self._run_torch(args, out)
        (gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, _) = args
        outs = self._outputs(args, out)
        g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = outs
        stream = current_stream(self.device)
        capturing = _device.capturing(self.device)
        dqkv = self._workspace(stream, capturing) if self.is_cuda else torch.empty(self.dqkv_shape, dtype=self.dtype,
                                                                                    device=self.device)
        inputs = (gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin)
        in_ptrs = [t.data_ptr() for t in inputs]
        out_ptrs = [t.data_ptr() for t in outs]
        w_ptr, x_ptr = W.data_ptr(), hs.data_ptr()
        seen = in_ptrs + out_ptrs
        seen.append(x_ptr)
        seen.append(w_ptr)
        if seen != self._checked:  # the address checks depend on nothing else (the spans are the plan's)
            if out is not None and V.overlaps_any(out_ptrs, self.out_spans, in_ptrs + [x_ptr, w_ptr], self.in_spans):
                # raises, naming the arguments
                V.require_out(out, self.out_specs, self.device, inputs=list(zip(INPUT_NAMES, args[:13])))
            if self.aligned:
                acc = 0
                for p in seen:
                    acc |= p
                if acc & 15:  # an address the kernels were not specialised for: its own plan
                    return _run(_plan_for_alignment(self, args, out), args, out)
            self._checked = seen
        extra = self.stage.kept_inputs(stream, capturing)
        launches = self.launches
        if self._gather is not None:
            seen = seen + [dqkv.data_ptr(), *[t.data_ptr() for t in extra.values()]]  # (_checked keeps the first part)
            ptrs = self._gather(seen)
            for launch in launches:  # every descriptor before the first launch
                launch.encode(ptrs)
            tensors = None
        else:  # the first call of a fresh plan, and every call under the interpreter
            named = dict(zip(STAGE_INPUTS, inputs))
            named.update(extra, dqkv=dqkv, grad_cos=g_cos, grad_sin=g_sin, grad_q_norm_weight=g_qw,
                         grad_k_norm_weight=g_kw, grad_qkv_weight=g_weight, qkv_weight=W,
                         grad_hidden_states=g_hidden.view(self.dx_view) if self.dx_view else g_hidden,
                         hidden_states=hs.view(self.x_view) if self.x_view else hs)
            tensors = self.table.tensors(named)
            ptrs = None
        for launch in self.before_dx:
            launch.launch(tensors, ptrs, stream)
        if self.mm_dx:
            if self.lt_dx is not None and ptrs is not None:
                self.lt_dx(seen[AT_DQKV], seen[AT_W], seen[AT_DX], stream, capturing)
            else:
                mm_into(dqkv, W, g_hidden.view(self.dx_view) if self.dx_view else g_hidden)
        for launch in self.after_dx:
            launch.launch(tensors, ptrs, stream)
        if self.mm_dw:
            if self.lt_dw is not None and ptrs is not None:
                self.lt_dw(seen[AT_DQKV], seen[AT_X], seen[AT_DW], stream, capturing)
            else:
                x = hs.view(self.x_view) if self.x_view else hs.reshape(self.dqkv_shape[0], -1)
                mm_into(dqkv.t(), x, g_weight)
        if self.finish is not None:
            self.finish.launch(tensors, ptrs, stream)
        if self._gather is None and all(launch.bound for launch in launches + [self.finish] if launch is not None):
            # every launch compiled and bound: later calls pass addresses only
            self._gather = self.table.gather(RUN_ORDER + tuple(extra))
        return outs

    def _run_torch(self, args, out):
        (gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, eps) = args
        outs = self._outputs(args, out)
        g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = outs
        if out is not None:
            V.require_out(out, self.out_specs, self.device, inputs=list(zip(INPUT_NAMES, args[:13])))
        M, hidden = gq.shape[0] * gq.shape[2], hs.shape[2]
        dqkv = torch.empty((M, W.shape[0]), dtype=gq.dtype, device=self.device)
        backward_torch(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, g_cos, g_sin, g_qw, g_kw,
                       True, True, True, V.require_number("eps", eps))
        mm_into(dqkv, W, g_hidden.view(M, hidden) if g_hidden.is_contiguous() else g_hidden)
        mm_into(dqkv.t(), hs.reshape(M, hidden), g_weight)
        return outs


def build_backward_091(args, out, backend, *, cfg) -> Backward091Plan:
    """Validate the 14 arguments (and ``out``) fully, choose the path and plan its launches."""
    sz = validate_backward_inputs(args)
    specs = output_specs(sz)
    device = sz["device"]
    if out is not None:
        out = V.require_out(out, specs, device)
    specs = V.OutputSpecs(list(specs))  # without the inputs: a plan keeps no call's tensors
    backend = pick_backend(device, backend)
    (gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, eps) = args
    M, hidden = sz["batch"] * sz["seq"], sz["hidden"]
    if backend == "torch" or M == 0:
        return Backward091Plan(cfg, "torch", specs, device, backend)
    outs = tuple(out) if out is not None else tuple(torch.empty(s, dtype=dt, device=device) for _, s, dt in specs)
    g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = outs
    dqkv = torch.empty((M, sz["qkv"]), dtype=sz["dtype"], device=device)
    x2d = as_matrix(hs, M, hidden)  # None: no view; cuBLAS then reads a copy
    dx = g_hidden.view(M, hidden) if g_hidden.is_contiguous() else g_hidden
    sms = sm_count(device)
    path = choose_products(M, sz["dtype"], device, sms, dqkv, W, x2d, dx, g_weight, cfg)
    table = Table()
    inputs = (gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin)
    s_in = [table.add(name, t) for name, t in zip(STAGE_INPUTS, inputs)]
    s_dqkv = table.add("dqkv", dqkv)
    s_gcos, s_gsin = table.add("grad_cos", g_cos), table.add("grad_sin", g_sin)
    s_gqw, s_gkw = table.add("grad_q_norm_weight", g_qw), table.add("grad_k_norm_weight", g_kw)
    # dX's memory: the stage's scratch for its fp32 partials (dX overwrites it afterwards)
    s_dx = table.add("grad_hidden_states", dx)
    if path != "cublas":
        s_w, s_x, s_dw = table.add("qkv_weight", W), table.add("hidden_states", x2d), table.add("grad_qkv_weight", g_weight)
    # with a Triton dW the stage leaves its norm-weight finish (a chain of L2 round trips at its
    # end) to dW, which runs it on a program with a tile less
    finish_in_dw = path != "cublas" and cfg.norm_finish_in_dw
    stage = plan_backward_stage(table, *s_in, s_dqkv, s_gcos, s_gsin, s_gqw, s_gkw, s_dx,
                                exact=True, norm_after_rope=True, saved_rotated=True, eps=None,
                                finish_outside=finish_in_dw, cfg=cfg)
    fin = stage.finish if finish_in_dw else None
    launches = [stage.launch]
    if path == "chain":
        launches += chain_launches(s_dqkv, s_w, s_x, s_dx, s_dw, sms, cfg, finish=fin)
    elif path == "hybrid":
        launches.append(hybrid_dw_launch(s_dqkv, s_x, s_dw, sms, cfg, finish=fin))
    table.release()
    in_tensors = list(inputs) + [hs, W]
    aligned = all(t.data_ptr() % 16 == 0 for t in (*in_tensors, *outs, dqkv))
    # the cuBLAS products as cuBLASLt calls where the plan's addresses are 16-byte aligned (the
    # algorithms assume it) and the destinations are plain row-major matrices
    lt_dx = lt_matmul(dqkv, W, dx, cfg) if path != "chain" and aligned and dx.dim() == 2 else None
    lt_dw = lt_matmul(dqkv.t(), x2d, g_weight, cfg) if path == "cublas" and aligned else None
    return Backward091Plan(
        cfg, path, specs, device, backend, stage=stage, table=table, launches=launches,
        mm_dx=path != "chain", mm_dw=path == "cublas",
        finish=None if finish_in_dw or stage.finish is None else stage.finish.launch,
        x_view=(M, hidden) if x2d is not None else None,
        dx_view=(M, hidden) if g_hidden.is_contiguous() else None,
        in_spans=[V.span(t) for t in in_tensors], out_spans=[V.span(t) for t in outs],
        aligned=aligned, dqkv_shape=(M, sz["qkv"]), dtype=sz["dtype"], lt_dx=lt_dx, lt_dw=lt_dw,
    )


PLANS = PlanCache("backward_091", build_backward_091)


def _scalars(eps, out, backend) -> tuple:
    # eps keys the plan by value (the plan was validated with it); a tensor eps is read here
    if type(eps) not in (float, int):
        eps = V.require_number("eps", eps, min_value=0.0)
    return (eps, out is not None, backend)


def _plan_for_alignment(plan: Backward091Plan, args, out) -> Backward091Plan:
    """A plan for a call whose addresses are not all 16-byte aligned (its fingerprint differs by
    alignment): the full key finds or builds it."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + (list(out) if out is not None else [])
    return PLANS.full_lookup(tensors, _scalars(args[13], out, plan.backend), (args, out, plan.backend),
                             remember=False)


def _backward_091(args: tuple, out, backend: Optional[str]):
    tensors = list(args[:13])
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 6):
            build_backward_091(args, out, backend, cfg=_config.current())  # raises, naming out
            raise TypeError(f"out: expected a tuple or list of 6 tensors, got {type(out).__name__}")
        tensors += list(out)
    try:
        plan = PLANS.lookup(tensors, _scalars(args[13], out, backend), (args, out, backend))
    except (TypeError, AttributeError, RuntimeError):
        # not a dense tensor somewhere: validation names it; where it finds nothing, the lookup's own error
        build_backward_091(args, out, backend, cfg=_config.current())
        raise
    try:
        return _run(plan, args, out)
    except RuntimeError:  # a transform's wrapped tensors that the guards took (the GPU's vmap): named, not "storage"
        refuse_functorch_wrapped(tensors)
        raise


def _run(plan: Backward091Plan, args, out):
    """``plan.run``, with autograd off where the call may reach ``torch.mm(out=)``: the inputs may
    carry autograd history (a backward), which it refuses."""
    if torch.is_grad_enabled() and plan.needs_no_grad():
        set_grad_enabled(False)
        try:
            return plan.run(args, out)
        finally:
            set_grad_enabled(True)
    return plan.run(args, out)


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
    input signature.
    """
    args = (grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight, q_norm_weight, k_norm_weight,
            query_pre_norm, key_pre_norm, q_rstd, k_rstd, eps)
    return _backward_091(args, out, backend)
