"""The GQA input block under ``torch.distributed``: DDP, FSDP2 and tensor (head) parallelism.

Data parallel
-------------
``DistributedDataParallel`` and FSDP2 (``torch.distributed.fsdp.fully_shard``) need nothing
from this module: both hand the block plain (unsharded) parameters in its forward, and the
block's backward returns ordinary gradients for them to reduce. Mixed precision
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``),
``torch.compile`` of the wrapped model and activation checkpointing
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) work unchanged; the block
requires hidden_states, qkv_weight, cos and sin in one dtype, which FSDP2's default
``cast_forward_inputs=True`` gives when cos/sin are arguments of a ``fully_shard``-ed module.

Tensor parallel (head parallel)
-------------------------------
:class:`HeadParallelQKV` is a ``ParallelStyle`` for
``torch.distributed.tensor.parallel.parallelize_module`` (``parallelize_block`` and
``tp_plan`` build it). It is the column-parallel QKV projection of Megatron-style attention,
split by heads: with ``tp`` ranks, rank ``r`` computes query heads
``[r*Hq/tp, (r+1)*Hq/tp)`` and KV heads ``[r*Hkv/tp, (r+1)*Hkv/tp)`` -- the KV heads its query
heads attend to -- so attention after the block is head-parallel with no communication, and
the output projection that follows is ``RowwiseParallel`` (its input is the local heads,
``Shard(-1)`` of ``[B, S, Hq*D]``; it all-reduces its output).

Parameter layout. The fused weight's rows are ``[Q | K | V]``; a plain ``Shard(0)`` would cut
that across the Q/K/V boundaries. Rank ``r`` needs the rows ``[Q_r | K_r | V_r]``, which is
one contiguous block only of the *TP row order* ``[Q_0|K_0|V_0 | Q_1|K_1|V_1 | ...]``. So the
parallelized ``qkv_weight`` is a ``DTensor`` with placement ``Shard(0)`` whose global tensor
is the weight in the TP row order (:func:`tp_row_order`): its local shard is exactly the
``qkv_weight`` of a block with ``Hq/tp`` and ``Hkv/tp`` heads, and the forward uses
``to_local()`` of it -- no gather, no copy, on the hot path. Elementwise things (optimizers,
weight decay, gradient clipping, FSDP2 on top) do not care about the row order.

What ``full_tensor()`` means: ``block.qkv_weight.full_tensor()`` (and of its gradient and its
optimizer state) is the weight in the TP row order, which depends on ``tp``.
:func:`full_qkv_weight` returns the ``[Q | K | V]`` weight; :func:`to_canonical_rows` /
:func:`to_tp_rows` convert any tensor between the two orders. The module's ``state_dict()``
is in the ``[Q | K | V]`` order (a hook all-gathers and re-shards; so on a parallelized block
``state_dict()`` is a collective over the TP group: call it on every rank, as
``torch.distributed.checkpoint`` does), and ``load_state_dict()`` accepts the ``[Q | K | V]``
order as a plain full tensor or a DTensor of any placement. Checkpoints therefore move
between unsharded blocks and any TP degree. The optimizer's state is not converted: reload it
only at the same TP degree (or convert it with :func:`to_canonical_rows`).

The q/k norm weights are replicated (``Replicate()`` DTensors): each rank's backward gives
the gradient over its own heads only, so the style all-reduces it (sum) in the backward --
the parameters' ``.grad`` is a ``Replicate()`` DTensor holding the full gradient. cos/sin
are replicated; their gradient (only computed when they require grad) is all-reduced the
same way. hidden_states is replicated over the TP group (or, with
``input_layouts=Shard(1)``, sequence-sharded and all-gathered first); its gradient is
all-reduced (reduce-scattered for ``Shard(1)``), Megatron's ``f`` operator.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from .autograd import gqa_qkv_rope_qk_norm
from .module import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm, reference_block

__all__ = ["HeadParallelQKV", "parallelize_block", "tp_plan", "HeadParallelGQAQKVRoPEQKNorm",
           "HeadParallelReferenceGQAQKVRoPEQKNorm", "tp_row_order", "to_tp_rows", "to_canonical_rows",
           "full_qkv_weight", "require_tp_divisible"]

_BLOCK_PARAMS = ("qkv_weight", "q_norm_weight", "k_norm_weight")


# --------------------------------------------------------------------------- row orders


def require_tp_divisible(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Head parallelism gives every rank num_heads/tp query and num_kv_heads/tp KV heads."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive int (the tensor-parallel size), got {tp!r}")
    if num_heads % tp or num_kv_heads % tp:
        raise ValueError(
            f"tensor parallel size tp={tp}: num_heads={num_heads} and num_kv_heads={num_kv_heads} must both be "
            f"divisible by tp (each rank holds num_heads/tp query heads and num_kv_heads/tp KV heads)")


def tp_row_order(num_heads: int, num_kv_heads: int, head_dim: int, tp: int,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Row indices ``perm`` with ``w[perm]`` = the TP row order ``[Q_0|K_0|V_0 | Q_1|K_1|V_1 | ...]``
    of a ``[Q | K | V]`` weight (``Q_r``: rank r's query heads, ``K_r``/``V_r``: its KV heads)."""
    require_tp_divisible(num_heads, num_kv_heads, tp)
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    rows = torch.arange((hq + 2 * hkv) * d, device=device)
    q, k, v = rows.split([hq * d, hkv * d, hkv * d])
    q, k, v = q.view(tp, -1), k.view(tp, -1), v.view(tp, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def _head_dim_of(weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    heads = num_heads + 2 * num_kv_heads
    if weight.dim() < 1 or weight.shape[0] == 0 or weight.shape[0] % heads:
        raise ValueError(f"weight: expected (num_heads + 2*num_kv_heads)*head_dim = ({num_heads} + 2*{num_kv_heads})"
                         f"*head_dim rows, got shape {list(weight.shape)}")
    return weight.shape[0] // heads


def to_tp_rows(weight: torch.Tensor, num_heads: int, num_kv_heads: int, tp: int) -> torch.Tensor:
    """A full ``[Q | K | V]``-ordered tensor (rows first) in the TP row order."""
    d = _head_dim_of(weight, num_heads, num_kv_heads)
    return weight.index_select(0, tp_row_order(num_heads, num_kv_heads, d, tp, weight.device))


def to_canonical_rows(weight: torch.Tensor, num_heads: int, num_kv_heads: int, tp: int) -> torch.Tensor:
    """Inverse of :func:`to_tp_rows`: a full TP-row-ordered tensor back in ``[Q | K | V]`` order.

    Use it on ``full_tensor()`` of a parallelized block's qkv_weight, its gradient or its
    optimizer state."""
    d = _head_dim_of(weight, num_heads, num_kv_heads)
    inverse = torch.argsort(tp_row_order(num_heads, num_kv_heads, d, tp, weight.device))
    return weight.index_select(0, inverse)


def full_qkv_weight(block: nn.Module) -> torch.Tensor:
    """The full ``[Q | K | V]`` qkv_weight of a block, parallelized or not (collective if it is)."""
    w = block.qkv_weight
    if not isinstance(w, DTensor):
        return w.detach()
    tp = getattr(block, "tp_size", None)
    if tp is None:
        raise ValueError("block: its qkv_weight is a DTensor but the block was not parallelized by "
                         "fusedqkv.distributed.HeadParallelQKV; its row order is unknown")
    return to_canonical_rows(w.detach().full_tensor(), block.num_heads, block.num_kv_heads, tp)


# --------------------------------------------------------------------------- autograd pieces


def _sum_grad_over(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the backward all-reduces (sums) the gradient over ``mesh``.

    For a tensor every rank holds whole but uses for its own heads only: each rank's
    gradient is a partial sum (``Partial``), ``from_local``'s backward turns it into
    ``Replicate`` (Megatron's ``f``)."""
    if not t.requires_grad:
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _replicated_local(t: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """The whole tensor on this rank (gathered from ``layout`` if needed), gradient summed over ``mesh``."""
    if not isinstance(t, DTensor):
        if isinstance(layout, Replicate):
            return _sum_grad_over(t, mesh)
        t = DTensor.from_local(t, mesh, [layout], run_check=False)
    if t.placements != (Replicate(),):
        t = t.redistribute(placements=[Replicate()])
    return t.to_local(grad_placements=[Partial()]) if t.requires_grad else t.to_local()


def _local_reference(module, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, hq, hkv):
    """ReferenceGQAQKVRoPEQKNorm.forward on local tensors and local head counts."""
    return reference_block(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, hq, hkv, module.eps,
                           module.norm_after_rope)


def _local_fused(module, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, hq, hkv):
    return gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin,
                                num_heads=hq, num_kv_heads=hkv, eps=module.eps,
                                qk_norm_position=module.qk_norm_position)


class _HeadParallelForward:
    """Mixed into a parallelized block's class: the forward on the local heads."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        mesh = self.tp_mesh
        x = _replicated_local(hidden_states, mesh, self.tp_input_layout)
        cos = _replicated_local(cos, mesh, Replicate())
        sin = _replicated_local(sin, mesh, Replicate())
        w = self.qkv_weight.to_local()  # [Q_r | K_r | V_r]: this rank's heads, no copy
        q_w = _sum_grad_over(self.q_norm_weight.to_local(), mesh)
        k_w = _sum_grad_over(self.k_norm_weight.to_local(), mesh)
        q, k, v = self._local_forward(x, w, q_w, k_w, cos, sin, self.local_num_heads, self.local_num_kv_heads)
        if self.tp_use_local_output:
            return q, k, v
        # [B, H, S, D] with this rank's heads: the global tensor sharded on the head dim
        return tuple(DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in (q, k, v))


class HeadParallelGQAQKVRoPEQKNorm(_HeadParallelForward, GQAQKVRoPEQKNorm):
    """The class of a ``GQAQKVRoPEQKNorm`` after ``HeadParallelQKV`` (swapped in place, as
    FSDP2 does): the fused op on the local shard with the local head counts."""

    _local_forward = _local_fused


class HeadParallelReferenceGQAQKVRoPEQKNorm(_HeadParallelForward, ReferenceGQAQKVRoPEQKNorm):
    """The class of a ``ReferenceGQAQKVRoPEQKNorm`` after ``HeadParallelQKV``."""

    _local_forward = _local_reference


# the block classes whose forward the head-parallel forward reproduces on local tensors
_PARALLEL_CLASSES = {GQAQKVRoPEQKNorm: HeadParallelGQAQKVRoPEQKNorm,
                     ReferenceGQAQKVRoPEQKNorm: HeadParallelReferenceGQAQKVRoPEQKNorm}


# --------------------------------------------------------------------------- state dict in [Q | K | V]


def _state_dict_canonical(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "qkv_weight"
    w = state_dict.get(key)
    if not isinstance(w, DTensor):
        return
    full = to_canonical_rows(w.detach().full_tensor(), module.num_heads, module.num_kv_heads, module.tp_size)
    # same mesh and placements as the parameter, over the [Q | K | V] global tensor
    state_dict[key] = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None)


def _load_state_dict_from_canonical(module, state_dict, prefix, *args) -> None:
    """Incoming values are the [Q | K | V] weight (a plain full tensor or a DTensor of any placement)
    and the norm weights (plain or DTensor): turn them into DTensors like the parameters."""
    for name in _BLOCK_PARAMS:
        key = prefix + name
        if key not in state_dict:
            continue
        src, param = state_dict[key], getattr(module, name)
        if not isinstance(param, DTensor) or not isinstance(src, torch.Tensor):
            continue
        value = src.full_tensor() if isinstance(src, DTensor) else src
        if tuple(value.shape) != tuple(param.shape):
            continue  # the default loader reports the shape mismatch
        value = value.detach().to(device=param.device)
        if name == "qkv_weight":
            value = to_tp_rows(value, module.num_heads, module.num_kv_heads, module.tp_size)
        state_dict[key] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


# --------------------------------------------------------------------------- the style


class HeadParallelQKV(ParallelStyle):
    """Head-parallel (column-parallel) ``ParallelStyle`` for ``fusedqkv.GQAQKVRoPEQKNorm`` (and
    ``fusedqkv.ReferenceGQAQKVRoPEQKNorm``), for ``parallelize_module`` on a 1-D TP mesh.

    Keyword Args:
        input_layouts: how a plain-tensor ``hidden_states`` is laid out over the TP group:
            ``Replicate()`` (default; every rank has the whole batch) or ``Shard(1)``
            (sequence parallel: all-gathered in the forward, its gradient reduce-scattered). A
            DTensor ``hidden_states`` is redistributed to ``Replicate()`` whatever this says.
        use_local_output: return ``(q, k, v)`` as plain tensors of this rank's heads,
            ``[B, Hq/tp, S, D]`` / ``[B, Hkv/tp, S, D]`` (default), or as DTensors ``Shard(1)``
            of the global ``[B, H, S, D]``.

    The parameters become DTensors: ``qkv_weight`` ``Shard(0)`` in the TP row order,
    ``q_norm_weight``/``k_norm_weight`` ``Replicate()`` (their gradients all-reduced). The
    module keeps its global ``num_heads``/``num_kv_heads`` and gains ``tp_mesh``, ``tp_size``,
    ``local_num_heads`` and ``local_num_kv_heads``. See :mod:`fusedqkv.distributed`.
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, use_local_output: bool = True):
        super().__init__()
        layout = Replicate() if input_layouts is None else input_layouts
        if not (isinstance(layout, Replicate) or (isinstance(layout, Shard) and layout.dim in (1, -2))):
            raise ValueError(f"input_layouts: expected Replicate() or Shard(1) (sequence-sharded hidden_states "
                             f"[batch, seq, hidden]), got {layout!r}")
        self.input_layouts = Shard(1) if isinstance(layout, Shard) else layout
        self.use_local_output = bool(use_local_output)

    def __repr__(self) -> str:
        return f"HeadParallelQKV(input_layouts={self.input_layouts!r}, use_local_output={self.use_local_output})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        base = type(module)
        if isinstance(module, _HeadParallelForward):
            raise ValueError(f"module: {base.__name__} is already head-parallel")
        if base not in _PARALLEL_CLASSES:
            raise NotImplementedError(
                f"HeadParallelQKV: expected a fusedqkv.GQAQKVRoPEQKNorm or ReferenceGQAQKVRoPEQKNorm, got "
                f"{base.__name__} (its forward is not known to the head-parallel plan)")
        names = tuple(n for n, _ in module.named_parameters())
        if sorted(names) != sorted(_BLOCK_PARAMS) or list(module.children()):
            raise NotImplementedError(f"HeadParallelQKV: expected exactly the parameters {_BLOCK_PARAMS}, "
                                      f"got {names}")
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise ValueError("device_mesh: expected a 1-D tensor-parallel DeviceMesh (pass mesh['tp'] of a "
                             f"multi-dimensional mesh), got {device_mesh!r}")
        tp = device_mesh.size()
        require_tp_divisible(module.num_heads, module.num_kv_heads, tp)
        for n in _BLOCK_PARAMS:
            p = getattr(module, n)
            if isinstance(p, DTensor):
                raise ValueError(f"module.{n}: already a DTensor; apply HeadParallelQKV to a block with plain "
                                 "parameters (before fully_shard)")
            if p.device.type != device_mesh.device_type and p.device.type != "meta":
                raise ValueError(f"module.{n}: on {p.device}, but device_mesh is a {device_mesh.device_type} mesh; "
                                 "move the block to the mesh's device first")

        src = getattr(self, "src_data_rank", 0)  # rank 0's values become the parameters of every rank, as in ColwiseParallel
        w = module.qkv_weight
        w_tp = to_tp_rows(w.detach(), module.num_heads, module.num_kv_heads, tp)
        module.register_parameter("qkv_weight", nn.Parameter(
            distribute_tensor(w_tp, device_mesh, [Shard(0)], src_data_rank=src), requires_grad=w.requires_grad))
        for n in ("q_norm_weight", "k_norm_weight"):
            p = getattr(module, n)
            module.register_parameter(n, nn.Parameter(
                distribute_tensor(p.detach(), device_mesh, [Replicate()], src_data_rank=src),
                requires_grad=p.requires_grad))

        module.tp_mesh = device_mesh
        module.tp_size = tp
        module.tp_input_layout = self.input_layouts
        module.tp_use_local_output = self.use_local_output
        module.local_num_heads = module.num_heads // tp
        module.local_num_kv_heads = module.num_kv_heads // tp
        module.__class__ = _PARALLEL_CLASSES[base]
        module.register_state_dict_post_hook(_state_dict_canonical)
        module.register_load_state_dict_pre_hook(_load_state_dict_from_canonical)
        return module


def tp_plan(model: nn.Module, **style_kwargs) -> dict[str, HeadParallelQKV]:
    """``{fqn: HeadParallelQKV(**style_kwargs)}`` for every fusedqkv block in ``model``; merge it
    with the plan of the rest of the model (e.g. ``{"...o_proj": RowwiseParallel()}``) and pass
    it to ``parallelize_module(model, tp_mesh, plan)``."""
    plan = {name: HeadParallelQKV(**style_kwargs) for name, m in model.named_modules()
            if type(m) in _PARALLEL_CLASSES}
    if not plan:
        raise ValueError("model: contains no fusedqkv.GQAQKVRoPEQKNorm / ReferenceGQAQKVRoPEQKNorm block")
    if "" in plan:
        raise ValueError("model: is itself a block; use fusedqkv.distributed.parallelize_block(model, tp_mesh)")
    return plan


def parallelize_block(block: nn.Module, tp_mesh: DeviceMesh, **style_kwargs) -> nn.Module:
    """``parallelize_module(block, tp_mesh, HeadParallelQKV(**style_kwargs))``: the block, head-parallel, in place."""
    return parallelize_module(block, tp_mesh, HeadParallelQKV(**style_kwargs))
