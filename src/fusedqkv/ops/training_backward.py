"""The training block's backward, planned: the backward stage in its accurate mode (fp32 math,
one rounding; rstd recomputed from the saved projection output; true grad_cos/grad_sin), then
dX = dQKV W and dW = dQKV^T X, the bias gradient, and where the stage does not fuse it, the
norm-weight finish. The products: where the call needs both in 16 bits, the 091 backward's (the
chain, or the hybrid: :func:`~fusedqkv.ops.projection.choose_products`, ``cfg.training_triton_products``),
queued behind the stage as programmatic dependents; else planned cuBLASLt calls or ``torch.mm``.

``training_backward`` finds or builds the plan of a call's signature and runs it. The block's
variants (:class:`~fusedqkv.ops.gqa_forward.Variant`) are part of the key: the stage runs them
in the training mode (unweighted norms: no norm-weight gradients; a gate: its gradient into
dQKV's gate columns; v normed: its backward from the saved raw v; v the raw k, ``k_eq_v``: the
stage writes v's gradient into dQKV's value columns as usual, one add folds them into k's, and
the GEMMs read the ``[Q | K]`` columns).
"""

from __future__ import annotations

from functools import reduce
from operator import or_

import torch

from . import device as _device
from . import fp8, host_gemm
from .cublaslt import plan_matmul
from .device import sm_count
from .variant import PLAIN, heads_of
from .launch import Table
from .plan_cache import Misaligned, PlanCache, as_matrix
from .projection import chain_launches, choose_products, hybrid_dw_launch, hybrid_dx_first
from .rope_qk_norm import backward_torch, pick_backend, plan_backward_stage, stage_amax_supported

# the call's table entries, by name (``saved_q``/``saved_k``/``saved_v``: the q, k and v column blocks of
# the saved qkv); the norm weights and their gradients only with weighted norms, the gate's gradient
# only with a gate, saved_v only when v is normed
CALL_ENTRIES = ("grad_q", "grad_k", "grad_v", "saved_q", "saved_k", "q_norm_weight", "k_norm_weight", "cos", "sin",
                "dqkv", "grad_q_norm_weight", "grad_k_norm_weight", "grad_gate", "saved_v")
# a bound call's addresses, in this order (then the stage's own entries, ``StagePlan.call_inputs``' order);
# the last three only where the products are Triton launches (``TrainingBackwardPlan.path``)
RUN_ORDER = CALL_ENTRIES + ("grad_cos", "grad_sin", "grad_hidden_states")
PRODUCT_ENTRIES = ("qkv_weight", "hidden_states", "grad_qkv_weight")
UNCHECKED = (4, 13)  # saved_k and saved_v: offsets into qkv whose alignment the plan's shapes fix


class TrainingBackwardPlan:
    """The training block's backward of one signature."""

    def __init__(self, cfg, sizes, need, stage=None, table=None, aligned=True, lt_dx=None, lt_dw=None, fp8=None,
                 path="cublas", products=()):
        self.cfg, self.stage, self.table, self.aligned = cfg, stage, table, aligned
        # where dX and dW run: "chain" (both Triton launches), "hybrid" (dW one, dX cuBLAS) -- ``products``,
        # queued right behind the stage, or the hybrid's dW behind its dX (projection.hybrid_dx_first) -- or "cublas"
        self.path, self.products = path, tuple(products)
        self.dw_after_dx = path == "hybrid" and hybrid_dx_first(sizes[0] * sizes[1], cfg)
        # the product launches queued right behind the stage, and those behind the cuBLAS dX
        self._before_dx, self._after_dx = ((), self.products) if self.dw_after_dx else (self.products, ())
        self._order = RUN_ORDER + (PRODUCT_ENTRIES if products else ())
        self.fp8 = fp8  # an ops.fp8.Fp8Recipe: dX and dW in FP8 (or dW in bf16, as the recipe says)
        self.lt_dx, self.lt_dw = lt_dx, lt_dw  # dX and dW as planned cuBLASLt calls, or None
        (self.B, self.S, self.hq, self.hkv, self.D, self.hidden, self.dtype, self.device, self.eps,
         self.norm_after_rope, self.variant) = sizes
        self.need_x, self.need_w, self.need_cs, self.need_b = need
        self.nq = 2 * self.hq if self.variant.q_gate else self.hq  # query column blocks (with the gate's)
        # qkv's (and the weight's) columns; dQKV's: the stage writes v's gradient in columns of its own,
        # which k_eq_v adds to k's before the GEMMs read the first n_tot
        self.M, self.n_tot = self.B * self.S, self.variant.qkv_heads(self.hq, self.hkv) * self.D
        self.n_dqkv = (self.nq + 2 * self.hkv) * self.D
        self.rot = self.variant.rotary(self.D)
        # bytes from qkv's start to its k and v columns
        self.k_offset = self.nq * self.D * self.dtype.itemsize
        self.v_offset = self.k_offset if self.variant.k_eq_v else (self.nq + self.hkv) * self.D * self.dtype.itemsize
        self.dqkv_bytes = self.M * self.n_dqkv * self.dtype.itemsize
        self._gather = None  # RUN_ORDER's addresses -> the table's, once every stage launch is bound
        self._kept = None  # (the stream's dQKV buffer, dQKV: a view of it)
        # the address check (aligned plans): every address but saved_k's and saved_v's, offsets into qkv whose
        # alignment the plan's shapes fix -- the same as all of them where both offsets are 16-byte multiples
        self._check_all = not (self.k_offset | self.v_offset) & 15

    def _dqkv(self, stream: int, keep: bool, capture: bool) -> torch.Tensor:
        """dQKV ``[M, n_dqkv]``: a view of the stream's kept buffer where it is small, not returned
        (``keep``) and no graph is being captured (``capture``; calls on one stream never overlap on
        the GPU: the next call's stage writes it only after this call's products read it); else per
        call."""
        if keep or capture or self.stage is None or self.dqkv_bytes > _device.DQKV_KEPT_BYTES:
            return torch.empty((self.M, self.n_dqkv), dtype=self.dtype, device=self.device)
        buf = _device.workspace("dqkv", self.device, stream, self.dqkv_bytes, False)
        kept = self._kept
        if kept is None or kept[0] is not buf:
            kept = self._kept = (buf, buf[:self.dqkv_bytes].view(self.dtype).view(self.M, self.n_dqkv))
        return kept[1]

    def _saved_heads(self, qkv):
        return heads_of(qkv, self.hq, self.hkv, self.D, self.variant.q_gate, self.variant.k_eq_v)[:3]

    def run(self, grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
            grad_gate=None, keep_dqkv=False, fp8_weight=None, fp8_x_amax=None):
        """(g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_bias); the gradients not needed (or absent: no norm
        weights) are None. ``grad_gate`` ``[B, S, Hq, D]`` with a gate. ``keep_dqkv``: dQKV too, as
        ``[B, S, qkv]`` (the gradient of a residual added to the projection output). ``fp8_weight``
        (FP8 plans): qkv_weight's cast for dX kept from the forward (``fp8.weight_casts``), or None;
        ``fp8_x_amax``: hidden_states' amaxes for dW's cast of it, kept from the forward
        (``fp8.input_cast_keeping_amax``), or None."""
        dt, dev, M = self.dtype, self.device, self.M
        if grad_q.dtype != dt or grad_k.dtype != dt or grad_v.dtype != dt:
            grad_q, grad_k, grad_v = grad_q.to(dt), grad_k.to(dt), grad_v.to(dt)
        gg = None
        if grad_gate is not None:
            gg = (grad_gate if grad_gate.dtype == dt else grad_gate.to(dt)).transpose(1, 2)  # [B, Hq, S, D]
        B, S = self.B, self.S
        stream, capture = _device.call_state(dev)
        dqkv = self._dqkv(stream, keep_dqkv, capture)
        g_qw = g_kw = None  # (each like the tensor of its dtype: new_empty skips dtype and device arguments)
        if q_norm_weight is not None:
            g_qw = q_norm_weight.new_empty(q_norm_weight.shape)
            g_kw = k_norm_weight.new_empty(k_norm_weight.shape)
        g_cos = cos.new_empty((B, S, self.rot)) if self.need_cs else None
        g_sin = sin.new_empty((B, S, self.rot)) if self.need_cs else None
        g_x = hidden_states.new_empty((B, S, self.hidden)) if self.need_x else None
        products = self.products
        g_w = qkv.new_empty((self.n_tot, self.hidden)) if products else None  # (qkv's dtype is the plan's)
        a = None  # the bound call's addresses in the plan's order (then the stage's own entries)
        ptrs = tensors = None
        g_amax = None  # dQKV's amax partials from the stage (FP8: fp8.stage_amax)
        if self.stage is None:  # the torch backend
            saved_q, saved_k, saved_v = self._saved_heads(qkv)
            backward_torch(grad_q, grad_k, grad_v, saved_q, saved_k, None, None, q_norm_weight, k_norm_weight,
                           cos, sin, dqkv, g_cos, g_sin, g_qw, g_kw, False, self.norm_after_rope, False, self.eps,
                           self.variant, gg, saved_v)
        else:
            stage = self.stage
            extra = stage.kept_inputs(stream, capture)
            if self._gather is not None:
                q_ptr = qkv.data_ptr()
                a = [grad_q.data_ptr(), grad_k.data_ptr(), grad_v.data_ptr(), q_ptr, q_ptr + self.k_offset,
                     0 if q_norm_weight is None else q_norm_weight.data_ptr(),
                     0 if k_norm_weight is None else k_norm_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     dqkv.data_ptr(), 0 if g_qw is None else g_qw.data_ptr(), 0 if g_kw is None else g_kw.data_ptr(),
                     0 if gg is None else gg.data_ptr(), q_ptr + self.v_offset,
                     0 if g_cos is None else g_cos.data_ptr(), 0 if g_sin is None else g_sin.data_ptr(),
                     0 if g_x is None else g_x.data_ptr()]
                if products:
                    a += [qkv_weight.data_ptr(), hidden_states.data_ptr(), g_w.data_ptr()]
                for t in extra.values():
                    a.append(t.data_ptr())
                if self.aligned:
                    if self._check_all:
                        acc = reduce(or_, a)
                    else:
                        acc = 0
                        for i, p in enumerate(a):
                            if i not in UNCHECKED:
                                acc |= p
                    if acc & 15:
                        raise Misaligned
                ptrs = self._gather(a)
            else:  # the first call of a fresh plan, and every call under the interpreter
                named = dict(grad_q=grad_q, grad_k=grad_k, grad_v=grad_v, q_norm_weight=q_norm_weight,
                             k_norm_weight=k_norm_weight, cos=cos, sin=sin, dqkv=dqkv, grad_q_norm_weight=g_qw,
                             grad_k_norm_weight=g_kw, grad_cos=g_cos, grad_sin=g_sin, grad_hidden_states=g_x,
                             grad_gate=gg, **extra)
                named["saved_q"], named["saved_k"], named["saved_v"] = self._saved_heads(qkv)
                if products:
                    named.update(qkv_weight=qkv_weight, hidden_states=hidden_states.view(M, self.hidden),
                                 grad_qkv_weight=g_w, grad_hidden_states=g_x.view(M, self.hidden))
                tensors = self.table.tensors(named)
            stage.launch.launch(tensors, ptrs, stream)
            for launch in self._before_dx:  # programmatic dependents of the stage: queued right behind it
                launch.launch(tensors, ptrs, stream)
            if "amax_rows" in extra:
                g_amax = (extra["amax_rows"], extra.get("amax_cols"))
            if self._gather is None and all(launch.bound for launch in stage.launches() + list(products)):
                self._gather = self.table.gather(self._order + tuple(extra))
        if self.variant.k_eq_v:  # v is k: its gradient joins k's (the GEMMs read the [Q | K] columns)
            k0 = self.nq * self.D
            dqkv[:, k0:k0 + self.hkv * self.D].add_(dqkv[:, k0 + self.hkv * self.D:])
            dqkv = dqkv[:, :self.n_tot]
        lt_ok = a is not None and not (hidden_states.data_ptr() | qkv_weight.data_ptr()) & 15
        if self.fp8 is not None:  # dQKV's two casts in two passes where both GEMMs run (fp8.backward)
            g_w = fp8.backward(dqkv, hidden_states.reshape(M, self.hidden), qkv_weight, self.fp8, self.need_x,
                               self.need_w, out=g_x.view(M, self.hidden) if self.need_x else None,
                               w_cast=fp8_weight, g_amax=g_amax, x_amax=fp8_x_amax)[1]
        elif self.need_x and self.path != "chain":
            if self.lt_dx is not None and lt_ok:
                self.lt_dx(a[9], qkv_weight.data_ptr(), a[16], stream, capture)  # dqkv, W, grad_hidden_states
            else:
                host_gemm.mm(dqkv, qkv_weight, out=g_x.view(M, self.hidden))
            for launch in self._after_dx:  # the hybrid's dW, a programmatic dependent of dX
                launch.launch(tensors, ptrs, stream)
        if self.need_w and self.fp8 is None and not products:
            if self.lt_dw is not None and lt_ok:
                g_w = qkv.new_empty((self.n_tot, self.hidden))  # (qkv's dtype is the plan's)
                self.lt_dw(a[9], hidden_states.data_ptr(), g_w.data_ptr(), stream, capture)
            else:
                g_w = host_gemm.mm(dqkv.t(), hidden_states.reshape(M, self.hidden))
        # the bias gradient: dQKV summed over tokens, in fp32 (torch's reduction: a fixed order)
        g_b = dqkv.sum(0, dtype=torch.float32).to(qkv_weight.dtype) if self.need_b else None
        if self.stage is not None and self.stage.finish is not None:
            self.stage.finish.launch.launch(tensors, ptrs, stream)
        if keep_dqkv:
            # (k_eq_v: the [Q | K] columns copied out of dQKV's rows, a tensor of its own as the custom op's)
            return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b, dqkv.contiguous().view(B, S, self.n_tot)
        return g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b


def build_training_backward(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight,
                            cos, sin, num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend,
                            need_b=False, grad_gate=None, variant=PLAIN, fp8_key="", stage_amax=False, *,
                            cfg) -> TrainingBackwardPlan:
    B, S, n_tot = qkv.shape
    hq, hkv = num_heads, num_kv_heads
    nq = 2 * hq if variant.q_gate else hq
    D = n_tot // variant.qkv_heads(hq, hkv)
    rot = variant.rotary(D)
    dt, dev = qkv.dtype, qkv.device
    sizes = (B, S, hq, hkv, D, hidden_states.shape[-1], dt, dev, eps, norm_after_rope, variant)
    need = (need_x, need_w, need_cs, need_b)
    recipe = fp8.recipe(fp8_key)
    backend = pick_backend(dev, None if backend in (None, "auto") else backend)
    if backend == "torch" or B * S == 0:
        return TrainingBackwardPlan(cfg, sizes, need, fp8=recipe)
    gq, gk, gv = (g if g.dtype == dt else g.to(dt) for g in (grad_q, grad_k, grad_v))
    saved_q, saved_k, saved_v = heads_of(qkv, hq, hkv, D, variant.q_gate, variant.k_eq_v)[:3]
    M = B * S
    dqkv = torch.empty((M, (nq + 2 * hkv) * D), dtype=dt, device=dev)  # v's gradient in columns of its own
    dqk = dqkv[:, :n_tot]  # what the GEMMs read (k_eq_v: without those columns)
    weighted = q_norm_weight is not None
    like = dict(grad_q=gq, grad_k=gk, grad_v=gv, saved_q=saved_q, saved_k=saved_k, q_norm_weight=q_norm_weight,
                k_norm_weight=k_norm_weight, cos=cos, sin=sin, dqkv=dqkv,
                grad_q_norm_weight=torch.empty_like(q_norm_weight) if weighted else None,
                grad_k_norm_weight=torch.empty_like(k_norm_weight) if weighted else None,
                grad_gate=None if grad_gate is None else (grad_gate if grad_gate.dtype == dt
                                                          else grad_gate.to(dt)).transpose(1, 2),
                saved_v=saved_v if variant.v_norm else None)
    # FP8: the stage writes dQKV's amax partials for its casts (the dual cast's, or dX's row cast alone:
    # fp8.stage_amax; ``stage_amax``: the module flags at the lookup, part of the plan's key); the GEMMs
    # read what the stage stored (not with k_eq_v)
    row_amax, col_amax = fp8.stage_amax(recipe, need_x, need_w, n_tot) if stage_amax else (False, False)
    if not (fp8._triton(dqkv) and stage_amax_supported(variant)):
        row_amax = col_amax = False
    hidden = hidden_states.shape[-1]
    aligned = all(t.data_ptr() % 16 == 0 for t in (gq, gk, gv, qkv, q_norm_weight, k_norm_weight, cos, sin,
                                                    like["grad_gate"]) if t is not None)
    x2d = as_matrix(hidden_states, M, hidden) if hidden_states.dtype == dt else None
    g_x2d = torch.empty((M, hidden), dtype=hidden_states.dtype, device=dev) if need_x else None
    # the products: the 091 backward's rules where both are needed in 16 bits from dQKV as the stage stores it
    path = "cublas"
    if (cfg.training_triton_products and recipe is None and need_x and need_w and aligned and x2d is not None
            and not variant.k_eq_v and qkv_weight.dtype == dt):
        g_w_like = torch.empty((n_tot, hidden), dtype=dt, device=dev)
        path = choose_products(M, dt, dev, sm_count(dev), dqkv, qkv_weight, x2d, g_x2d, g_w_like, cfg)
    table = Table()
    slot = {name: None if like[name] is None else table.add(name, like[name]) for name in CALL_ENTRIES}
    s_gcos = s_gsin = s_gx = None
    if need_cs:
        s_gcos = table.add("grad_cos", torch.empty((B, S, rot), dtype=cos.dtype, device=dev))
        s_gsin = table.add("grad_sin", torch.empty((B, S, rot), dtype=sin.dtype, device=dev))
    if need_x:  # dX's memory holds the stage's partials before dX overwrites it
        s_gx = table.add("grad_hidden_states", g_x2d if path != "cublas" else g_x2d.view(B, S, hidden))
    if path != "cublas":  # (supplied entries before the stage's derived ones)
        s_w, s_x = table.add("qkv_weight", qkv_weight), table.add("hidden_states", x2d)
        s_dw = table.add("grad_qkv_weight", g_w_like)
    stage = plan_backward_stage(table, slot["grad_q"], slot["grad_k"], slot["grad_v"], slot["saved_q"],
                                slot["saved_k"], None, None, slot["q_norm_weight"], slot["k_norm_weight"], slot["cos"],
                                slot["sin"], slot["dqkv"], s_gcos, s_gsin, slot["grad_q_norm_weight"],
                                slot["grad_k_norm_weight"], s_gx, exact=False, norm_after_rope=norm_after_rope,
                                saved_rotated=False, eps=eps, finish_outside=False, cfg=cfg, variant=variant,
                                gg=slot["grad_gate"], xv=slot["saved_v"], row_amax=row_amax, col_amax=col_amax)
    products = ()
    if path != "cublas":
        sms = sm_count(dev)
        if path == "chain":
            products = chain_launches(slot["dqkv"], s_w, s_x, s_gx, s_dw, sms, cfg)
        else:
            products = (hybrid_dw_launch(slot["dqkv"], s_x, s_dw, sms, cfg),)
    table.release()
    lt_dx = lt_dw = None
    if recipe is None and aligned and qkv_weight.dtype == dt and hidden_states.dtype == dt:
        if need_x and path != "chain":  # g_x [M, hidden] and g_w [n_tot, hidden]: allocated contiguous by the run
            lt_dx = plan_matmul(dt, dev, M, hidden, n_tot, dqk.stride(), qkv_weight.stride(), (hidden, 1), cfg)
        if need_w and x2d is not None and path == "cublas":
            lt_dw = plan_matmul(dt, dev, n_tot, hidden, M, dqk.t().stride(), x2d.stride(), (hidden, 1), cfg)
    return TrainingBackwardPlan(cfg, sizes, need, stage, table, aligned, lt_dx, lt_dw, recipe, path, products)


PLANS = PlanCache("training_backward", build_training_backward)


def training_backward(grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
                      num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend, need_b=False,
                      grad_gate=None, variant=PLAIN, keep_dqkv=False, fp8_key="", fp8_weight=None, fp8_x_amax=None):
    """The training block's gradients (see :class:`TrainingBackwardPlan`). ``q_norm_weight``/
    ``k_norm_weight`` None: unweighted norms (their gradients None); ``grad_gate`` with a gate;
    ``keep_dqkv``: dQKV appended (see :meth:`TrainingBackwardPlan.run`); ``fp8_key``: the forward's
    FP8 recipe (:mod:`fusedqkv.ops.fp8`), "" for none; ``fp8_weight``: qkv_weight's cast for dX kept
    from the forward, or None; ``fp8_x_amax``: hidden_states' amaxes for dW's cast kept from the
    forward, or None."""
    tensors = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, cos, sin)
    if q_norm_weight is not None:
        tensors += (q_norm_weight, k_norm_weight)
    if grad_gate is not None:
        tensors += (grad_gate,)
    amax_flags = fp8.stage_amax_key(fp8_key)  # what decides the stage's amax partials (fp8.stage_amax)
    scalars = (num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend, need_b, variant,
               q_norm_weight is None, grad_gate is None, fp8_key, amax_flags)
    build_args = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin,
                  num_heads, num_kv_heads, eps, norm_after_rope, need_x, need_w, need_cs, backend, need_b, grad_gate,
                  variant, fp8_key, bool(amax_flags))
    call = (grad_q, grad_k, grad_v, hidden_states, qkv_weight, qkv, q_norm_weight, k_norm_weight, cos, sin, grad_gate)
    plan = PLANS.lookup(tensors, scalars, build_args)
    try:
        return plan.run(*call, keep_dqkv, fp8_weight, fp8_x_amax)
    except Misaligned:
        plan = PLANS.full_lookup(list(tensors), ("unaligned",) + scalars, build_args, remember=False)
        return plan.run(*call, keep_dqkv, fp8_weight, fp8_x_amax)
