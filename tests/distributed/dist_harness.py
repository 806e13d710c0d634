"""Checks of the GQA input block under DDP, FSDP2 and head (tensor) parallelism, run on every
rank of an initialised process group of 2 (or more) ranks: gloo on the CPU
(tests/distributed/test_dist_gloo.py), NCCL under torchrun (test_dist_torchrun.py,
benchmarks/bench_distributed.py).

Each check builds the same tiny attention layer (the block, head-parallel SDPA, an output
projection, a residual) on every rank from one seed, runs it distributed, and compares with
the single-process run of the whole batch that every rank also computes itself:

* gradients of one step (every parameter, and the input) -- ||dist - single|| / ||single||;
* a ``steps``-step SGD loss curve -- max over steps of |dist - single| / |single|.

Errors are maxima over ranks (all-reduced), so every rank sees the same verdict.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import checkpoint

import fusedqkv
from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm
from fusedqkv import distributed as fdist


@dataclass(frozen=True)
class Sizes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    seq: int
    lr: float  # SGD learning rate of the loss curves (the loss falls by about half in 20 steps)


TINY = Sizes(hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, batch=4, seq=8, lr=1.0)
GPU = Sizes(hidden=1024, num_heads=16, num_kv_heads=4, head_dim=64, batch=4, seq=256, lr=5.0)

# ||dist - single|| / ||single|| for gradients; max relative loss difference over the curve.
# fp32 on the GPU: cuBLAS picks other GEMM kernels for half the batch
TOLERANCES = {("cpu", torch.float32): dict(grad=1e-5, loss=1e-5),
              ("cuda", torch.float32): dict(grad=1e-4, loss=1e-4),
              ("cpu", torch.bfloat16): dict(grad=2e-2, loss=2e-2),
              ("cuda", torch.bfloat16): dict(grad=2e-2, loss=2e-2)}

STEPS = 20


# --------------------------------------------------------------------------- the model


class FunctionalBlock(nn.Module):
    """The block's parameters, used through the functional API ``fusedqkv.gqa_qkv_rope_qk_norm``."""

    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, qk_norm_position):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.qk_norm_position = num_heads, num_kv_heads, qk_norm_position
        self.qkv_weight = nn.Parameter(torch.empty((num_heads + 2 * num_kv_heads) * head_dim, hidden))
        self.q_norm_weight = nn.Parameter(torch.empty(head_dim))
        self.k_norm_weight = nn.Parameter(torch.empty(head_dim))

    def forward(self, x, cos, sin):
        return fusedqkv.gqa_qkv_rope_qk_norm(x, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, cos, sin,
                                             num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                             qk_norm_position=self.qk_norm_position)


BLOCKS = {"fused": GQAQKVRoPEQKNorm, "reference": ReferenceGQAQKVRoPEQKNorm, "functional": FunctionalBlock}


class AttentionLayer(nn.Module):
    """x + o_proj(causal SDPA(block(x))): the block, attention over whatever heads it returns
    (all, or this rank's under head parallelism) and the output projection."""

    def __init__(self, sz: Sizes, block: str = "fused", qk_norm_position: str = "after_rope",
                 activation_checkpointing: bool = False, autocast_dtype=None, **block_options):
        super().__init__()
        self.autocast_dtype = autocast_dtype
        # block_options: the block's bias / norm_weight_offset (fused and reference blocks)
        self.block = BLOCKS[block](sz.hidden, sz.num_heads, sz.num_kv_heads, sz.head_dim,
                                   qk_norm_position=qk_norm_position, **block_options)
        self.o_proj = nn.Linear(sz.num_heads * sz.head_dim, sz.hidden, bias=False)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x, cos, sin):
        if self.autocast_dtype is not None:
            with torch.autocast(x.device.type, dtype=self.autocast_dtype):
                return self._forward(x, cos, sin)
        return self._forward(x, cos, sin)

    def _forward(self, x, cos, sin):
        if self.activation_checkpointing:
            q, k, v = checkpoint(self.block, x, cos, sin, use_reentrant=False)
        else:
            q, k, v = self.block(x, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, _, s, _ = a.shape
        return x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))


def make_layer(sz: Sizes, device, dtype=torch.float32, seed=0, **kw) -> AttentionLayer:
    """The same parameters on every rank and in every run: generated on the CPU in fp32 from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AttentionLayer(sz, **kw)
        with torch.no_grad():
            nn.init.normal_(m.block.qkv_weight, std=1.0 / math.sqrt(sz.hidden))
            # effective norm scales in [0.5, 1.5] (with an offset: weight + offset)
            offset = kw.get("norm_weight_offset", 0.0)
            m.block.q_norm_weight.uniform_(0.5, 1.5).sub_(offset)
            m.block.k_norm_weight.uniform_(0.5, 1.5).sub_(offset)
            nn.init.normal_(m.o_proj.weight, std=1.0 / math.sqrt(sz.num_heads * sz.head_dim))
    return m.to(device=device, dtype=dtype)


def make_batch(sz: Sizes, device, dtype=torch.float32, seed=1):
    """hidden_states, cos, sin (HF rotary, NeoX rotate-half), all [B, S, *] in ``dtype``, and
    the regression target: the output of a teacher layer (plain-PyTorch block, another seed,
    fp32), so that training can drive the loss down."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sz.batch, sz.seq, sz.hidden, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, sz.head_dim, 2, dtype=torch.float64) / sz.head_dim))
    pos = torch.arange(sz.seq, dtype=torch.float64)[None, :].expand(sz.batch, sz.seq)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    with torch.no_grad():
        target = make_layer(sz, "cpu", seed=seed + 10, block="reference")(x, cos, sin)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, cos, sin)) + (target.to(device),)


def loss_fn(out, target):
    return (out.float() - target.float()).pow(2).mean()


# --------------------------------------------------------------------------- helpers


def world():
    return dist.get_rank(), dist.get_world_size()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def max_over_ranks(values: dict) -> dict:
    """Every rank gets the maximum over ranks of each value (so all ranks agree on pass/fail)."""
    names = sorted(values)
    t = torch.tensor([float(values[n]) for n in names], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.cpu().tolist()))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def named_grads(model: nn.Module, tp_block=None) -> dict:
    """name -> full gradient, the qkv_weight's in the [Q | K | V] row order."""
    out = {}
    for n, p in model.named_parameters():
        g = full(p.grad)
        if tp_block is not None and n.endswith(("qkv_weight", "qkv_bias")):
            g = fdist.to_canonical_rows(g, tp_block.num_heads, tp_block.num_kv_heads, tp_block.tp_size)
        out[n.removeprefix("module.")] = g
    return out


def train(run, owner, x, cos, sin, target, lr, steps=STEPS, *, average=False, master=None, tp_block=None,
          grads_fn=None):
    """``steps`` SGD steps of ``run`` (the model, or its DDP / torch.compile wrapper; ``owner``
    holds the parameters) on (x, cos, sin, target). Returns the loss curve and the gradients
    of the first step (``named_grads`` plus ``"input"``, x's gradient).

    ``average``: the loss of each step averaged over the ranks (data parallel, where each rank
    has its part of the batch). ``master``: an fp32 copy of ``owner``'s parameters for mixed
    precision as FSDP2 does it -- compute in ``owner``'s dtype, fp32 gradients and update on
    the master, cast back. ``grads_fn(owner, tp_block)`` replaces ``named_grads``."""
    opt = torch.optim.SGD((master or owner).parameters(), lr=lr)
    losses, first = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        owner.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        loss = loss_fn(run(xx, cos, sin), target)
        loss.backward()
        if step == 0:
            first = (grads_fn or named_grads)(owner, tp_block)
            first["input"] = xx.grad
        if master is not None:
            for pm, pw in zip(master.parameters(), owner.parameters()):
                pm.grad = pw.grad.float()
        opt.step()
        if master is not None:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), owner.parameters()):
                    pw.copy_(pm)
        l = loss.detach().float().clone()
        if average:
            dist.all_reduce(l, op=dist.ReduceOp.SUM)
            l /= dist.get_world_size()
        losses.append(float(l))
    return losses, first


def curve_err(a, ref) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, ref))


def local_batch(t, rank, ws):
    return t.chunk(ws, dim=0)[rank]


def verdict(name, grads: dict, losses=None, ref_losses=None, tol=None, extra=None) -> dict:
    """The result of one check: errors (max over ranks) against the tolerances."""
    errs = {f"grad:{k}": v for k, v in grads.items()}
    if losses is not None:
        errs["loss_curve"] = curve_err(losses, ref_losses)
    errs.update(extra or {})
    errs = max_over_ranks(errs)
    ok = all(v <= (tol["loss"] if k == "loss_curve" else tol["grad"]) for k, v in errs.items()
             if k.startswith(("grad:", "loss_curve")))
    res = dict(check=name, ok=ok, errors=errs, tolerances=tol)
    if losses is not None:
        res.update(losses=losses, single_losses=ref_losses,
                   # training must move: the curve has to be a curve
                   decreased=ref_losses[-1] < 0.7 * ref_losses[0])
        res["ok"] = res["ok"] and res["decreased"]
    return res


# --------------------------------------------------------------------------- checks


def _compiled(model, backend):
    """torch.compile(model) (or the model itself without a backend), dynamo's counters reset."""
    if not backend:
        return model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch.compile(model, backend=backend)


def _compile_stats(backend) -> dict:
    """What dynamo compiled (graphs) and where it broke the graph; a check requires >= 1 graph."""
    if not backend:
        return {}
    c = torch._dynamo.utils.counters
    return dict(graphs=int(c["stats"]["unique_graphs"]), graph_breaks=int(sum(c["graph_break"].values())),
                break_reasons=sorted({r.splitlines()[0][:160] for r in c["graph_break"]}))


def _grad_errors(got: dict, ref: dict, rank: int, ws: int, data_parallel: bool) -> dict:
    errs = {n: rel_err(got[n], ref[n]) for n in got if n != "input"}
    if data_parallel:  # d(mean over ranks of local means)/dx = (1/ws) d(local mean)/dx
        errs["input"] = rel_err(got["input"] / ws, local_batch(ref["input"], rank, ws))
    else:
        errs["input"] = rel_err(got["input"], ref["input"])
    return errs


def check_ddp(sz, device, dtype, block="fused", activation_checkpointing=False, autocast_dtype=None, steps=STEPS):
    """DDP: half of the batch per rank (2 ranks); gradients averaged = whole-batch gradients.
    ``autocast_dtype``: fp32 parameters, the layer under torch.autocast (DDP's usual mixed precision)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, ws = world()
    tol = TOLERANCES[device.type, autocast_dtype or dtype]
    kw = dict(block=block, autocast_dtype=autocast_dtype)
    x, cos, sin, target = make_batch(sz, device, dtype)
    single = make_layer(sz, device, dtype, **kw)
    ref_losses, ref = train(single, single, x, cos, sin, target, sz.lr, steps)
    model = make_layer(sz, device, dtype, activation_checkpointing=activation_checkpointing, **kw)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    xl, cl, sl, tl = (local_batch(t, rank, ws) for t in (x, cos, sin, target))
    losses, got = train(ddp, model, xl, cl, sl, tl, sz.lr, steps, average=True)
    tags = [block] + (["ac"] if activation_checkpointing else []) + (
        [f"autocast={str(autocast_dtype).removeprefix('torch.')}"] if autocast_dtype else [])
    return verdict(f"ddp[{','.join(tags)}]", _grad_errors(got, ref, rank, ws, True), losses, ref_losses, tol)


def _fsdp(model, mp_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
          if mp_dtype not in (None, torch.float32) else MixedPrecisionPolicy())
    fully_shard(model.block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def check_fsdp(sz, device, mp_dtype=None, block="fused", activation_checkpointing=False, compile_backend=None,
               steps=STEPS):
    """FSDP2 (fully_shard on the block and the layer), fp32 parameters; with ``mp_dtype`` mixed
    precision: compute in mp_dtype, fp32 gradient reduction. Half of the batch per rank.
    ``compile_backend``: torch.compile the FSDP2-wrapped layer."""
    rank, ws = world()
    dtype = mp_dtype or torch.float32
    tol = TOLERANCES[device.type, dtype]
    # inputs in fp32: FSDP2 casts the layer's inputs (x, cos, sin) to the compute dtype
    x, cos, sin, target = make_batch(sz, device, torch.float32)
    single = make_layer(sz, device, dtype, block=block)
    master = make_layer(sz, device, torch.float32, block=block) if dtype != torch.float32 else None
    ref_losses, ref = train(single, single, x.to(dtype), cos.to(dtype), sin.to(dtype), target, sz.lr, steps,
                            master=master)
    model = _fsdp(make_layer(sz, device, torch.float32, block=block,
                             activation_checkpointing=activation_checkpointing), mp_dtype)
    run = _compiled(model, compile_backend)
    xl, cl, sl, tl = (local_batch(t, rank, ws) for t in (x, cos, sin, target))
    losses, got = train(run, model, xl, cl, sl, tl, sz.lr, steps, average=True)
    tags = [block] + (["ac"] if activation_checkpointing else []) + (
        [f"mp={str(mp_dtype).removeprefix('torch.')}"] if mp_dtype else []) + (
        [f"compile={compile_backend}"] if compile_backend else [])
    return _with_compile_stats(verdict(f"fsdp2[{','.join(tags)}]", _grad_errors(got, ref, rank, ws, True), losses,
                                       ref_losses, tol), compile_backend)


def _with_compile_stats(res, backend):
    if backend:
        res["compile"] = stats = _compile_stats(backend)
        res["ok"] = res["ok"] and stats["graphs"] >= 1
    return res


def tp_parallelize(model, mesh):
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    plan = {**fdist.tp_plan(model), "o_proj": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _options(bias=False, offset=0.0) -> dict:
    """The block's options (the default block: none)."""
    return (dict(bias=True) if bias else {}) | (dict(norm_weight_offset=offset) if offset else {})


def _tags(kv_heads=None, bias=False, offset=0.0) -> list:
    return ([f"kv_heads={kv_heads}"] if kv_heads else []) + (["bias"] if bias else []) + (
        [f"offset={offset:g}"] if offset else [])


def check_tp(sz, device, dtype, block="fused", compile_backend=None, steps=STEPS, qk_norm_position="after_rope",
             kv_heads=None, bias=False, offset=0.0):
    """Head parallel: HeadParallelQKV on the block, RowwiseParallel on o_proj, every rank the
    whole batch; gradients (qkv_weight's and qkv_bias's in [Q | K | V] order; the input's
    all-reduced), the loss curve and the trained parameters equal the single process's.
    ``kv_heads``: the block's KV heads (fewer than ranks: shared by tp/kv_heads ranks);
    ``bias``/``offset``: the block's qkv_bias and norm_weight_offset."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    if kv_heads:
        sz = replace(sz, num_kv_heads=kv_heads)
    mesh = init_device_mesh(device.type, (ws,))
    x, cos, sin, target = make_batch(sz, device, dtype)
    kw = dict(block=block, qk_norm_position=qk_norm_position, **_options(bias, offset))
    single = make_layer(sz, device, dtype, **kw)
    ref_losses, ref = train(single, single, x, cos, sin, target, sz.lr, steps)
    model = tp_parallelize(make_layer(sz, device, dtype, **kw), mesh)
    run = _compiled(model, compile_backend)
    # the norm weights' first gradients: Replicate DTensors (all-reduced in the backward, not Partial)
    placements = {}

    def grads_and_norm_placements(owner, tp_block):
        out = named_grads(owner, tp_block)
        for n in ("q_norm_weight", "k_norm_weight"):
            g = getattr(owner.block, n).grad
            placements[n] = tuple(g.placements)
            out[f"local:{n}"] = g.to_local()
        return out

    losses, got = train(run, model, x, cos, sin, target, sz.lr, steps, tp_block=model.block, grads_fn=grads_and_norm_placements)
    for n in ("q_norm_weight", "k_norm_weight"):
        ref[f"local:{n}"] = ref[f"block.{n}"]
    errs = _grad_errors(got, ref, rank, ws, False)
    extra = {f"norm_grad_not_replicated:{n}": float(p != (Replicate(),)) for n, p in placements.items()}
    # after the steps: the parameters equal the single process's (the global DTensors are the
    # [Q | K | V] weight permuted: same shape, every element once)
    for n, p in model.block.named_parameters():
        mine = full(p.detach())
        if n in ("qkv_weight", "qkv_bias"):
            extra[f"global_shape_not_canonical:{n}"] = float(mine.shape != getattr(single.block, n).shape)
            mine = fdist.to_canonical_rows(mine, sz.num_heads, sz.num_kv_heads, ws)
        errs[f"trained:{n}"] = rel_err(mine, getattr(single.block, n))
    # every rank computed the same loss (o_proj's all-reduce): the curves' spread is 0
    lo = torch.tensor(losses, dtype=torch.float64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    extra["rank_loss_spread"] = float((hi - lo).abs().max())
    tags = [block] + ([qk_norm_position] if qk_norm_position != "after_rope" else []) + _tags(
        kv_heads, bias, offset) + ([f"compile={compile_backend}"] if compile_backend else [])
    res = verdict(f"tp{ws}[{','.join(tags)}]", errs, losses, ref_losses, tol, extra)
    res["ok"] = res["ok"] and res["errors"]["rank_loss_spread"] <= tol["loss"] and not any(
        v for k, v in res["errors"].items() if k.startswith(("norm_grad_not_replicated", "global_shape_not")))
    if bias:  # the bias's gradient was compared
        res["ok"] = res["ok"] and "grad:block.qkv_bias" in res["errors"]
    return _with_compile_stats(res, compile_backend)


def check_fsdp_tp(sz, device, dtype, steps=STEPS, kv_heads=None, bias=False, offset=0.0):
    """2-D: FSDP2 over "dp" on top of HeadParallelQKV/RowwiseParallel over "tp" (4 ranks, 2 x 2):
    the qkv_weight becomes (_StridedShard(0), Shard(0)); half of the batch per dp rank.
    ``kv_heads``/``bias``/``offset``: the block's options (see check_tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    if kv_heads:
        sz = replace(sz, num_kv_heads=kv_heads)
    kw = _options(bias, offset)
    mesh = init_device_mesh(device.type, (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, ndp = mesh["dp"].get_local_rank(), ws // 2
    x, cos, sin, target = make_batch(sz, device, dtype)
    single = make_layer(sz, device, dtype, **kw)
    ref_losses, ref = train(single, single, x, cos, sin, target, sz.lr, steps)
    model = tp_parallelize(make_layer(sz, device, dtype, **kw), mesh["tp"])
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    extra = {"state_dict_qkv_weight": rel_err(full(model.state_dict()["block.qkv_weight"]),
                                              make_layer(sz, device, dtype, **kw).block.qkv_weight)}
    xl, cl, sl, tl = (local_batch(t, dp, ndp) for t in (x, cos, sin, target))
    # the loss of a dp rank's half batch (equal on its tp ranks), averaged over all ranks
    losses, got = train(model, model, xl, cl, sl, tl, sz.lr, steps, average=True, tp_block=model.block)
    res = verdict(f"fsdp2x{ndp}+tp2[{','.join(['fused'] + _tags(kv_heads, bias, offset))}]",
                  _grad_errors(got, ref, dp, ndp, True), losses, ref_losses, tol, extra)
    res["ok"] = res["ok"] and res["errors"]["state_dict_qkv_weight"] == 0.0
    return res


def _local_head_slices(block, rank):
    """(this rank's query heads, its KV heads, whether it is the first rank using them)."""
    hq, tp, rep = block.local_num_heads, block.tp_size, block.tp_kv_replicas
    hkv = block.local_num_kv_heads
    kv0 = rank * hkv if rep == 1 else rank // rep
    return slice(rank * hq, (rank + 1) * hq), slice(kv0, kv0 + hkv), rank % rep == 0


LAYOUTS = ("replicated", "seq-sharded", "dtensor-input")


def check_tp_block_layouts(sz, device, dtype, layouts=LAYOUTS, kv_heads=None, bias=False, offset=0.0,
                           compile_backend=None):
    """The block alone (norm before RoPE) under HeadParallelQKV, DTensor outputs, for each input
    layout: hidden_states replicated, sequence-sharded (``input_layouts=Shard(1)``) and a
    ``Shard(1)`` DTensor. Each rank's q/k/v equal its heads of the single block's; the input
    gradient is all-reduced (reduce-scattered); every parameter's gradient equals the single
    block's. With KV heads shared by ranks the first rank using a KV head takes its output
    gradient and the others zero, so the single block's gradient is their sum.
    ``compile_backend``: the parallelized block under torch.compile, also compared with the
    same block run eagerly."""
    from torch.distributed.device_mesh import init_device_mesh
    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    if kv_heads:
        sz = replace(sz, num_kv_heads=kv_heads)
    mesh = init_device_mesh(device.type, (ws,))
    x, cos, sin, _ = make_batch(sz, device, dtype)
    kw = dict(qk_norm_position="before_rope", **_options(bias, offset))
    single = make_layer(sz, device, dtype, **kw).block
    xs = x.detach().clone().requires_grad_()
    # cos/sin require grad too (their gradient: each rank's heads' part, summed over the group)
    cos_s, sin_s = cos.detach().clone().requires_grad_(), sin.detach().clone().requires_grad_()
    out_ref = single(xs, cos_s, sin_s)
    g = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(o.shape, generator=g).to(device=device, dtype=dtype) for o in out_ref]
    torch.autograd.backward(out_ref, grads_out)
    errs, stats = {}, {}

    def run(layout, compiled):
        seq = layout == "seq-sharded"
        block = fdist.parallelize_block(make_layer(sz, device, dtype, **kw).block, mesh,
                                        input_layouts=Shard(1) if seq else None, use_local_output=False)
        fn = _compiled(block, compile_backend) if compiled else block
        if layout == "replicated":
            xl = x.detach().clone().requires_grad_()
            xin = xl
        else:
            xl = local_batch(x.transpose(0, 1), rank, ws).transpose(0, 1).detach().clone().requires_grad_()
            xin = DTensor.from_local(xl, mesh, [Shard(1)], run_check=False) if layout == "dtensor-input" else xl
        # the sequence-sharded call takes one [1, S, D] cos/sin for the batch (equal rows here)
        cs = [(t[:1] if seq else t).detach().clone().requires_grad_() for t in (cos, sin)]
        out = fn(xin, *cs)
        qh, kvh, first = _local_head_slices(block, rank)
        heads = (qh, kvh, kvh)
        gl = [gg[:, h] if (i == 0 or first) else torch.zeros_like(gg[:, h]) for i, (gg, h) in
              enumerate(zip(grads_out, heads))]
        torch.autograd.backward([o.to_local() for o in out], gl)
        got = {f"out:{n}": o.to_local() for n, o in zip("qkv", out)}
        got["input"] = xl.grad
        got["cos"], got["sin"] = (t.grad for t in cs)
        for n, p in block.named_parameters():
            gp = full(p.grad)
            if n in ("qkv_weight", "qkv_bias"):
                gp = fdist.to_canonical_rows(gp, block.num_heads, block.num_kv_heads, ws)
            got[f"grad:{n}"] = gp
        placements = [tuple(o.placements) for o in out]
        return got, heads, placements

    for layout in layouts:
        got, heads, placements = run(layout, False)
        for n, r, h, pl in zip("qkv", out_ref, heads, placements):
            errs[f"{layout}:out:{n}"] = rel_err(got[f"out:{n}"], r[:, h])
            errs[f"{layout}:placement:{n}"] = float(pl != (Shard(1),))
        ref_in = xs.grad if layout == "replicated" else xs.grad.chunk(ws, dim=1)[rank]
        errs[f"{layout}:input"] = rel_err(got["input"], ref_in)
        for n, t in (("cos", cos_s), ("sin", sin_s)):
            errs[f"{layout}:grad:{n}"] = rel_err(got[n], t.grad.sum(0, keepdim=True) if layout == "seq-sharded"
                                                  else t.grad)
        for n, _ in single.named_parameters():
            errs[f"{layout}:grad:{n}"] = rel_err(got[f"grad:{n}"], getattr(single, n).grad)
        if compile_backend:
            got_c, _, _ = run(layout, True)
            stats[layout] = _compile_stats(compile_backend)
            for k, v in got_c.items():
                errs[f"{layout}:compiled_vs_eager:{k}"] = rel_err(v, got[k])
    errs = max_over_ranks(errs)
    ok = all(v <= tol["grad"] for k, v in errs.items() if ":placement:" not in k) and not any(
        v for k, v in errs.items() if ":placement:" in k)
    tags = ["block", "before_rope", "/".join(layouts), "DTensor outputs"] + _tags(kv_heads, bias, offset) + (
        [f"compile={compile_backend}"] if compile_backend else [])
    res = dict(check=f"tp{ws}[{','.join(tags)}]", ok=ok, errors=errs, tolerances=tol)
    if compile_backend:
        res["compile"] = stats
        res["ok"] = ok and all(st["graphs"] >= 1 for st in stats.values())
    return res


def check_tp_state_dict(sz, device, tmpdir=None, kv_heads=None, bias=False):
    """state_dict/load_state_dict of a head-parallel block are in the [Q | K | V] order;
    full_qkv_weight; the local shard is [Q_r | K_r | V_r]; torch.distributed.checkpoint's
    state-dict functions; a block parallelized on the meta device; a DCP checkpoint of the
    head-parallel layer loads into an unsharded layer (and back). ``kv_heads``/``bias``: the
    same with KV heads shared by ranks (each storing a piece of their rows) and the qkv_bias."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    rank, ws = world()
    if kv_heads:
        sz = replace(sz, num_kv_heads=kv_heads)
    opts = _options(bias)
    mesh = init_device_mesh(device.type, (ws,))
    plain = make_layer(sz, device, seed=3, **opts)
    model = tp_parallelize(make_layer(sz, device, seed=3, **opts), mesh)
    b, hq, hkv, d = model.block, sz.num_heads, sz.num_kv_heads, sz.head_dim
    qh, kvh, _ = _local_head_slices(b, rank)
    rep = b.tp_kv_replicas
    errs = {
        "class_not_head_parallel": float(type(b) is not fdist.HeadParallelGQAQKVRoPEQKNorm),
        "full_qkv_weight": rel_err(fdist.full_qkv_weight(b), plain.block.qkv_weight),
    }
    row_params = ["qkv_weight"] + (["qkv_bias"] if bias else [])
    for n in row_params:
        w = getattr(plain.block, n).detach()
        q, k, v = w.unflatten(0, (hq + 2 * hkv, d)).split([hq, hkv, hkv])
        kv = torch.cat([k[kvh], v[kvh]]).flatten(0, 1)  # [K_r | V_r]; shared KV head: its piece r % rep
        expect_local = torch.cat([q[qh].flatten(0, 1), kv.chunk(rep)[rank % rep]])
        errs[f"local_shard_is_Qr_Kr_Vr:{n}"] = rel_err(getattr(b, n).to_local(), expect_local)
        errs[f"state_dict:{n}"] = rel_err(full(model.state_dict()[f"block.{n}"]), w)
    # torch.distributed.checkpoint.state_dict: the full state dict equals the unsharded layer's
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for n, t in plain.state_dict().items():
        errs[f"get_model_state_dict(full):{n}"] = rel_err(full_sd[n], t)
    # load an unsharded checkpoint (another seed) into the head-parallel layer: as a full
    # state dict on every rank, from rank 0 only, and into the block alone with load_state_dict
    other = make_layer(sz, device, seed=4, **opts)
    other_sd = other.state_dict()
    expect_shard = {n: fdist.to_tp_rows(getattr(other.block, n).detach(), hq, hkv, ws).chunk(ws)[rank]
                    for n in row_params}
    for how in ("full_state_dict", "broadcast_from_rank0", "block.load_state_dict"):
        m = tp_parallelize(make_layer(sz, device, seed=5, **opts), mesh)
        if how == "block.load_state_dict":
            m.block.load_state_dict(other.block.state_dict())
        else:
            set_model_state_dict(m, dict(other_sd) if how == "full_state_dict" or rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True,
                                                          broadcast_from_rank0=how == "broadcast_from_rank0"))
        for n in row_params:
            errs[f"load[{how}]:{n}_local_shard"] = rel_err(getattr(m.block, n).to_local(), expect_shard[n])
        for n in ("q_norm_weight", "k_norm_weight"):
            errs[f"load[{how}]:{n}"] = rel_err(getattr(m.block, n).to_local(), getattr(other.block, n))
    model = m
    # deferred init: parallelize a block built on the meta device, materialise, load a checkpoint
    with torch.device("meta"):
        meta = GQAQKVRoPEQKNorm(sz.hidden, hq, hkv, d, **opts)
    fdist.parallelize_block(meta, mesh)
    meta.to_empty(device=device)
    meta.load_state_dict(other.block.state_dict())
    errs["meta_init_then_load"] = rel_err(fdist.full_qkv_weight(meta), other.block.qkv_weight)
    if tmpdir is not None:
        import torch.distributed.checkpoint as dcp

        tmpdir = os.path.join(tmpdir, "_".join(["state_dict"] + _tags(kv_heads, bias)))
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmpdir, "tp_ckpt"))
        into_plain = make_layer(sz, device, seed=5, **opts)
        sd = into_plain.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmpdir, "tp_ckpt"))
        into_plain.load_state_dict(sd)
        for n in row_params:
            errs[f"dcp_tp_to_plain:{n}"] = rel_err(getattr(into_plain.block, n), getattr(other.block, n))
        dcp.save(plain.state_dict(), checkpoint_id=os.path.join(tmpdir, "plain_ckpt"))
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmpdir, "plain_ckpt"))
        model.load_state_dict(sd)
        errs["dcp_plain_to_tp"] = rel_err(fdist.full_qkv_weight(model.block), plain.block.qkv_weight)
        if bias:
            errs["dcp_plain_to_tp:qkv_bias"] = rel_err(full(model.state_dict()["block.qkv_bias"]), plain.block.qkv_bias)
    errs = max_over_ranks(errs)
    return dict(check=f"tp{ws}[{','.join(['state_dict'] + _tags(kv_heads, bias))}]", ok=all(v <= 0.0 for v in errs.values()), errors=errs,
                tolerances=dict(grad=0.0))


def check_tp_errors(sz, device):
    """Bad head counts / meshes raise a clear error before anything is sharded."""
    from torch.distributed.device_mesh import init_device_mesh

    _, ws = world()
    mesh = init_device_mesh(device.type, (ws,))
    msgs = {}
    # 3 KV heads over 2 or 4 ranks: neither divides the other
    bad = GQAQKVRoPEQKNorm(sz.hidden, 3 * ws, 3, sz.head_dim, device=device)
    try:
        fdist.parallelize_block(bad, mesh)
        msgs["kv_heads_not_divisible"] = "no error"
    except ValueError as e:
        msgs["kv_heads_not_divisible"] = str(e)
    try:
        fdist.HeadParallelQKV(input_layouts=Shard(2))
        msgs["bad_input_layout"] = "no error"
    except ValueError as e:
        msgs["bad_input_layout"] = str(e)
    done = fdist.parallelize_block(GQAQKVRoPEQKNorm(sz.hidden, 2 * ws, ws, sz.head_dim, device=device), mesh)
    for key, fn, exc in (("already_parallel", lambda: fdist.parallelize_block(done, mesh), ValueError),
                         ("not_a_block", lambda: fdist.parallelize_block(nn.Linear(4, 4, device=device), mesh),
                          NotImplementedError)):
        try:
            fn()
            msgs[key] = "no error"
        except exc as e:
            msgs[key] = str(e)
    # a gradient through the head-parallel block's gradients (create_graph=True): refused with the reason
    x, cos, sin, _ = make_batch(replace(sz, num_heads=2 * ws, num_kv_heads=ws), device)
    x.requires_grad_()
    (g,) = torch.autograd.grad(sum(t.square().sum() for t in done(x, cos, sin)), x, create_graph=True)
    try:
        g.square().sum().backward()
        msgs["second_order"] = "no error"
    except RuntimeError as e:
        msgs["second_order"] = str(e)
    ok = ("num_kv_heads=3" in msgs["kv_heads_not_divisible"] and f"tp={ws}" in msgs["kv_heads_not_divisible"]
          and f"num_heads={3 * ws}" in msgs["kv_heads_not_divisible"]
          and "input_layouts" in msgs["bad_input_layout"] and "already head-parallel" in msgs["already_parallel"]
          and "got Linear" in msgs["not_a_block"] and "not itself differentiable" in msgs["second_order"])
    return dict(check=f"tp{ws}[errors]", ok=ok, errors={}, messages=msgs, tolerances={})


def check_tp_kv_degrees(sz, device, dtype, tmpdir, steps=STEPS):
    """4 ranks: KV heads shared at tp=4 (2 KV heads: 2 ranks each; 1 KV head: all 4) train as
    one process does, and a DCP checkpoint moves tp=4 -> tp=2 -> tp=4 and to an unsharded
    block, weight and bias bit-equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    _, ws = world()
    results = [check_tp(sz, device, dtype, steps=steps, kv_heads=kv, bias=True, offset=1.0) for kv in (2, 1)]
    errs = {f"{r['check']}:{k}": v for r in results for k, v in r["errors"].items()}
    ok = all(r["ok"] for r in results)
    sz2 = replace(sz, num_kv_heads=2)
    mesh4 = init_device_mesh(device.type, (ws,))
    mesh2 = init_device_mesh(device.type, (ws // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    src = make_layer(sz2, device, seed=6, bias=True)
    tp4 = tp_parallelize(make_layer(sz2, device, seed=6, bias=True), mesh4)
    path = os.path.join(tmpdir, "kv_degrees")
    dcp.save(tp4.state_dict(), checkpoint_id=os.path.join(path, "tp4"))
    tp2 = tp_parallelize(make_layer(sz2, device, seed=7, bias=True), mesh2)
    sd = tp2.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "tp4"))
    tp2.load_state_dict(sd)
    dcp.save(tp2.state_dict(), checkpoint_id=os.path.join(path, "tp2"))
    back = tp_parallelize(make_layer(sz2, device, seed=8, bias=True), mesh4)
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "tp2"))
    back.load_state_dict(sd)
    plain = make_layer(sz2, device, seed=9, bias=True)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(path, "tp2"))
    plain.load_state_dict(sd)
    for name, m in (("tp2", tp2), ("tp4_again", back)):
        errs[f"dcp:{name}:qkv_weight"] = rel_err(fdist.full_qkv_weight(m.block), src.block.qkv_weight)
        errs[f"dcp:{name}:qkv_bias"] = rel_err(full(m.state_dict()["block.qkv_bias"]), src.block.qkv_bias)
    errs["dcp:plain:qkv_weight"] = rel_err(plain.block.qkv_weight, src.block.qkv_weight)
    errs["dcp:plain:qkv_bias"] = rel_err(plain.block.qkv_bias, src.block.qkv_bias)
    dcp_errs = max_over_ranks({k: v for k, v in errs.items() if k.startswith("dcp:")})
    errs.update(dcp_errs)
    ok = ok and all(v == 0.0 for v in dcp_errs.values())
    return dict(check=f"tp{ws}[kv_heads=2/1 shared, bias, offset; DCP tp4<->tp2<->plain]", ok=ok, errors=errs,
                tolerances=results[0]["tolerances"])


# --------------------------------------------------------------------------- all of them


def run_checks(device, sz: Sizes, dtype, compile_backend=None, steps=STEPS, tmpdir=None, only=None, log=None):
    """Every check; returns a list of results (dicts with 'check', 'ok', 'errors', ...)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cpu = device.type == "cpu"
    kv_few = max(dist.get_world_size() // 2, 1)  # fewer KV heads than ranks: each on 2 ranks
    plan = [
        ("ddp", lambda: check_ddp(sz, device, dtype, steps=steps)),
        ("ddp_functional", lambda: check_ddp(sz, device, dtype, block="functional", steps=steps)),
        ("ddp_ac", lambda: check_ddp(sz, device, dtype, activation_checkpointing=True, steps=steps)),
        ("ddp_autocast", lambda: check_ddp(sz, device, torch.float32, autocast_dtype=torch.bfloat16, steps=steps)),
        ("fsdp", lambda: check_fsdp(sz, device, None, steps=steps)),
        ("fsdp_mp", lambda: check_fsdp(sz, device, torch.bfloat16, steps=steps)),
        ("fsdp_functional_ac", lambda: check_fsdp(sz, device, None if cpu else torch.bfloat16, block="functional",
                                                  activation_checkpointing=True, steps=steps)),
        ("tp", lambda: check_tp(sz, device, dtype, steps=steps)),
        # fewer KV heads than ranks (replicated), the q/k/v bias and the norm-weight offset
        ("tp_kv_bias_offset", lambda: check_tp(sz, device, dtype, steps=steps, kv_heads=kv_few, bias=True,
                                               offset=1.0)),
        ("tp_reference", lambda: check_tp(sz, device, dtype, block="reference", steps=steps,
                                          qk_norm_position="before_rope", kv_heads=kv_few, bias=True, offset=1.0)),
        ("tp_layouts", lambda: check_tp_block_layouts(sz, device, dtype)),
        ("tp_layouts_kv_bias_offset", lambda: check_tp_block_layouts(sz, device, dtype, kv_heads=kv_few, bias=True,
                                                                     offset=1.0)),
        ("tp_state_dict", lambda: check_tp_state_dict(sz, device, tmpdir)),
        ("tp_state_dict_kv_bias", lambda: check_tp_state_dict(sz, device, tmpdir, kv_heads=kv_few, bias=True)),
        ("tp_errors", lambda: check_tp_errors(sz, device)),
    ]
    if compile_backend:
        plan += [
            ("fsdp_compile", lambda: check_fsdp(sz, device, None if cpu else torch.bfloat16,
                                                compile_backend=compile_backend, steps=steps)),
            ("tp_compile", lambda: check_tp(sz, device, dtype, compile_backend=compile_backend, steps=steps)),
            # the sequence-sharded block with every option, compiled: equal to the eager call
            ("tp_compile_kv_bias_offset", lambda: check_tp_block_layouts(
                sz, device, dtype, layouts=("seq-sharded",), kv_heads=kv_few, bias=True, offset=1.0,
                compile_backend=compile_backend)),
        ]
    if dist.get_world_size() == 4:
        plan += [("fsdp_tp", lambda: check_fsdp_tp(sz, device, dtype, steps=steps)),
                 ("fsdp_tp_kv_bias_offset", lambda: check_fsdp_tp(sz, device, dtype, steps=steps, kv_heads=1, bias=True,
                                                                  offset=1.0))]
        if tmpdir is not None:
            plan += [("tp_kv_degrees", lambda: check_tp_kv_degrees(sz, device, dtype, tmpdir, steps=steps))]
    results = []
    for key, fn in plan:
        if only and key not in only:
            continue
        t0 = time.perf_counter()
        res = fn()
        res["key"] = key
        res["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(res)
        if log:
            log(f"{res['check']}: {'ok' if res['ok'] else 'FAIL'} ({res['seconds']} s) "
                + " ".join(f"{k}={v:.2e}" for k, v in res["errors"].items()))
    return results


@contextlib.contextmanager
def process_group(backend, rank, world_size, init_method):
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_processes(fn, args, nprocs: int, deadline_s: float, poll_s: float = 5.0) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes (torch.multiprocessing), waited for at most
    ``deadline_s``: a hung collective fails the test (pytest.fail), not the CI job; the processes are
    killed on the way out."""
    import time

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    t0 = time.monotonic()
    try:
        while not ctx.join(timeout=poll_s):
            if time.monotonic() - t0 > deadline_s:
                pytest.fail(f"the {nprocs} gloo processes did not finish in {deadline_s} s")
    finally:
        for p in ctx.processes:  # only ours; a no-op once they have exited
            if p.is_alive():
                p.kill()


def gloo_worker(rank, world_size, init_file, out_path, opts):
    """torch.multiprocessing entry point: the checks on CPU tensors over gloo; rank 0 writes JSON."""
    import json

    torch.set_num_threads(1)
    with process_group("gloo", rank, world_size, f"file://{init_file}"):
        results = run_checks("cpu", opts.get("sizes", TINY), torch.float32, compile_backend=opts.get("compile"),
                             steps=opts.get("steps", STEPS), tmpdir=opts.get("tmpdir"), only=opts.get("only"))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, default=str)
