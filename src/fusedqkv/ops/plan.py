"""Plans: everything a call decides from its inputs' signature, decided once.

A call of a public entry point (1) checks its tensors against the guards of the plans it
used last (shapes, strides, dtypes, devices, in C++: ``TensorGuards``) and its scalars
against theirs; (2) on a miss, takes the full fingerprint (the same, in Python, plus each
tensor's 16-byte alignment, the backend and the config) to the plan cache, and on a miss
there validates the arguments fully -- the clear errors come from here -- and builds the
plan: the path, grids, constexprs and bound launches (:class:`~fusedqkv.ops.launch.BoundLaunch`);
(3) runs the plan: allocations, the addresses of its tensors into the launches' slots, the
launches. A call whose tensors differ from a plan's in anything the plan depends on never
runs on it: guards and fingerprint cover shapes, strides, dtypes and devices, and the run
checks the alignment the plan was built for and, for destinations, that none aliases an input.

``build_backward_091`` is the one place where the 091 backward's decisions are made.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

from . import config as _config
from . import validation as V
from .cublaslt import lt_matmul, plan_matmul
from .gqa_forward import token_major
from .launch import Table, current_stream, device_index, sm_count
from .projection import chain_launches, choose_products, hybrid_dw_launch
from .rope_qk_norm import backward_torch, pick_backend, plan_backward_stage

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch without dynamo's guards: the Python key serves
    TensorGuards = None


def _tensor_key(t) -> tuple:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested:
        return (type(t), id(t))  # not a plannable tensor: the build's validation names it
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.layout, t.data_ptr() % 16 == 0)


def _guards(tensors: Sequence[torch.Tensor]):
    if TensorGuards is None:
        return None
    try:
        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001 - an unsupported tensor kind: the Python key serves
        return None


class PlanCache:
    """Plans by full fingerprint (LRU, ``capacity``), fronted by the guards of the ``recent``
    (plan, guards) pairs that were used last: a repeated call costs one guard check."""

    def __init__(self, build: Callable, capacity: int = 64, recent: int = 4):
        self.build = build
        self.capacity, self.n_recent = capacity, recent
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.recent: list = []  # [(guards, scalars, plan)], most recent first
        self.builds = 0  # plans built (tests read it)
        self.misses = 0  # calls that missed the guards (the full key was taken)

    def clear(self) -> None:
        self.plans.clear()
        self.recent.clear()

    def lookup(self, tensors: Sequence[torch.Tensor], scalars: tuple, build_args: tuple):
        """The plan for these tensors (all ``torch.Tensor``) and scalars (hashable; the config is
        added here); ``build_args`` go to ``build`` on a miss."""
        cfg = _config.current()
        for entry in self.recent:
            g, sc, plan = entry
            if sc == scalars and plan.cfg is cfg and g is not None and g.check(*tensors):
                if entry is not self.recent[0]:
                    self.recent.remove(entry)
                    self.recent.insert(0, entry)
                return plan
        return self._slow(tensors, scalars, build_args)

    def _slow(self, tensors, scalars, build_args, remember: bool = True):
        self.misses += 1
        cfg = _config.current()
        key = (scalars, cfg, tuple(map(_tensor_key, tensors)))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.build(*build_args, cfg=cfg)
            self.builds += 1
            self.plans[key] = plan
            if len(self.plans) > self.capacity:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        # guards are shapes/strides/dtypes/devices: the fast path checks the config by identity,
        # the plan's run the alignment it was built for (plans for unaligned addresses are found
        # by the full key only)
        if remember:
            self.recent.insert(0, (_guards(tensors), scalars, plan))
            del self.recent[self.n_recent:]
        return plan


def overlaps_any(out_ptrs, out_spans, in_ptrs, in_spans) -> bool:
    """Whether any destination's bytes [ptr, ptr + span) overlap another destination's or an
    input's (inputs may overlap each other). One sorted sweep."""
    iv = sorted([(p, p + s, True) for p, s in zip(out_ptrs, out_spans) if s]
                + [(p, p + s, False) for p, s in zip(in_ptrs, in_spans) if s])
    end_all = end_out = -1
    for lo, hi, is_out in iv:
        if lo < end_out or (is_out and lo < end_all):
            return True
        end_all = max(end_all, hi)
        if is_out:
            end_out = max(end_out, hi)
    return False


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last (0: empty)."""
    r = V._byte_range(t)
    return 0 if r is None else r[1] - r[0]


# ------------------------------------------------------------------------------ 091 backward

WORKSPACE_KEPT_BYTES = 32 << 20  # the largest dQKV kept between calls

# the kept dQKV workspaces: one byte buffer per (device index, stream), shared by every plan
# that runs on that stream (calls on one stream never overlap on the GPU), grown to the
# largest dQKV asked for (at most WORKSPACE_KEPT_BYTES)
_KEPT_WORKSPACES: dict = {}


def kept_workspace(index: int, stream: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The shared byte buffer of this device and stream, at least ``nbytes`` long."""
    buf = _KEPT_WORKSPACES.get((index, stream))
    if buf is None or buf.numel() < nbytes:
        buf = _KEPT_WORKSPACES[(index, stream)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


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
        self.mm_dx, self.mm_dw, self.finish = mm_dx, mm_dw, finish
        self.x_view, self.dx_view = x_view, dx_view  # (rows, cols) views, or None
        self.in_spans, self.out_spans = in_spans, out_spans
        self.aligned = aligned
        self.dqkv_shape, self.dtype = dqkv_shape, dtype
        self.is_cuda = device.type == "cuda"
        self.device_index = device_index(device) if self.is_cuda else 0
        # dQKV kept per stream where it is small (the calls whose host time shows)
        self.workspace_kept = (self.is_cuda and dqkv_shape is not None
                               and dqkv_shape[0] * dqkv_shape[1] * dtype.itemsize <= WORKSPACE_KEPT_BYTES)
        self._checked = None  # the addresses of the last call that passed the address checks
        self._ready = False  # every launch bound to its compiled kernel
        self._extra = None  # (stream, the stage's own table entries)
        self._kept = None  # (stream, the shared buffer, dQKV: a view of it)

    def _workspace(self) -> torch.Tensor:
        """dQKV: where it is small, a view of the stream's shared buffer (calls on one stream
        never overlap on the GPU, so the next call's stage writes it only after this call's
        products read it, whichever plan made either call); allocated per call where it is
        large or while a CUDA graph is being captured."""
        if self.workspace_kept and not torch.cuda.is_current_stream_capturing():
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
            kept = self._kept
            if kept is None or kept[0] != stream or kept[1] is not _KEPT_WORKSPACES.get((self.device_index, stream)):
                nbytes = self.dqkv_shape[0] * self.dqkv_shape[1] * self.dtype.itemsize
                buf = kept_workspace(self.device_index, stream, nbytes, self.device)
                kept = self._kept = (stream, buf, buf[:nbytes].view(self.dtype).view(self.dqkv_shape))
            return kept[2]
        return torch.empty(self.dqkv_shape, dtype=self.dtype, device=self.device)

    def _outputs(self, out):
        if out is not None:
            return tuple(out)
        return tuple(torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in self.out_specs)

    def run(self, args, out):
        if self.path == "torch":
            return self._run_torch(args, out)
        (gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, _) = args
        outs = self._outputs(out)
        g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = outs
        dqkv = self._workspace()
        inputs = (gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin)
        in_ptrs = [t.data_ptr() for t in inputs]
        out_ptrs = [t.data_ptr() for t in outs]
        w_ptr, x_ptr = W.data_ptr(), hs.data_ptr()
        seen = in_ptrs + out_ptrs
        seen.append(x_ptr)
        seen.append(w_ptr)
        if seen != self._checked:  # the address checks depend on nothing else (the spans are the plan's)
            if out is not None and overlaps_any(out_ptrs, self.out_spans, in_ptrs + [x_ptr, w_ptr], self.in_spans):
                from .gqa_backward import INPUT_NAMES

                # raises, naming the arguments
                V.require_out(out, self.out_specs, self.device, inputs=list(zip(INPUT_NAMES, args[:13])))
            if self.aligned:
                acc = 0
                for p in seen:
                    acc |= p
                if acc & 15:  # an address the kernels were not specialised for: its own plan
                    return _BACKWARD_091.plan_for_alignment(self, args, out)(args, out)
            self._checked = seen
        stream = torch._C._cuda_getCurrentRawStream(self.device_index) if self.is_cuda else 0
        stage = self.stage
        if stage.part_slot is None:  # the stage's own entries (its ticket buffer) per stream, kept
            cached = self._extra
            if cached is None or cached[0] != stream:
                cached = self._extra = (stream, stage.call_inputs(stream))
            extra = cached[1]
        else:
            extra = stage.call_inputs(stream)
        # table order: inputs, dqkv, grad_cos, grad_sin, gwq, gwk, dX (scratch) [, W, X, dX, dW], stage's own
        launches = self.launches
        if self._ready:
            ptrs = in_ptrs + [dqkv.data_ptr(), out_ptrs[1], out_ptrs[2], out_ptrs[4], out_ptrs[5], out_ptrs[0]]
            if self.path != "cublas":
                ptrs += [w_ptr, x_ptr, out_ptrs[0], out_ptrs[3]]
            ptrs += [t.data_ptr() for t in extra]
            self.table.pointers(ptrs)
            tensors = None
        else:  # the first call of a fresh plan, and every call under the interpreter
            M, hidden = self.x_view if self.x_view else (0, 0)
            supplied = [*inputs, dqkv, g_cos, g_sin, g_qw, g_kw, g_hidden]
            if self.path != "cublas":
                supplied += [W, hs.view(M, hidden), g_hidden.view(self.dx_view) if self.dx_view else g_hidden,
                             g_weight]
            tensors = self.table.tensors(supplied + extra)
            ptrs = None
        if ptrs is not None:
            for launch in launches:  # every descriptor before the first launch
                launch.encode(ptrs)
        for launch in launches:
            launch.launch(tensors, ptrs, stream)
        if self.mm_dx:
            if self.lt_dx is not None and ptrs is not None:
                self.lt_dx(ptrs[11], w_ptr, out_ptrs[0], stream)
            else:
                dx = g_hidden.view(self.dx_view) if self.dx_view else g_hidden
                _mm_into(dqkv, W, dx)
        if self.mm_dw:
            if self.lt_dw is not None and ptrs is not None:
                self.lt_dw(ptrs[11], x_ptr, out_ptrs[3], stream)
            else:
                x = hs.view(self.x_view) if self.x_view else hs.reshape(self.dqkv_shape[0], -1)
                _mm_into(dqkv.t(), x, g_weight)
        if self.finish is not None:
            self.finish.launch(tensors, ptrs, stream)
        if not self._ready:  # every launch compiled and bound: later calls pass addresses only
            self._ready = all(launch._raw is not None for launch in launches + [self.finish] if launch is not None)
        return outs

    def _run_torch(self, args, out):
        (gq, gk, gv, hs, cos, sin, W, wq, wk, xq, xk, rq, rk, eps) = args
        outs = self._outputs(out)
        g_hidden, g_cos, g_sin, g_weight, g_qw, g_kw = outs
        if out is not None:
            from .gqa_backward import INPUT_NAMES

            V.require_out(out, self.out_specs, self.device, inputs=list(zip(INPUT_NAMES, args[:13])))
        M, hidden = gq.shape[0] * gq.shape[2], hs.shape[2]
        dqkv = torch.empty((M, W.shape[0]), dtype=gq.dtype, device=self.device)
        backward_torch(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, g_cos, g_sin, g_qw, g_kw,
                       True, True, True, V.require_number("eps", eps))
        _mm_into(dqkv, W, g_hidden.view(M, hidden) if g_hidden.is_contiguous() else g_hidden)
        _mm_into(dqkv.t(), hs.reshape(M, hidden), g_weight)
        return outs


def _as_matrix(t: torch.Tensor, rows: int, cols: int) -> Optional[torch.Tensor]:
    """``t`` as a [rows, cols] view (no copy), or None when its strides do not allow one."""
    try:
        return t.view(rows, cols)
    except RuntimeError:
        return None


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if out.is_contiguous():
        torch.mm(a, b, out=out.view(a.shape[0], b.shape[1]))
    else:  # a strided destination: cuBLAS writes contiguous memory
        out.copy_(torch.mm(a, b).view(out.shape))


def build_backward_091(args, out, backend, *, cfg) -> Backward091Plan:
    """Validate the 14 arguments (and ``out``) fully, choose the path and plan its launches."""
    from .gqa_backward import output_specs, validate_backward_inputs

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
    x2d = _as_matrix(hs, M, hidden)  # None: no view; cuBLAS then reads a copy
    dx = g_hidden.view(M, hidden) if g_hidden.is_contiguous() else g_hidden
    sms = sm_count(device)
    path = choose_products(M, sz["dtype"], device, sms, dqkv, W, x2d, dx, g_weight, cfg)
    table = Table()
    inputs = (gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin)
    s_in = [table.add(t) for t in inputs]
    s_dqkv, s_gcos, s_gsin, s_gqw, s_gkw, s_scratch = (table.add(t) for t in (dqkv, g_cos, g_sin, g_qw, g_kw, g_hidden))
    if path != "cublas":
        s_w, s_x, s_dx, s_dw = (table.add(t) for t in (W, x2d, dx, g_weight))
    # with a Triton dW the stage leaves its norm-weight finish (a chain of L2 round trips at its
    # end) to dW, which runs it on a program with a tile less
    finish_in_dw = path != "cublas" and cfg.norm_finish_in_dw
    stage = plan_backward_stage(table, *s_in, s_dqkv, s_gcos, s_gsin, s_gqw, s_gkw, s_scratch,
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
        in_spans=[_span(t) for t in in_tensors], out_spans=[_span(t) for t in outs],
        aligned=aligned, dqkv_shape=(M, sz["qkv"]), dtype=sz["dtype"], lt_dx=lt_dx, lt_dw=lt_dw,
    )


class _Backward091Plans(PlanCache):
    def __init__(self):
        super().__init__(build_backward_091)

    def plan_for_alignment(self, plan, args, out):
        """A plan for a call whose addresses are not all 16-byte aligned (its fingerprint
        differs by alignment): the Python key finds or builds it."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + (list(out) if out is not None else [])
        built = self._slow(tensors, _scalars_091(args[13], out, plan.backend), (args, out, plan.backend),
                           remember=False)
        return built.run


def _scalars_091(eps, out, backend) -> tuple:
    # eps keys the plan by value (the plan was validated with it); a tensor eps is read here
    if type(eps) not in (float, int):
        eps = V.require_number("eps", eps, min_value=0.0)
    return (eps, out is not None, backend)


_BACKWARD_091 = _Backward091Plans()


def backward_091(args: tuple, out, backend: Optional[str]):
    """The 091 backward's result for 14 arguments: the plan's run."""
    tensors = list(args[:13])
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 6):
            return build_backward_091(args, out, backend, cfg=_config.current())  # raises, naming out
        tensors += list(out)
    try:
        plan = _BACKWARD_091.lookup(tensors, _scalars_091(args[13], out, backend), (args, out, backend))
    except (TypeError, AttributeError, RuntimeError):  # not a dense tensor somewhere: validation names it
        return build_backward_091(args, out, backend, cfg=_config.current())
    return plan.run(args, out)


# ------------------------------------------------------------------------------ training block


class ForwardPlan:
    """The training block's forward of one input signature: one GEMM (``qkv = x W^T``, cuBLAS)
    and the forward stage (Triton, or the torch backend)."""

    def __init__(self, cfg, sz, backend, launch=None, aligned=True, lt_qkv=None):
        self.cfg, self.sz, self.backend, self.launch, self.aligned = cfg, sz, backend, launch, aligned
        self.lt_qkv = lt_qkv  # qkv = x W^T as a planned cuBLASLt call (no bias, aligned plans), or None
        b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
        self.M, self.hidden, self.n_tot = b * s, sz["hidden"], sz["qkv"]
        self.qkv_shape = (b, s, self.n_tot)
        self.q_shape, self.k_shape = (b, sz["num_heads"], s, d), (b, sz["num_kv_heads"], s, d)
        self.rq_shape, self.rk_shape = self.q_shape[:3], self.k_shape[:3]
        self.cs_shape = (b, s, d)
        self.device, self.dtype = sz["device"], sz["dtype"]

    def run(self, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias=None):
        """(q, k, qkv, rstd_q, rstd_k); cos/sin ``[batch, seq, head_dim]`` (expanded)."""
        sz = self.sz
        lt = self.lt_qkv
        if lt is not None and self.launch._raw is not None:
            x_ptr, w_ptr = hidden_states.data_ptr(), qkv_weight.data_ptr()
            if (x_ptr | w_ptr) & 15:
                raise _Misaligned
            qkv = torch.empty(self.qkv_shape, dtype=self.dtype, device=self.device)
            lt(x_ptr, w_ptr, qkv.data_ptr(), current_stream(self.device))
        elif qkv_bias is None:
            qkv = torch.mm(hidden_states.reshape(self.M, self.hidden), qkv_weight.t()).view(self.qkv_shape)
        else:  # the bias rides in the GEMM: RoPE/norm see x W^T + b, as HF's Linear gives it
            qkv = torch.addmm(qkv_bias, hidden_states.reshape(self.M, self.hidden), qkv_weight.t()).view(self.qkv_shape)
        if self.launch is None:
            from .gqa_forward import forward_torch

            q, k, rq, rk = forward_torch(qkv, q_norm_weight, k_norm_weight, cos, sin, sz["num_heads"],
                                         sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"])
            return q, k, qkv, rq, rk
        dev, dt = self.device, self.dtype
        q = token_major(*self.q_shape, dt, dev)
        k = token_major(*self.k_shape, dt, dev)
        rq = torch.empty(self.rq_shape, dtype=torch.float32, device=dev)
        rk = torch.empty(self.rk_shape, dtype=torch.float32, device=dev)
        tensors = (qkv, q_norm_weight, k_norm_weight, cos, sin, q, k, rq, rk)
        launch = self.launch
        if launch._raw is not None:
            ptrs = [t.data_ptr() for t in tensors]
            if self.aligned and (ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
                raise _Misaligned
            launch.launch(None, ptrs, current_stream(dev))
        else:
            launch.launch(tensors, None, current_stream(dev))
        return q, k, qkv, rq, rk


class _Misaligned(Exception):
    """A call whose addresses are not aligned as its plan's were (the caller re-plans)."""


def build_forward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads,
                  eps, qk_norm_position, backend, qkv_bias=None, *, cfg) -> ForwardPlan:
    """Validate the forward's arguments fully (clear errors) and plan it."""
    from .gqa_forward import plan_forward_stage, validate_forward_inputs

    sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                                 num_kv_heads, eps, qk_norm_position)
    if qkv_bias is not None:
        V.require_tensor("qkv_bias", qkv_bias)
        V.require_shape("qkv_bias", qkv_bias, (sz["qkv"],), "[(num_heads + 2*num_kv_heads)*head_dim]")
        V.require_float_dtype("qkv_bias", qkv_bias)
        V.require_same_dtype([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
        V.require_same_device([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
    device = sz["device"]
    backend = pick_backend(device, None if backend in (None, "auto") else backend)
    M = sz["batch"] * sz["seq"]
    if backend == "torch" or M == 0:
        return ForwardPlan(cfg, sz, backend)
    b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
    qkv = torch.empty((b, s, sz["qkv"]), dtype=sz["dtype"], device=device)
    cos_e, sin_e = cos.expand(b, s, d), sin.expand(b, s, d)
    q = token_major(b, num_heads, s, d, sz["dtype"], device)
    k = token_major(b, num_kv_heads, s, d, sz["dtype"], device)
    rq = torch.empty((b, num_heads, s), dtype=torch.float32, device=device)
    rk = torch.empty((b, num_kv_heads, s), dtype=torch.float32, device=device)
    table = Table()
    slots = [table.add(t) for t in (qkv, q_norm_weight, k_norm_weight, cos_e, sin_e, q, k, rq, rk)]
    launch = plan_forward_stage(*slots, num_heads, num_kv_heads, sz["eps"], sz["norm_after_rope"], cfg)
    table.release()
    aligned = all(t.data_ptr() % 16 == 0 for t in (q_norm_weight, k_norm_weight, cos, sin))
    lt_qkv = None
    if qkv_bias is None and aligned and hidden_states.data_ptr() % 16 == 0 and qkv_weight.data_ptr() % 16 == 0:
        lt_qkv = lt_matmul(_as_matrix(hidden_states, M, sz["hidden"]), qkv_weight.t(), qkv.view(M, sz["qkv"]), cfg)
    return ForwardPlan(cfg, sz, backend, launch, aligned, lt_qkv)


_FORWARD = PlanCache(build_forward)


def forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
                 qk_norm_position, backend, qkv_bias=None) -> ForwardPlan:
    """The forward's plan (validating the arguments on a miss)."""
    tensors = (hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin)
    if qkv_bias is not None:
        tensors += (qkv_bias,)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or type(eps) not in (float, int):
        return build_forward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                             num_kv_heads, eps, qk_norm_position, backend, qkv_bias, cfg=_config.current())
    scalars = (num_heads, num_kv_heads, eps, qk_norm_position, backend)
    return _FORWARD.lookup(tensors, scalars + (qkv_bias is not None,),
                           (*tensors[:6], *scalars, qkv_bias))


def run_forward(plan: ForwardPlan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                qkv_bias=None):
    """``plan.run``; a call whose addresses the plan was not specialised for gets its own plan."""
    tensors = (hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin)
    try:
        return plan.run(*tensors, qkv_bias)
    except _Misaligned:
        sz = plan.sz
        scalars = (sz["num_heads"], sz["num_kv_heads"], sz["eps"],
                   "after_rope" if sz["norm_after_rope"] else "before_rope", plan.backend)
        own = _FORWARD._slow(list(tensors), scalars + (qkv_bias is not None,), (*tensors, *scalars, qkv_bias),
                             remember=False)
        return own.run(*tensors, qkv_bias)


class TrainingBackwardPlan:
    """The training block's backward of one signature: the stage in its accurate mode (fp32
    math, one rounding; rstd recomputed from the saved projection output), then dX and dW on
    cuBLAS and, where the stage does not fuse it, the norm-weight finish."""

    def __init__(self, cfg, sizes, need, stage=None, table=None, aligned=True, lt_dx=None, lt_dw=None):
        self.cfg, self.stage, self.table, self.aligned = cfg, stage, table, aligned
        self.lt_dx, self.lt_dw = lt_dx, lt_dw  # dX and dW as planned cuBLASLt calls, or None
        (self.B, self.S, self.hq, self.hkv, self.D, self.hidden, self.dtype, self.device, self.eps,
         self.norm_after_rope) = sizes
        self.need_x, self.need_w, self.need_cs, self.need_b = need
        self.M, self.n_tot = self.B * self.S, (self.hq + 2 * self.hkv) * self.D

    def run(self, grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin):
        """(g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_bias); the gradients not needed are None."""
        dt, dev, M = self.dtype, self.device, self.M
        if grad_q.dtype != dt or grad_k.dtype != dt or grad_v.dtype != dt:
            grad_q, grad_k, grad_v = grad_q.to(dt), grad_k.to(dt), grad_v.to(dt)
        B, S, hq, hkv, D = self.B, self.S, self.hq, self.hkv, self.D
        dqkv = torch.empty((M, self.n_tot), dtype=dt, device=dev)
        g_qw = torch.empty(q_norm_weight.shape, dtype=q_norm_weight.dtype, device=dev)
        g_kw = torch.empty(k_norm_weight.shape, dtype=k_norm_weight.dtype, device=dev)
        g_cos = torch.empty((B, S, D), dtype=cos.dtype, device=dev) if self.need_cs else None
        g_sin = torch.empty((B, S, D), dtype=sin.dtype, device=dev) if self.need_cs else None
        g_x = torch.empty((B, S, self.hidden), dtype=hidden_states.dtype, device=dev) if self.need_x else None
        if self.stage is None:  # the torch backend
            heads = qkv.view(B, S, hq + 2 * hkv, D)
            backward_torch(grad_q, grad_k, grad_v, heads[:, :, :hq].transpose(1, 2),
                           heads[:, :, hq: hq + hkv].transpose(1, 2), None, None, q_norm_weight, k_norm_weight,
                           cos, sin, dqkv, g_cos, g_sin, g_qw, g_kw, False, self.norm_after_rope, False, self.eps)
        else:
            stream = current_stream(dev)
            stage = self.stage
            extra = stage.call_inputs(stream)
            supplied = [grad_q, grad_k, grad_v, qkv, q_norm_weight, k_norm_weight, cos, sin, dqkv, g_qw, g_kw]
            if self.need_cs:
                supplied += [g_cos, g_sin]
            if self.need_x:
                supplied.append(g_x)
            launches = stage.launches(with_finish=False)
            if stage.launch._raw is not None and (stage.finish is None or stage.finish.launch._raw is not None):
                ptrs = [t.data_ptr() for t in supplied]
                if self.aligned:
                    acc = 0
                    for p in ptrs:
                        acc |= p
                    if acc & 15:
                        raise _Misaligned
                ptrs.insert(4, ptrs[3] + hq * D * qkv.element_size())  # saved k: a column offset into qkv
                ptrs += [t.data_ptr() for t in extra]
                self.table.pointers(ptrs)
                tensors = None
            else:
                heads = qkv.view(B, S, hq + 2 * hkv, D)
                supplied[3:4] = [heads[:, :, :hq].transpose(1, 2), heads[:, :, hq: hq + hkv].transpose(1, 2)]
                tensors = self.table.tensors(supplied + extra)
                ptrs = None
            for launch in launches:
                launch.launch(tensors, ptrs, stream)
        g_w = None
        lt_ok = self.stage is not None and ptrs is not None and not (hidden_states.data_ptr() | qkv_weight.data_ptr()) & 15
        if self.need_x:
            if self.lt_dx is not None and lt_ok:
                self.lt_dx(dqkv.data_ptr(), qkv_weight.data_ptr(), g_x.data_ptr(), stream)
            else:
                torch.mm(dqkv, qkv_weight, out=g_x.view(M, self.hidden))
        if self.need_w:
            if self.lt_dw is not None and lt_ok:
                g_w = torch.empty((self.n_tot, self.hidden), dtype=dt, device=dev)
                self.lt_dw(dqkv.data_ptr(), hidden_states.data_ptr(), g_w.data_ptr(), stream)
            else:
                g_w = torch.mm(dqkv.t(), hidden_states.reshape(M, self.hidden))
        # the bias gradient: dQKV summed over tokens, in fp32 (torch's reduction: a fixed order)
        g_b = dqkv.sum(0, dtype=torch.float32).to(qkv_weight.dtype) if self.need_b else None
        if self.stage is not None and self.stage.finish is not None:
            self.stage.finish.launch.launch(tensors, ptrs, current_stream(dev))
        return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b


def build_training_backward(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight,
                            cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend,
                            need_b=False, *, cfg) -> TrainingBackwardPlan:
    B, S, n_tot = qkv.shape
    hq, hkv = num_heads, num_kv_heads
    D = n_tot // (hq + 2 * hkv)
    dt, dev = qkv.dtype, qkv.device
    sizes = (B, S, hq, hkv, D, hidden_states.shape[-1], dt, dev, eps, norm_after_rope)
    need = (need_x, need_w, need_cs, need_b)
    backend = pick_backend(dev, None if backend in (None, "auto") else backend)
    if backend == "torch" or B * S == 0:
        return TrainingBackwardPlan(cfg, sizes, need)
    gq, gk, gv = (g if g.dtype == dt else g.to(dt) for g in (grad_q, grad_k, grad_v))
    heads = qkv.view(B, S, hq + 2 * hkv, D)
    saved_q, saved_k = heads[:, :, :hq].transpose(1, 2), heads[:, :, hq: hq + hkv].transpose(1, 2)
    M = B * S
    dqkv = torch.empty((M, n_tot), dtype=dt, device=dev)
    g_qw, g_kw = torch.empty_like(q_norm_weight), torch.empty_like(k_norm_weight)
    table = Table()
    s = [table.add(t) for t in (gq, gk, gv, saved_q, saved_k, q_norm_weight, k_norm_weight, cos, sin, dqkv, g_qw,
                                g_kw)]
    s_gcos = s_gsin = s_gx = None
    if need_cs:
        s_gcos, s_gsin = table.add(torch.empty((B, S, D), dtype=cos.dtype, device=dev)), \
            table.add(torch.empty((B, S, D), dtype=sin.dtype, device=dev))
    if need_x:
        s_gx = table.add(torch.empty((B, S, hidden_states.shape[-1]), dtype=hidden_states.dtype, device=dev))
    gq_, gk_, gv_, sq, sk, swq, swk, scos, ssin, sdqkv, sgqw, sgkw = s
    stage = plan_backward_stage(table, gq_, gk_, gv_, sq, sk, None, None, swq, swk, scos, ssin, sdqkv, s_gcos, s_gsin,
                                sgqw, sgkw, s_gx, exact=False, norm_after_rope=norm_after_rope, saved_rotated=False,
                                eps=eps, finish_outside=False, cfg=cfg)
    table.release()
    aligned = all(t.data_ptr() % 16 == 0 for t in (gq, gk, gv, qkv, q_norm_weight, k_norm_weight, cos, sin))
    lt_dx = lt_dw = None
    if aligned and qkv_weight.dtype == dt and hidden_states.dtype == dt:
        hidden = hidden_states.shape[-1]
        x2d = _as_matrix(hidden_states, M, hidden)
        if need_x:  # g_x [M, hidden] and g_w [n_tot, hidden]: allocated contiguous by the run
            lt_dx = plan_matmul(dt, dev, M, hidden, n_tot, dqkv.stride(), qkv_weight.stride(), (hidden, 1), cfg)
        if need_w and x2d is not None:
            lt_dw = plan_matmul(dt, dev, n_tot, hidden, M, dqkv.t().stride(), x2d.stride(), (hidden, 1), cfg)
    return TrainingBackwardPlan(cfg, sizes, need, stage, table, aligned, lt_dx, lt_dw)


_TRAINING_BACKWARD = PlanCache(build_training_backward)


def training_backward(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
                      num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend, need_b=False):
    """The training block's gradients (see :class:`TrainingBackwardPlan`)."""
    tensors = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin)
    scalars = (num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend, need_b)
    plan = _TRAINING_BACKWARD.lookup(tensors, scalars, (*tensors, *scalars))
    try:
        return plan.run(*tensors)
    except _Misaligned:
        plan = _TRAINING_BACKWARD._slow(list(tensors), ("unaligned",) + scalars, (*tensors, *scalars),
                                        remember=False)
        return plan.run(*tensors)
