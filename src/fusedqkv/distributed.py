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
``[r*Hq/tp, (r+1)*Hq/tp)`` and the KV heads those query heads attend to -- ``[r*Hkv/tp,
(r+1)*Hkv/tp)`` when ``tp`` divides ``Hkv``, else (fewer KV heads than ranks, ``Hkv`` dividing
``tp``) the one KV head ``r // (tp/Hkv)``, held by the ``tp/Hkv`` ranks that share it -- so
attention after the block is head-parallel with no communication, and the output projection
that follows is ``RowwiseParallel`` (its input is the local heads, ``Shard(-1)`` of ``[B, S,
Hq*D]``; it all-reduces its output).

Parameter layout. The fused weight's rows are ``[Q | K | V]``; a plain ``Shard(0)`` would cut
that across the Q/K/V boundaries. Rank ``r`` needs the rows ``[Q_r | K_r | V_r]``, which is
one contiguous block only of the *TP row order* ``[Q_0|K_0|V_0 | Q_1|K_1|V_1 | ...]``
(:func:`tp_row_order`). So the parallelized ``qkv_weight`` (and ``qkv_bias``) is a ``DTensor``
with placement ``Shard(0)`` whose global tensor is the weight in the TP row order: its local
shard is exactly the ``qkv_weight`` of a block with the rank's head counts, and the forward
runs the fused op on it -- no gather, no copy (with at least as many KV heads as ranks).

Fewer KV heads than ranks. The ``rep = tp/Hkv`` ranks that use KV head ``g`` each *store*
one of ``rep`` equal pieces of its ``2*D`` rows ``[K_g | V_g]`` (rank ``g*rep + j`` the
``j``-th): the TP row order is then ``[Q_r | piece_r]`` per rank, still a permutation of
``[Q | K | V]``. The forward all-gathers the pieces (``2*Hkv*D`` rows in all, each rank keeping
its KV head's) and runs the fused op on ``[Q_r | K_g | V_g]`` (a copy of the rank's weight,
held for the backward); the backward reduce-scatters the KV rows' gradient, which sums the
``rep`` ranks' contributions (each from its own query heads) into each piece. Every weight
element is stored and updated once, so the global DTensor is exactly the weight: norms
(``clip_grad_norm_``), parameter counts, optimizers and checkpoints see what one device has.
This needs ``2*D`` divisible by ``rep``.

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
the gradient over its own heads only, so the backward all-reduces it (sum) -- the
parameters' ``.grad`` is a ``Replicate()`` DTensor holding the full gradient. cos/sin are
replicated; their gradient (only computed when they require grad) is all-reduced the same
way. hidden_states is replicated over the TP group (or, with ``input_layouts=Shard(1)``,
sequence-sharded in equal shards and all-gathered first); its gradient is all-reduced
(reduce-scattered for ``Shard(1)``), Megatron's ``f`` operator.

The per-call path. Everything that depends only on the module and the mesh (head counts,
the group, which KV head a rank holds) is decided once, when the style is applied
(:class:`_HeadParallelPlan`). An eager call of the fused block is one autograd Function
(:class:`_HeadParallelFunction`): it takes the DTensor parameters as they are, runs the fused
forward on their local tensors, and its backward runs the fused backward and then only the
communication the gradients need (c10d collectives on the TP group) and hands the parameters'
gradients back as DTensors of the parameters' own specs. Under ``torch.compile``,
``torch.autocast``, with DTensor inputs, and for the plain-PyTorch block, the same
communication runs as functional collectives in :class:`_HeadParallelCollectives` around the
block's own forward on local tensors (``to_local()`` of the parameters), which the compiler
traces into one graph.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from .autograd import _position, differentiable_once, gqa_qkv_rope_qk_norm
from .module import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm, reference_block
from .ops.internals import dtensor_from_spec, dtensor_spec, functional_collectives
from .ops.training_backward import training_backward
from .ops.training_forward import forward_plan, run_forward
from .ops.variant import heads_of

__all__ = ["HeadParallelQKV", "parallelize_block", "tp_plan", "HeadParallelGQAQKVRoPEQKNorm",
           "HeadParallelReferenceGQAQKVRoPEQKNorm", "tp_row_order", "to_tp_rows", "to_canonical_rows",
           "full_qkv_weight", "require_tp_divisible", "kv_replicas"]

_BLOCK_PARAMS = ("qkv_weight", "q_norm_weight", "k_norm_weight")
_ROW_PARAMS = ("qkv_weight", "qkv_bias")  # rows [Q | K | V]: sharded in the TP row order

_c10d = functional_collectives()
# c10d's names for the single-tensor gather / reduce-scatter (torch >= 2.13; the older names before)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------- row orders


def require_tp_divisible(num_heads: int, num_kv_heads: int, tp: int, head_dim: Optional[int] = None) -> None:
    """Head parallelism gives every rank num_heads/tp query heads and the KV heads they use:
    num_kv_heads/tp of them, or (fewer KV heads than ranks) one, shared by tp/num_kv_heads ranks
    that each store 1/(tp/num_kv_heads) of its 2*head_dim rows."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive int (the tensor-parallel size), got {tp!r}")
    if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
        raise ValueError(
            f"tensor parallel size tp={tp}: num_heads={num_heads} and num_kv_heads={num_kv_heads}: num_heads must be "
            f"divisible by tp, and num_kv_heads divisible by tp or a divisor of it (each rank holds num_heads/tp "
            f"query heads and their KV heads: num_kv_heads/tp of them, or one KV head shared by "
            f"tp/num_kv_heads ranks)")
    rep = kv_replicas(num_kv_heads, tp)
    if head_dim is not None and (2 * head_dim) % rep:
        raise ValueError(
            f"tensor parallel size tp={tp}: head_dim={head_dim} with num_kv_heads={num_kv_heads}: the {rep} ranks "
            f"sharing a KV head each store 1/{rep} of its 2*head_dim={2 * head_dim} rows, so 2*head_dim must be "
            f"divisible by tp/num_kv_heads={rep}")


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks use each KV head: 1 when tp divides num_kv_heads, else tp/num_kv_heads."""
    return 1 if num_kv_heads % tp == 0 else tp // num_kv_heads


def tp_row_order(num_heads: int, num_kv_heads: int, head_dim: int, tp: int,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """Row indices ``perm`` (a permutation) with ``w[perm]`` = the TP row order of a ``[Q | K |
    V]`` weight: rank by rank, its query heads' rows ``Q_r`` and then its KV rows -- ``[K_r |
    V_r]`` of the KV heads ``[r*Hkv/tp, (r+1)*Hkv/tp)``, or, with fewer KV heads than ranks
    (``rep = tp/Hkv``), the ``r % rep``-th of ``rep`` equal pieces of ``[K_g | V_g]``, ``g = r //
    rep`` (the ranks sharing KV head ``g`` gather the rest in the forward)."""
    require_tp_divisible(num_heads, num_kv_heads, tp, head_dim)
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    q = torch.arange(hq * d, device=device).view(tp, -1)
    k = hq * d + torch.arange(hkv * d, device=device)
    if kv_replicas(hkv, tp) == 1:
        kv = torch.cat([k.view(tp, -1), (k + hkv * d).view(tp, -1)], dim=1)
    else:  # [K_g | V_g] for each KV head g, cut into rep pieces: one per rank, in rank order
        k = k.view(hkv, d)
        kv = torch.cat([k, k + hkv * d], dim=1).reshape(tp, -1)
    return torch.cat([q, kv], dim=1).reshape(-1)


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

    Use it on ``full_tensor()`` of a parallelized block's qkv_weight / qkv_bias, their
    gradients or their optimizer state."""
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


# --------------------------------------------------------------------------- the plan


class _HeadParallelPlan(NamedTuple):
    """What a parallelized block's calls need, decided when the style is applied (plain values:
    torch.compile treats them as constants)."""

    group: str  # the TP group's name, for the functional collectives
    tp: int
    seq_sharded: bool  # plain-tensor hidden_states is Shard(1) (else Replicate)
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    kv_replicas: int  # ranks using each KV head; > 1: each stores a piece of its rows, gathered per call
    kv_head: int  # the KV head this rank uses, when kv_replicas > 1

    @property
    def q_rows(self) -> int:
        """Rows of this rank's query heads: the first rows of its weight shard."""
        return self.num_heads * self.head_dim


# --------------------------------------------------------------------------- communication
#
# Two transports for the same collectives. ``pg`` a ProcessGroup: c10d's own calls (the eager
# call: the least host time per collective). ``pg`` None: functional collectives on the
# group's name (torch.ops._c10d_functional), which torch.compile traces. A ``_start_*``
# issues a collective and returns a pending result ``(tensor, work)``; ``_wait`` gives the
# tensor (``work``: c10d's Work, _FUNCTIONAL for a functional collective's output, or None).

_FUNCTIONAL = "functional"


def _start_all_reduce(t: torch.Tensor, plan: _HeadParallelPlan, pg) -> tuple:
    if pg is None:
        return _c10d.all_reduce(t, "sum", plan.group), _FUNCTIONAL
    return t, dist.all_reduce(t, group=pg, async_op=True)  # in place: t is the caller's own buffer


def _wait(pending: tuple) -> torch.Tensor:
    t, work = pending
    if work is _FUNCTIONAL:
        return _c10d.wait_tensor(t)
    if work is not None:
        work.wait()
    return t


def _gather_seq(x: torch.Tensor, plan: _HeadParallelPlan, pg) -> torch.Tensor:
    """[B, S/tp, H] on each rank -> [B, S, H] (equal shards, rank order)."""
    if x.dim() != 3:
        raise ValueError(f"hidden_states: expected [batch, seq/tp, hidden] (sequence-sharded), got shape "
                         f"{list(x.shape)}")
    b, s, h = x.shape
    tp = plan.tp
    if pg is None:
        g = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), tp, plan.group))
    else:
        g = x.new_empty((tp * b, s, h))
        _all_gather_single(g, x.contiguous(), group=pg)
    # g: [tp*B, S/tp, H], rank-major
    if b == 1:
        return g.view(1, tp * s, h)
    return g.view(tp, b, s, h).transpose(0, 1).reshape(b, tp * s, h)


def _start_reduce_scatter_seq(g: torch.Tensor, plan: _HeadParallelPlan, pg) -> tuple:
    """The gradient of :func:`_gather_seq`: [B, S, H] summed over ranks, this rank's S/tp tokens."""
    b, s_full, h = g.shape
    tp = plan.tp
    s = s_full // tp
    src = g.reshape(tp, s, h) if b == 1 else g.reshape(b, tp, s, h).transpose(0, 1).reshape(tp * b, s, h)
    src = src.contiguous()
    if pg is None:
        return _c10d.reduce_scatter_tensor(src, "sum", tp, plan.group), _FUNCTIONAL
    out = g.new_empty((b, s, h))
    return out, _reduce_scatter_single(out, src, group=pg, async_op=True)


def _sum(items, plan: _HeadParallelPlan, pg) -> list:
    """Small gradients (norm weights, cos/sin) summed over the TP group, in ``items``' order: one
    all-reduce per dtype (in place for a single one with a ``pg``: the caller's own buffer), all
    started before the first is waited on."""
    by_dtype: dict = {}
    for i, t in enumerate(items):
        by_dtype.setdefault(t.dtype, []).append(i)
    pending = []
    for idx in by_dtype.values():
        buf = torch.cat([items[i].reshape(-1) for i in idx]) if len(idx) > 1 else items[idx[0]].reshape(-1)
        pending.append((idx, _start_all_reduce(buf, plan, pg)))
    out = [None] * len(items)
    for idx, p in pending:
        buf = _wait(p)
        off = 0
        for i in idx:
            n = items[i].numel()
            out[i] = buf[off: off + n].view(items[i].shape)
            off += n
    return out


def _gather_kv(shard: torch.Tensor, plan: _HeadParallelPlan, pg) -> torch.Tensor:
    """Fewer KV heads than ranks: a rank's shard ``[Q_r | piece]`` (of the weight, or the bias)
    -> ``[Q_r | K_g | V_g]``, the pieces all-gathered over the TP group (rank order lays KV head
    g's pieces out as its rows)."""
    q, piece = shard[:plan.q_rows], shard[plan.q_rows:].contiguous()
    tp = plan.tp
    if pg is None:
        kv = _c10d.wait_tensor(_c10d.all_gather_into_tensor(piece, tp, plan.group))
    else:
        kv = piece.new_empty((tp * piece.shape[0],) + tuple(piece.shape[1:]))
        _all_gather_single(kv, piece, group=pg)
    rows = 2 * plan.head_dim
    return torch.cat([q, kv[plan.kv_head * rows: (plan.kv_head + 1) * rows]])


def _start_scatter_kv(grad: torch.Tensor, plan: _HeadParallelPlan, pg) -> tuple:
    """The gradient of :func:`_gather_kv`: ``grad`` of ``[Q_r | K_g | V_g]`` -> of the shard
    ``[Q_r | piece]``, the KV rows summed over the ranks using KV head g (the others add zeros)
    by one reduce-scatter. With a ``pg`` the piece is written into ``grad``'s rows after Q_r and
    the shard's gradient is a view of ``grad``; else (traced) it is ``[Q_r | piece]`` anew."""
    q_rows, rows, tp = plan.q_rows, 2 * plan.head_dim, plan.tp
    src = grad.new_zeros((tp // plan.kv_replicas * rows,) + tuple(grad.shape[1:]))
    src[plan.kv_head * rows: (plan.kv_head + 1) * rows] = grad[q_rows:]
    if pg is None:
        piece = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(src, "sum", tp, plan.group))
        return torch.cat([grad[:q_rows], piece]), None
    piece_rows = rows // plan.kv_replicas
    out = grad[q_rows: q_rows + piece_rows]  # contiguous rows of grad: written in place
    return grad[: q_rows + piece_rows], _reduce_scatter_single(out, src, group=pg, async_op=True)


# --------------------------------------------------------------------------- the eager call


class _HeadParallelFunction(torch.autograd.Function):
    """The eager call of a head-parallel fused block: (hidden_states, qkv_weight, q_norm_weight,
    k_norm_weight, cos, sin, qkv_bias, meta) -> (q, k, v) of this rank's heads.

    The parameters come in as DTensors (their local tensors are read with grad mode off: no
    autograd node per parameter), the fused block runs on the local tensors, and the backward
    does the communication the gradients need and returns the parameters' gradients as
    DTensors with the parameters' specs. ``meta``: ``(plan, pg, eps, norm_after_rope, offset)``
    (``pg``: the TP group, for c10d's collectives)."""

    @staticmethod
    def forward(ctx, hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, qkv_bias, meta):
        plan, pg, eps, norm_after_rope, offset = meta
        w = qkv_weight.to_local()  # grad mode is off inside forward: the local tensor itself
        q_w, k_w = q_norm_weight.to_local(), k_norm_weight.to_local()
        bias = None if qkv_bias is None else qkv_bias.to_local()
        if plan.kv_replicas > 1:
            w = _gather_kv(w, plan, pg)
            bias = None if bias is None else _gather_kv(bias, plan, pg)
        x = _gather_seq(hidden_states, plan, pg) if plan.seq_sharded else hidden_states
        if offset:  # the norms scale by w + offset, formed in fp32 (as gqa_qkv_rope_qk_norm does)
            q_w, k_w = q_w.float() + offset, k_w.float() + offset
        # a shared [1, S, D] cos/sin broadcast over the batch (as gqa_qkv_rope_qk_norm does)
        ctx.cs_batch = (cos.shape[0], sin.shape[0])
        if x.dim() == 3 and cos.dim() == 3 and cos.shape[0] == 1 != x.shape[0]:
            cos = cos.expand(x.shape[0], -1, -1)
        if x.dim() == 3 and sin.dim() == 3 and sin.shape[0] == 1 != x.shape[0]:
            sin = sin.expand(x.shape[0], -1, -1)
        hq, hkv = plan.num_heads, plan.num_kv_heads
        plan_fwd = forward_plan(x, w, q_w, k_w, cos, sin, hq, hkv, eps, _position(norm_after_rope), "auto", bias)
        q, k, qkv, _, _, _ = run_forward(plan_fwd, x, w, q_w, k_w, cos, sin, bias, keep_rstd=False)
        v = heads_of(qkv, hq, hkv, plan.head_dim, False)[2]
        ctx.save_for_backward(x, w, q_w, k_w, cos, sin, qkv)
        ctx.meta = meta
        ctx.specs = (dtensor_spec(qkv_weight), dtensor_spec(q_norm_weight), dtensor_spec(k_norm_weight),
                     None if qkv_bias is None else dtensor_spec(qkv_bias))
        ctx.norm_dtypes = (q_norm_weight.dtype, k_norm_weight.dtype)
        return q, k, v

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_q, grad_k, grad_v):
        x, w, q_w, k_w, cos, sin, qkv = ctx.saved_tensors
        plan, pg, eps, norm_after_rope, _ = ctx.meta
        need = ctx.needs_input_grad
        need_cs = bool(need[4] or need[5])
        g_x, g_w, g_qw, g_kw, g_cos, g_sin, g_b = training_backward(
            grad_q, grad_k, grad_v, x, w, qkv, q_w, k_w, cos, sin, plan.num_heads, plan.num_kv_heads, eps,
            norm_after_rope, bool(need[0]), bool(need[1]), need_cs, "auto", bool(need[6]))
        # the big one first: the hidden-states gradient, summed over the ranks' heads
        if need[0]:
            g_x = _start_reduce_scatter_seq(g_x, plan, pg) if plan.seq_sharded else _start_all_reduce(g_x, plan, pg)
        if plan.kv_replicas > 1:  # the shared KV head's rows: summed into each rank's piece
            g_w = _start_scatter_kv(g_w, plan, pg) if need[1] else None
            g_b = _start_scatter_kv(g_b, plan, pg) if need[6] else None
        else:
            g_w, g_b = (g_w, None), (g_b, None)  # ready
        if need_cs:  # a shared [1, S, D] cos/sin: its gradient summed over the batch first
            g_cos = g_cos if g_cos.shape[0] == ctx.cs_batch[0] else g_cos.sum(0, keepdim=True)
            g_sin = g_sin if g_sin.shape[0] == ctx.cs_batch[1] else g_sin.sum(0, keepdim=True)
        names = [n for n, wanted in zip(("q", "k", "cos", "sin"), need[2:6]) if wanted]
        small = dict(zip(("q", "k", "cos", "sin"), (g_qw, g_kw, g_cos, g_sin)))
        summed = dict(zip(names, _sum([small[n] for n in names], plan, pg)))
        # the parameters' own specs: each gradient has its parameter's layout by construction
        w_spec, q_spec, k_spec, b_spec = ctx.specs
        out_qw = dtensor_from_spec(summed["q"].to(ctx.norm_dtypes[0]), q_spec) if need[2] else None
        out_kw = dtensor_from_spec(summed["k"].to(ctx.norm_dtypes[1]), k_spec) if need[3] else None
        out_cs = [summed.get("cos"), summed.get("sin")]
        return (_wait(g_x) if need[0] else None, dtensor_from_spec(_wait(g_w), w_spec) if need[1] else None,
                out_qw, out_kw, *out_cs, dtensor_from_spec(_wait(g_b), b_spec) if need[6] else None, None)


# --------------------------------------------------------------------------- the composed call


class _HeadParallelCollectives(torch.autograd.Function):
    """(meta, hidden_states, q_norm_weight, k_norm_weight, cos, sin, qkv_weight[, qkv_bias]) as
    local tensors -> what the block's forward on this rank's heads takes: hidden_states
    all-gathered when sequence-sharded, a shared KV head's pieces gathered, the rest as they
    are; the backward sums over the TP group what each rank computed for its own heads only:
    the hidden-states, norm-weight and cos/sin gradients and a shared KV head's rows. ``meta``:
    ``(plan, seq_sharded)``. Used around the block's own forward under torch.compile (traced),
    autocast, DTensor inputs, and for the plain-PyTorch block."""

    @staticmethod
    def forward(ctx, meta, hidden_states, q_norm_weight, k_norm_weight, cos, sin, qkv_weight, *qkv_bias):
        plan, seq_sharded = meta
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        x = _gather_seq(hidden_states, plan, None) if seq_sharded else hidden_states.view_as(hidden_states)
        rows = tuple(_gather_kv(t, plan, None) if plan.kv_replicas > 1 else t.view_as(t)
                     for t in (qkv_weight, *qkv_bias))
        return (x,) + tuple(t.view_as(t) for t in (q_norm_weight, k_norm_weight, cos, sin)) + rows

    @staticmethod
    def backward(ctx, g_x, g_qw, g_kw, g_cos, g_sin, g_w, *g_b):
        plan, seq_sharded = ctx.meta
        need = ctx.needs_input_grad
        if need[1] and g_x is not None:
            g_x = (_start_reduce_scatter_seq(g_x, plan, None) if seq_sharded
                   else _start_all_reduce(g_x, plan, None))
        else:
            g_x = None
        small = [g_qw, g_kw, g_cos, g_sin]
        where = [i for i, (g, wanted) in enumerate(zip(small, need[2:6])) if wanted and g is not None]
        for i, s in zip(where, _sum([small[i] for i in where], plan, None)):
            small[i] = s
        rows = [g_w, *g_b]
        if plan.kv_replicas > 1:
            rows = [None if g is None else _wait(_start_scatter_kv(g, plan, None)) for g in rows]
        return (None, None if g_x is None else _wait(g_x), *small, *rows)


def _replicated_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor input as the whole tensor on this rank; its gradient (which the collectives
    sum) goes back through DTensor to the input's own layout."""
    if t.placements != (Replicate(),):
        t = t.redistribute(placements=[Replicate()])
    return t.to_local()


class _HeadParallelForward:
    """Mixed into a parallelized block's class: the forward on the local heads."""

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        plan = self._head_parallel
        if (self._fused_local and type(hidden_states) is torch.Tensor and type(cos) is torch.Tensor
                and type(sin) is torch.Tensor and not torch.compiler.is_compiling()
                and not _autocast_enabled(hidden_states)):
            q, k, v = _HeadParallelFunction.apply(
                hidden_states, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin, self.qkv_bias,
                (plan, self._head_parallel_group, self.eps, self.norm_after_rope, self.norm_weight_offset))
        else:
            q, k, v = self._composed_forward(plan, hidden_states, cos, sin)
        if self.tp_use_local_output:
            return q, k, v
        # [B, H, S, D] with this rank's heads: the global tensor sharded on the head dim
        return tuple(DTensor.from_local(t, self.tp_mesh, [Shard(1)], run_check=False) for t in (q, k, v))

    def _composed_forward(self, plan, hidden_states, cos, sin):
        seq_sharded = plan.seq_sharded
        if isinstance(hidden_states, DTensor):
            hidden_states, seq_sharded = _replicated_local(hidden_states), False
        if isinstance(cos, DTensor):
            cos = _replicated_local(cos)
        if isinstance(sin, DTensor):
            sin = _replicated_local(sin)
        bias = () if self.qkv_bias is None else (self.qkv_bias.to_local(),)
        x, q_w, k_w, cos, sin, w, *bias = _HeadParallelCollectives.apply(
            (plan, seq_sharded), hidden_states, self.q_norm_weight.to_local(), self.k_norm_weight.to_local(), cos,
            sin, self.qkv_weight.to_local(), *bias)
        return self._local_forward(x, w, q_w, k_w, cos, sin, bias[0] if bias else None)


def _autocast_enabled(t: torch.Tensor) -> bool:
    dev = t.device.type
    return dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)


class HeadParallelGQAQKVRoPEQKNorm(_HeadParallelForward, GQAQKVRoPEQKNorm):
    """The class of a ``GQAQKVRoPEQKNorm`` after ``HeadParallelQKV`` (swapped in place, as
    FSDP2 does): the fused op on the local shard with the local head counts."""

    _fused_local = True

    def _local_forward(self, x, w, q_w, k_w, cos, sin, bias):
        plan = self._head_parallel
        return gqa_qkv_rope_qk_norm(x, w, q_w, k_w, cos, sin, num_heads=plan.num_heads,
                                    num_kv_heads=plan.num_kv_heads, eps=self.eps,
                                    qk_norm_position=self.qk_norm_position, qkv_bias=bias,
                                    norm_weight_offset=self.norm_weight_offset)


class HeadParallelReferenceGQAQKVRoPEQKNorm(_HeadParallelForward, ReferenceGQAQKVRoPEQKNorm):
    """The class of a ``ReferenceGQAQKVRoPEQKNorm`` after ``HeadParallelQKV``."""

    _fused_local = False

    def _local_forward(self, x, w, q_w, k_w, cos, sin, bias):
        plan = self._head_parallel
        return reference_block(x, w, q_w, k_w, cos, sin, plan.num_heads, plan.num_kv_heads, self.eps,
                               self.norm_after_rope, bias, self.norm_weight_offset)


# the block classes whose forward the head-parallel forward reproduces on local tensors
_PARALLEL_CLASSES = {GQAQKVRoPEQKNorm: HeadParallelGQAQKVRoPEQKNorm,
                     ReferenceGQAQKVRoPEQKNorm: HeadParallelReferenceGQAQKVRoPEQKNorm}


# --------------------------------------------------------------------------- state dict in [Q | K | V]


def _state_dict_canonical(module, state_dict, prefix, local_metadata) -> None:
    for name in _ROW_PARAMS:
        key = prefix + name
        w = state_dict.get(key)
        if not isinstance(w, DTensor):
            continue
        full = to_canonical_rows(w.detach().full_tensor(), module.num_heads, module.num_kv_heads, module.tp_size)
        # same mesh and placements as the parameter, over the [Q | K | V] global tensor
        state_dict[key] = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None)


def _load_state_dict_from_canonical(module, state_dict, prefix, *args) -> None:
    """Incoming values are the [Q | K | V] weight and bias (a plain full tensor or a DTensor of
    any placement) and the norm weights (plain or DTensor): turn them into DTensors like the
    parameters."""
    for name in _BLOCK_PARAMS + ("qkv_bias",):
        key = prefix + name
        if key not in state_dict:
            continue
        src, param = state_dict[key], getattr(module, name)
        if not isinstance(param, DTensor) or not isinstance(src, torch.Tensor):
            continue
        value = src.full_tensor() if isinstance(src, DTensor) else src
        if tuple(value.shape) != tuple(param.shape):  # (the TP row order is a permutation: same shape)
            continue  # the default loader reports the shape mismatch
        value = value.detach().to(device=param.device)
        if name in _ROW_PARAMS:
            value = to_tp_rows(value, module.num_heads, module.num_kv_heads, module.tp_size)
        state_dict[key] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


# --------------------------------------------------------------------------- the style


class HeadParallelQKV(ParallelStyle):
    """Head-parallel (column-parallel) ``ParallelStyle`` for ``fusedqkv.GQAQKVRoPEQKNorm`` (and
    ``fusedqkv.ReferenceGQAQKVRoPEQKNorm``), for ``parallelize_module`` on a 1-D TP mesh.

    Keyword Args:
        input_layouts: how a plain-tensor ``hidden_states`` is laid out over the TP group:
            ``Replicate()`` (default; every rank has the whole batch) or ``Shard(1)``
            (sequence parallel, equal shards: all-gathered in the forward, its gradient
            reduce-scattered). A DTensor ``hidden_states`` is redistributed to ``Replicate()``
            whatever this says.
        use_local_output: return ``(q, k, v)`` as plain tensors of this rank's heads,
            ``[B, Hq/tp, S, D]`` / ``[B, Hkv/tp or 1, S, D]`` (default), or as DTensors
            ``Shard(1)`` of ``[B, H, S, D]`` (with replicated KV heads, k/v's global tensor
            holds each KV head once per rank that has it).

    ``num_heads`` must be divisible by ``tp``, and ``num_kv_heads`` divisible by ``tp`` or a
    divisor of it (then each KV head is replicated on ``tp/num_kv_heads`` ranks). The
    parameters become DTensors: ``qkv_weight`` (and ``qkv_bias``) ``Shard(0)`` in the TP row
    order, ``q_norm_weight``/``k_norm_weight`` ``Replicate()`` (their gradients all-reduced).
    The module keeps its global ``num_heads``/``num_kv_heads`` and gains ``tp_mesh``,
    ``tp_size``, ``local_num_heads``, ``local_num_kv_heads`` and ``tp_kv_replicas``. See
    :mod:`fusedqkv.distributed`.
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
        if getattr(module, "fp8", None) is not None:
            raise NotImplementedError(f"HeadParallelQKV: {base.__name__} has fp8={module.fp8.key!r}; the head-parallel "
                                      "plan runs bf16 GEMMs only (FP8 with tensor parallelism is not built)")
        plain = dict(q_gate=False, rope_style="neox", norm_scope="head", v_norm=False)
        variant = {k: v for k, v in module._variant_kwargs().items() if v != plain[k]}
        if module.q_norm_weight is None:
            variant["norm_weight"] = False
        if variant:  # (the plan shards plain heads: issue 25's variants not yet)
            raise NotImplementedError(f"HeadParallelQKV: the block's variants {variant} are not head-parallel; "
                                      "expected a block with the default q_gate, rope_style, norm_scope, norm_weight "
                                      "and v_norm")
        names = tuple(n for n, _ in module.named_parameters())
        expected = _BLOCK_PARAMS + (() if module.qkv_bias is None else ("qkv_bias",))
        if sorted(names) != sorted(expected) or list(module.children()):
            raise NotImplementedError(f"HeadParallelQKV: expected exactly the parameters {expected}, got {names}")
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise ValueError("device_mesh: expected a 1-D tensor-parallel DeviceMesh (pass mesh['tp'] of a "
                             f"multi-dimensional mesh), got {device_mesh!r}")
        tp = device_mesh.size()
        hq, hkv = module.num_heads, module.num_kv_heads
        require_tp_divisible(hq, hkv, tp, module.head_dim)
        for n in expected:
            p = getattr(module, n)
            if isinstance(p, DTensor):
                raise ValueError(f"module.{n}: already a DTensor; apply HeadParallelQKV to a block with plain "
                                 "parameters (before fully_shard)")
            if p.device.type != device_mesh.device_type and p.device.type != "meta":
                raise ValueError(f"module.{n}: on {p.device}, but device_mesh is a {device_mesh.device_type} mesh; "
                                 "move the block to the mesh's device first")

        src = getattr(self, "src_data_rank", 0)  # rank 0's values become the parameters of every rank, as in ColwiseParallel
        for n in expected:
            p = getattr(module, n)
            if n in _ROW_PARAMS:
                value, placement = to_tp_rows(p.detach(), hq, hkv, tp), Shard(0)
            else:
                value, placement = p.detach(), Replicate()
            module.register_parameter(n, nn.Parameter(
                distribute_tensor(value, device_mesh, [placement], src_data_rank=src), requires_grad=p.requires_grad))

        rep = kv_replicas(hkv, tp)
        rank = device_mesh.get_local_rank()
        module.tp_mesh = device_mesh
        module.tp_size = tp
        module.tp_use_local_output = self.use_local_output
        module.local_num_heads = hq // tp
        module.local_num_kv_heads = hkv // tp if rep == 1 else 1
        module.tp_kv_replicas = rep
        module._head_parallel = _HeadParallelPlan(
            group=device_mesh.get_group().group_name, tp=tp, seq_sharded=isinstance(self.input_layouts, Shard),
            num_heads=module.local_num_heads, num_kv_heads=module.local_num_kv_heads, head_dim=module.head_dim,
            kv_replicas=rep, kv_head=rank // rep)
        module._head_parallel_group = device_mesh.get_group()
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
