"""The training block's forward, planned: one GEMM (``qkv = x W^T [+ b]``, a planned cuBLASLt
call or ``torch.mm``) and the forward stage (RoPE + RMSNorm of q and k, :mod:`fusedqkv.ops.gqa_forward`).

``forward_plan`` finds or builds the plan of a call's signature (validating on a miss);
``run_forward`` runs it: ``(q, k, qkv, rstd_q, rstd_k, v)`` (v None unless the variant norms it).
The block's variants (``q_gate``, ``rope_style``, ``norm_scope``, ``v_norm``, ``k_eq_v``; unweighted norms as
None weights; partial rotary from cos/sin's width) are part of the plan's key.
"""

from __future__ import annotations

import torch

from . import config as _config
from . import device as _device
from . import host_gemm
from . import fp8
from . import validation as V
from .cublaslt import lt_matmul
from .gqa_forward import (_require_bool, _require_int, forward_outputs, forward_torch, plan_forward_stage, token_major,
                          validate_forward_inputs)
from .launch import Table
from .plan_cache import Misaligned, PlanCache, as_matrix
from .qkv_rope_norm_gemm import LORA_ENTRIES, FusedGemmForward, call_entries, plan_fused_forward
from .rope_qk_norm import pick_backend

# the stage's table entries, by name (the norm weights only when the norms have them, v only when normed)
STAGE_ENTRIES = ("qkv", "q_norm_weight", "k_norm_weight", "cos", "sin", "q", "k", "rstd_q", "rstd_k", "v")


class ForwardPlan:
    """The training block's forward of one input signature."""

    def __init__(self, cfg, sz, backend, launch=None, table=None, aligned=True, lt_qkv=None, fused=None, fp8=None,
                 fused_lora=None):
        self.cfg, self.sz, self.backend, self.launch, self.table, self.aligned = cfg, sz, backend, launch, table, aligned
        # an ops.fp8.Fp8Recipe: the GEMM in FP8 (then no cuBLASLt plan; the one-launch forward's FP8 build where
        # the plan takes it: ``fused`` with scales, on the casts of x and W)
        self.fp8 = fp8
        self.lt_qkv = lt_qkv  # qkv = x W^T as a planned cuBLASLt call (no bias, aligned plans), or None
        # the whole forward as one Hopper launch (ops/qkv_rope_norm_gemm.FusedGemmForward; launch and table
        # are its bound launch), or None
        self.fused = fused
        # a residual plan's one-launch forward with LoRA adapters as more inner columns (FusedGemmForward
        # with lora; LoRAUpdate.gemm_operands), or None; its bound launches per rank sum, built at the first
        # call of each
        self.fused_lora = fused_lora
        self.lora_launches: dict = {}
        b, s, d = sz["batch"], sz["seq"], sz["head_dim"]
        self.M, self.hidden, self.n_tot = b * s, sz["hidden"], sz["qkv"]
        self.qkv_shape = (b, s, self.n_tot)
        self.out_dims = (b, s, sz["num_heads"], sz["num_kv_heads"], d)  # forward_outputs' sizes
        self.cs_shape = (b, s, sz["rot"])
        self.device, self.dtype = sz["device"], sz["dtype"]
        self.variant = sz["variant"]
        # v where the variant does not norm it: a view of qkv's value columns (k_eq_v: the raw k's),
        # as_strided's (size, stride, offset from qkv's storage offset), [B, Hkv, S, D] token-major
        var, hq, hkv, n = sz["variant"], sz["num_heads"], sz["num_kv_heads"], self.n_tot
        nq = 2 * hq if var.q_gate else hq
        self.v_view = None if var.v_norm else ((b, hkv, s, d), (s * n, d, n, 1), (nq if var.k_eq_v else nq + hkv) * d)
        # rstd nobody reads (the eager training forward: the backward recomputes it) goes to a kept
        # per-stream scratch: rstd_q's bytes, rounded to 256 (the kernel assumes aligned pointers), then rstd_k's
        self.rstd_q_bytes = -(-b * sz["num_heads"] * s * 4 // 256) * 256
        self.rstd_bytes = self.rstd_q_bytes + b * sz["num_kv_heads"] * s * 4
        self._gather = None  # the table's addresses from the call's, in the launch's entry order (bound launches)

    def run(self, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias=None, qkv_residual=None,
            keep_rstd=True, lora=None, fp8_weight=None, fp8_input=None):
        """(q, k, qkv, rstd_q, rstd_k, v); cos/sin ``[batch, seq, rot]`` (expanded); v None unless
        the variant norms it. ``qkv_residual`` (plans built with one): ``[batch, seq, qkv]`` added to
        the projection output before RoPE and the norms (a LoRA update). ``lora`` (plans built with
        a residual, instead): a :class:`~fusedqkv.ops.lora.LoRAUpdate` whose update goes into the
        projection output there: inside the one-launch forward's GEMM where the plan has it and U's
        width can be a TMA operand, else in place after the GEMM (the LoRA GEMMs accumulating into
        it). ``keep_rstd=False``: a caller that does not read rstd (the eager training forward);
        bound launches then write it to a kept scratch and return None for both. ``fp8_weight``
        (FP8 plans): qkv_weight's cast for the GEMM made beforehand (``fp8.weight_casts``), or None;
        ``fp8_input``: hidden_states' (``fp8.input_cast_keeping_amax``), or None."""
        sz = self.sz
        if lora is not None and self.fused_lora is not None and FusedGemmForward.takes_rank(lora.rank, self.dtype):
            return self._run_fused(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, keep_rstd,
                                   lora.gemm_operands(hidden_states.reshape(self.M, self.hidden), self.backend))
        if self.fused is not None:
            return self._run_fused(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, keep_rstd,
                                   fp8_weight=fp8_weight, fp8_input=fp8_input)
        lt, launch = self.lt_qkv, self.launch
        bound = launch is not None and launch.bound
        stream, capture = _device.call_state(self.device)
        if self.fp8 is not None:
            qkv = fp8.forward(hidden_states.reshape(self.M, self.hidden), qkv_weight, self.fp8,
                              w_cast=fp8_weight, x_cast=fp8_input).view(self.qkv_shape)
            if qkv_bias is not None:  # after the GEMM, as Float8Linear adds it
                qkv.add_(qkv_bias)
        elif lt is not None and bound:
            x_ptr, w_ptr = hidden_states.data_ptr(), qkv_weight.data_ptr()
            if (x_ptr | w_ptr) & 15:
                raise Misaligned
            qkv = hidden_states.new_empty(self.qkv_shape)  # (hidden_states' dtype is the plan's)
            lt(x_ptr, w_ptr, qkv.data_ptr(), stream, capture)
        elif qkv_bias is None:
            qkv = host_gemm.mm(hidden_states.reshape(self.M, self.hidden), qkv_weight.t()).view(self.qkv_shape)
        else:  # the bias rides in the GEMM: RoPE/norm see x W^T + b, as HF's Linear gives it
            qkv = host_gemm.addmm(qkv_bias, hidden_states.reshape(self.M, self.hidden),
                                  qkv_weight.t()).view(self.qkv_shape)
        if qkv_residual is not None:
            qkv.add_(qkv_residual)
        elif lora is not None:
            lora.forward(qkv.view(self.M, -1), hidden_states.reshape(self.M, self.hidden), self.backend)
        if launch is None:
            q, k, rq, rk, v = forward_torch(qkv, q_norm_weight, k_norm_weight, cos, sin, sz["num_heads"],
                                            sz["num_kv_heads"], sz["eps"], sz["norm_after_rope"], self.variant)
            return q, k, qkv, rq, rk, v
        dev = self.device
        if bound:
            b, s, hq, hkv, d = self.out_dims
            q, k = token_major(b, hq, s, d, self.dtype, dev), token_major(b, hkv, s, d, self.dtype, dev)
            v = token_major(b, hkv, s, d, self.dtype, dev) if self.variant.v_norm else None
            rq, rk, prq, prk = self._rstd(stream, keep_rstd, capture)
            wq = q_norm_weight.data_ptr() if q_norm_weight is not None else 0
            wk = k_norm_weight.data_ptr() if k_norm_weight is not None else 0
            pcos, psin = cos.data_ptr(), sin.data_ptr()
            if self.aligned and (wq | wk | pcos | psin) & 15:
                raise Misaligned
            gather = self._gather or self._make_gather(STAGE_ENTRIES)
            launch.launch(None, gather([qkv.data_ptr(), wq, wk, pcos, psin, q.data_ptr(), k.data_ptr(), prq, prk,
                                        v.data_ptr() if v is not None else 0]), stream)
            return q, k, qkv, rq, rk, v
        q, k, rq, rk, v = forward_outputs(*self.out_dims, self.dtype, dev, self.variant.v_norm)
        named = dict(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos=cos, sin=sin, q=q, k=k,
                     rstd_q=rq, rstd_k=rk, v=v)
        launch.launch(self.table.tensors(named), None, stream)
        return q, k, qkv, rq, rk, v

    def _make_gather(self, order):
        self._gather = self.table.gather(order)
        return self._gather

    def _rstd(self, stream: int, keep: bool, capture: bool) -> tuple:
        """(rstd_q, rstd_k, their addresses): new tensors, or (``keep`` False, not capturing:
        ``capture``) None and addresses in the stream's kept scratch, which nothing reads."""
        b, s, hq, hkv, _ = self.out_dims
        if keep or capture:
            rq = torch.empty((b, hq, s), dtype=torch.float32, device=self.device)
            rk = torch.empty((b, hkv, s), dtype=torch.float32, device=self.device)
            return rq, rk, rq.data_ptr(), rk.data_ptr()
        p = _device.workspace("rstd", self.device, stream, self.rstd_bytes, False).data_ptr()
        return None, None, p, p + self.rstd_q_bytes


    def _run_fused(self, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, keep_rstd=True,
                   lora_operands=None, fp8_weight=None, fp8_input=None):
        """The one-launch forward; ``lora_operands``: (U, B) of the LoRA adapters (the residual plan's
        ``fused_lora`` kernel, one bound launch per rank sum, built at its first call). FP8 plans: its
        GEMM on x's and W's casts (``fp8_weight``/``fp8_input`` where made beforehand, else made here:
        :func:`fp8.forward_operands`), their inverse scales two more entries."""
        x, w = hidden_states, qkv_weight
        if self.fp8 is not None:
            (x, xs), (w, ws) = fp8.forward_operands(hidden_states.reshape(self.M, self.hidden), qkv_weight, self.fp8,
                                                    fp8_weight, fp8_input)
            extra, names = (xs, ws), ("x_scale", "w_scale")
        elif lora_operands is not None:
            extra, names = lora_operands, ("u", "b")
        else:
            extra, names = (), ()
        x_ptr, w_ptr = x.data_ptr(), w.data_ptr()
        if (x_ptr | w_ptr) & 15:  # the TMA descriptors' bases
            raise Misaligned
        dev = self.device
        qkv = hidden_states.new_empty(self.qkv_shape)  # (hidden_states' dtype is the plan's)
        if lora_operands is None:
            table, launch, gather = self.table, self.launch, self._gather
        else:
            table, launch, gather = self.lora_launches.get(extra[0].shape[1], (None, None, None))
        stream, capture = _device.call_state(dev)
        if launch is not None and launch.bound:
            b, s, hq, hkv, d = self.out_dims
            q, k = token_major(b, hq, s, d, self.dtype, dev), token_major(b, hkv, s, d, self.dtype, dev)
            rq, rk, prq, prk = self._rstd(stream, keep_rstd, capture)
            wq = q_norm_weight.data_ptr() if q_norm_weight is not None else 0
            wk = k_norm_weight.data_ptr() if k_norm_weight is not None else 0
            pcos, psin = cos.data_ptr(), sin.data_ptr()
            if self.aligned and (wq | wk | pcos | psin) & 15:
                raise Misaligned
            gather = gather or self._make_gather(self.fused.entries)
            launch.launch(None, gather([x_ptr, w_ptr, qkv.data_ptr(), q.data_ptr(), k.data_ptr(), wq, wk, prq, prk,
                                        pcos, psin, *(t.data_ptr() for t in extra)]), stream)
        else:
            q, k, rq, rk, _ = forward_outputs(*self.out_dims, self.dtype, dev, False)
            named = call_entries(self.out_dims, x, w, qkv, q, k, q_norm_weight, k_norm_weight, rq, rk, cos, sin)
            named.update(zip(names, extra))
            if lora_operands is not None and launch is None:  # the first call of this rank sum
                table, launch = self.fused_lora.bound_launch(named)
                self.lora_launches[extra[0].shape[1]] = (table, launch, table.gather(LORA_ENTRIES))
            launch.launch(table.tensors(named), None, stream)
        return q, k, qkv, rq, rk, None


def build_forward(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads,
                  eps, qk_norm_position, backend, qkv_bias=None, q_gate=False, rope_style="neox", norm_scope="head",
                  v_norm=False, residual=False, k_eq_v=False, fp8_key="", *, cfg) -> ForwardPlan:
    """Validate the forward's arguments fully (clear errors) and plan it."""
    sz = validate_forward_inputs(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads,
                                 num_kv_heads, eps, qk_norm_position, q_gate=q_gate, rope_style=rope_style,
                                 norm_scope=norm_scope, v_norm=v_norm, k_eq_v=k_eq_v)
    variant = sz["variant"]
    if qkv_bias is not None:
        rows = (f"({'2*' if q_gate else ''}num_heads + {'' if variant.k_eq_v else '2*'}num_kv_heads)*head_dim")
        V.require_tensor("qkv_bias", qkv_bias)
        V.require_shape("qkv_bias", qkv_bias, (sz["qkv"],), f"[{rows}]")
        V.require_float_dtype("qkv_bias", qkv_bias)
        V.require_same_dtype([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
        V.require_same_device([("qkv_weight", qkv_weight), ("qkv_bias", qkv_bias)])
    device = sz["device"]
    recipe = fp8.recipe(fp8_key)
    if recipe is not None:
        fp8.check_supported(device, sz["hidden"], sz["qkv"], recipe)
    backend = pick_backend(device, None if backend in (None, "auto") else backend)
    M = sz["batch"] * sz["seq"]
    if backend == "torch" or M == 0:
        return ForwardPlan(cfg, sz, backend, fp8=recipe)
    b, s, d, rot = sz["batch"], sz["seq"], sz["head_dim"], sz["rot"]
    aligned = all(t.data_ptr() % 16 == 0 for t in (q_norm_weight, k_norm_weight, cos, sin) if t is not None)
    # the one-launch forward has no point between its GEMM and its stage where a residual could be added; a
    # residual plan keeps cuBLAS + the stage (a qkv_residual tensor) and, beside it, the one-launch forward
    # that takes LoRA adapters inside its GEMM
    small = (cos, sin, q_norm_weight, k_norm_weight)
    fused = None if residual else plan_fused_forward(sz, hidden_states, qkv_weight, qkv_bias, cfg, small,
                                                     recipe=recipe)
    fused_lora = plan_fused_forward(sz, hidden_states, qkv_weight, qkv_bias, cfg, small, lora=True) if (
        residual and recipe is None) else None
    qkv = torch.empty((b, s, sz["qkv"]), dtype=sz["dtype"], device=device)
    q, k, rq, rk, v = forward_outputs(b, s, num_heads, num_kv_heads, d, sz["dtype"], device, variant.v_norm)
    if fused is not None:  # one launch: no GEMM or stage of its own to plan
        x, w, extra = hidden_states, qkv_weight, {}
        if recipe is not None:  # its operands: the casts' codes and inverse scales, as the calls make them
            (x, xs), (w, ws) = fp8.forward_operands_like(M, sz["hidden"], sz["qkv"], recipe, device)
            extra = dict(x_scale=xs, w_scale=ws)
        named = call_entries((b, s, num_heads, num_kv_heads, d), x, w, qkv, q, k, q_norm_weight, k_norm_weight,
                             rq, rk, cos.expand(b, s, rot), sin.expand(b, s, rot))
        table, launch = fused.bound_launch(dict(named, **extra))
        return ForwardPlan(cfg, sz, backend, launch, table, aligned, fused=fused, fp8=recipe)
    like = dict(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos=cos.expand(b, s, rot),
                sin=sin.expand(b, s, rot), q=q, k=k, rstd_q=rq, rstd_k=rk, v=v)
    table = Table()
    slots = [None if like[name] is None else table.add(name, like[name]) for name in STAGE_ENTRIES]
    launch = plan_forward_stage(*slots[:9], num_heads, num_kv_heads, sz["eps"], sz["norm_after_rope"], cfg, variant,
                                slots[9])
    table.release()
    lt_qkv = None
    if recipe is None and qkv_bias is None and aligned and hidden_states.data_ptr() % 16 == 0 and qkv_weight.data_ptr() % 16 == 0:
        lt_qkv = lt_matmul(as_matrix(hidden_states, M, sz["hidden"]), qkv_weight.t(), qkv.view(M, sz["qkv"]), cfg)
    return ForwardPlan(cfg, sz, backend, launch, table, aligned, lt_qkv, fp8=recipe, fused_lora=fused_lora)


PLANS = PlanCache("training_forward", build_forward)


def _guarded(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias) -> tuple:
    """The call's tensors (the norm weights only where given, the bias only where given)."""
    tensors = (hidden_states, qkv_weight, cos, sin)
    if q_norm_weight is not None or k_norm_weight is not None:
        tensors += (q_norm_weight, k_norm_weight)
    if qkv_bias is not None:
        tensors += (qkv_bias,)
    return tensors


def forward_plan(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
                 qk_norm_position, backend, qkv_bias=None, q_gate=False, rope_style="neox", norm_scope="head",
                 v_norm=False, residual=False, k_eq_v=False, fp8_key="") -> ForwardPlan:
    """The forward's plan (validating the arguments on a miss). ``q_norm_weight``/``k_norm_weight``
    None: unweighted norms. ``residual``: the calls pass a ``qkv_residual``. ``k_eq_v``: no V rows.
    ``fp8_key``: an FP8 recipe's key (:mod:`fusedqkv.ops.fp8`), "" for none."""
    tensors = _guarded(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias)
    # the counts and flags as validation takes them before the cache sees them: 4.0 heads or q_gate=1 compare
    # equal to a cached plan's 4 and True, and would run on it where a first call is refused
    if type(num_heads) is not int or type(num_kv_heads) is not int:
        num_heads, num_kv_heads = _require_int("num_heads", num_heads), _require_int("num_kv_heads", num_kv_heads)
    if type(q_gate) is not bool or type(v_norm) is not bool or type(k_eq_v) is not bool:
        q_gate, v_norm, k_eq_v = (_require_bool("q_gate", q_gate), _require_bool("v_norm", v_norm),
                                  _require_bool("k_eq_v", k_eq_v))
    if type(eps) not in (float, int):  # a NumPy number or a one-element tensor: read once, then planned as a float
        eps = V.require_number("eps", eps, min_value=0.0)
    args = (hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, num_heads, num_kv_heads, eps,
            qk_norm_position, backend, qkv_bias, q_gate, rope_style, norm_scope, v_norm, residual, k_eq_v, fp8_key)
    for t in tensors:  # (a loop: no generator per call)
        if not isinstance(t, torch.Tensor):
            return build_forward(*args, cfg=_config.current())
    scalars = (num_heads, num_kv_heads, eps, qk_norm_position, backend, qkv_bias is not None, q_norm_weight is None,
               q_gate, rope_style, norm_scope, v_norm, residual, k_eq_v, fp8_key)
    return PLANS.lookup(tensors, scalars, args)


def run_forward(plan: ForwardPlan, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                qkv_bias=None, qkv_residual=None, keep_rstd=True, lora=None, fp8_weight=None, fp8_input=None):
    """``plan.run``; a call whose addresses the plan was not specialised for gets its own plan.
    ``keep_rstd=False``: the caller does not read rstd; ``fp8_weight``, ``fp8_input``: see
    :meth:`ForwardPlan.run`."""
    try:
        return plan.run(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual,
                        keep_rstd, lora, fp8_weight, fp8_input)
    except Misaligned:
        sz, var = plan.sz, plan.variant
        position = "after_rope" if sz["norm_after_rope"] else "before_rope"
        options = (var.q_gate, "interleaved" if var.interleaved else "neox", "all_heads" if var.all_heads else "head",
                   var.v_norm)
        residual = qkv_residual is not None or lora is not None
        key = "" if plan.fp8 is None else plan.fp8.key
        args = (hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, sz["num_heads"], sz["num_kv_heads"],
                sz["eps"], position, plan.backend, qkv_bias, *options, residual, var.k_eq_v, key)
        scalars = (sz["num_heads"], sz["num_kv_heads"], sz["eps"], position, plan.backend, qkv_bias is not None,
                   q_norm_weight is None, *options, residual, var.k_eq_v, key)
        own = PLANS.full_lookup(list(_guarded(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                              qkv_bias)), scalars, args, remember=False)
        return own.run(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, qkv_residual,
                       keep_rstd, lora, fp8_weight, fp8_input)
