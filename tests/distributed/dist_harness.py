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
from dataclasses import dataclass

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
                 activation_checkpointing: bool = False, autocast_dtype=None):
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.block = BLOCKS[block](sz.hidden, sz.num_heads, sz.num_kv_heads, sz.head_dim,
                                   qk_norm_position=qk_norm_position)
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
            m.block.q_norm_weight.uniform_(0.5, 1.5)
            m.block.k_norm_weight.uniform_(0.5, 1.5)
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
        if tp_block is not None and n.endswith("qkv_weight"):
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


def check_tp(sz, device, dtype, block="fused", compile_backend=None, steps=STEPS, qk_norm_position="after_rope"):
    """Head parallel: HeadParallelQKV on the block, RowwiseParallel on o_proj, every rank the
    whole batch; gradients (qkv_weight's in [Q | K | V] order; the input's all-reduced) and the
    loss curve equal the single process's."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    mesh = init_device_mesh(device.type, (ws,))
    x, cos, sin, target = make_batch(sz, device, dtype)
    single = make_layer(sz, device, dtype, block=block, qk_norm_position=qk_norm_position)
    ref_losses, ref = train(single, single, x, cos, sin, target, sz.lr, steps)
    model = tp_parallelize(make_layer(sz, device, dtype, block=block, qk_norm_position=qk_norm_position), mesh)
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
    # every rank computed the same loss (o_proj's all-reduce): the curves' spread is 0
    lo = torch.tensor(losses, dtype=torch.float64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    extra["rank_loss_spread"] = float((hi - lo).abs().max())
    tags = [block] + ([qk_norm_position] if qk_norm_position != "after_rope" else []) + (
        [f"compile={compile_backend}"] if compile_backend else [])
    res = verdict(f"tp{ws}[{','.join(tags)}]", errs, losses, ref_losses, tol, extra)
    res["ok"] = res["ok"] and res["errors"]["rank_loss_spread"] <= tol["loss"] and not any(
        v for k, v in res["errors"].items() if k.startswith("norm_grad_not_replicated"))
    return _with_compile_stats(res, compile_backend)


def check_fsdp_tp(sz, device, dtype, steps=STEPS):
    """2-D: FSDP2 over "dp" on top of HeadParallelQKV/RowwiseParallel over "tp" (4 ranks, 2 x 2):
    the qkv_weight becomes (_StridedShard(0), Shard(0)); half of the batch per dp rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    mesh = init_device_mesh(device.type, (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, ndp = mesh["dp"].get_local_rank(), ws // 2
    x, cos, sin, target = make_batch(sz, device, dtype)
    single = make_layer(sz, device, dtype)
    ref_losses, ref = train(single, single, x, cos, sin, target, sz.lr, steps)
    model = tp_parallelize(make_layer(sz, device, dtype), mesh["tp"])
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    extra = {"state_dict_qkv_weight": rel_err(full(model.state_dict()["block.qkv_weight"]),
                                              make_layer(sz, device, dtype).block.qkv_weight)}
    xl, cl, sl, tl = (local_batch(t, dp, ndp) for t in (x, cos, sin, target))
    # the loss of a dp rank's half batch (equal on its tp ranks), averaged over all ranks
    losses, got = train(model, model, xl, cl, sl, tl, sz.lr, steps, average=True, tp_block=model.block)
    res = verdict(f"fsdp2x{ndp}+tp2[fused]", _grad_errors(got, ref, dp, ndp, True), losses, ref_losses, tol, extra)
    res["ok"] = res["ok"] and res["errors"]["state_dict_qkv_weight"] == 0.0
    return res


def check_tp_block_layouts(sz, device, dtype):
    """The block alone (norm before RoPE) under HeadParallelQKV with a sequence-sharded input
    (Shard(1)) and DTensor outputs: q/k/v equal the single block's, the input gradient is
    reduce-scattered."""
    from torch.distributed.device_mesh import init_device_mesh
    rank, ws = world()
    tol = TOLERANCES[device.type, dtype]
    mesh = init_device_mesh(device.type, (ws,))
    x, cos, sin, _ = make_batch(sz, device, dtype)
    single = make_layer(sz, device, dtype, qk_norm_position="before_rope").block
    xs = x.detach().clone().requires_grad_()
    out_ref = single(xs, cos, sin)
    g = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(o.shape, generator=g).to(device=device, dtype=dtype) for o in out_ref]
    torch.autograd.backward(out_ref, grads_out)
    block = fdist.parallelize_block(make_layer(sz, device, dtype, qk_norm_position="before_rope").block, mesh, input_layouts=Shard(1),
                                    use_local_output=False)
    xl = local_batch(x.transpose(0, 1), rank, ws).transpose(0, 1).detach().clone().requires_grad_()
    out = block(xl, cos, sin)
    errs = {}
    for name, o, r in zip("qkv", out, out_ref):
        errs[f"out:{name}"] = rel_err(o.full_tensor(), r)
        errs[f"placement:{name}"] = float(tuple(o.placements) != (Shard(1),))
    torch.autograd.backward([o.to_local() for o in out],
                            [gg.chunk(ws, dim=1)[rank] for gg in grads_out])
    errs["input_seq_shard"] = rel_err(xl.grad, xs.grad.chunk(ws, dim=1)[rank])
    for n, p in block.named_parameters():
        gp = full(p.grad)
        if n == "qkv_weight":
            gp = fdist.to_canonical_rows(gp, block.num_heads, block.num_kv_heads, ws)
        errs[f"grad:{n}"] = rel_err(gp, getattr(single, n).grad)
    errs = max_over_ranks(errs)
    ok = all(v <= tol["grad"] for k, v in errs.items() if not k.startswith("placement")) and not any(
        v for k, v in errs.items() if k.startswith("placement"))
    return dict(check=f"tp{ws}[block,before_rope,seq-sharded input,DTensor outputs]", ok=ok, errors=errs, tolerances=tol)


def check_tp_state_dict(sz, device, tmpdir=None):
    """state_dict/load_state_dict of a head-parallel block are in the [Q | K | V] order;
    full_qkv_weight; the local shard is [Q_r | K_r | V_r]; torch.distributed.checkpoint's
    state-dict functions; a block parallelized on the meta device; a DCP checkpoint of the
    head-parallel layer loads into an unsharded layer (and back)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    rank, ws = world()
    mesh = init_device_mesh(device.type, (ws,))
    plain = make_layer(sz, device, seed=3)
    model = tp_parallelize(make_layer(sz, device, seed=3), mesh)
    b, hq, hkv, d = model.block, sz.num_heads, sz.num_kv_heads, sz.head_dim
    w = plain.block.qkv_weight.detach()
    q, k, v = w.split([hq * d, hkv * d, hkv * d])
    expect_local = torch.cat([q.chunk(ws)[rank], k.chunk(ws)[rank], v.chunk(ws)[rank]])
    errs = {
        "class_not_head_parallel": float(type(b) is not fdist.HeadParallelGQAQKVRoPEQKNorm),
        "local_shard_is_Qr_Kr_Vr": rel_err(b.qkv_weight.to_local(), expect_local),
        "full_qkv_weight": rel_err(fdist.full_qkv_weight(b), w),
        "state_dict_qkv_weight": rel_err(full(model.state_dict()["block.qkv_weight"]), w),
    }
    # torch.distributed.checkpoint.state_dict: the full state dict equals the unsharded layer's
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for n, t in plain.state_dict().items():
        errs[f"get_model_state_dict(full):{n}"] = rel_err(full_sd[n], t)
    # load an unsharded checkpoint (another seed) into the head-parallel layer: as a full
    # state dict on every rank, from rank 0 only, and into the block alone with load_state_dict
    other = make_layer(sz, device, seed=4)
    other_sd = other.state_dict()
    expect_shard = fdist.to_tp_rows(other.block.qkv_weight.detach(), hq, hkv, ws).chunk(ws)[rank]
    for how in ("full_state_dict", "broadcast_from_rank0", "block.load_state_dict"):
        m = tp_parallelize(make_layer(sz, device, seed=5), mesh)
        if how == "block.load_state_dict":
            m.block.load_state_dict(other.block.state_dict())
        else:
            set_model_state_dict(m, dict(other_sd) if how == "full_state_dict" or rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True,
                                                          broadcast_from_rank0=how == "broadcast_from_rank0"))
        errs[f"load[{how}]:qkv_weight_local_shard"] = rel_err(m.block.qkv_weight.to_local(), expect_shard)
        for n in ("q_norm_weight", "k_norm_weight"):
            errs[f"load[{how}]:{n}"] = rel_err(getattr(m.block, n).to_local(), getattr(other.block, n))
    model = m
    # deferred init: parallelize a block built on the meta device, materialise, load a checkpoint
    with torch.device("meta"):
        meta = GQAQKVRoPEQKNorm(sz.hidden, hq, hkv, d)
    fdist.parallelize_block(meta, mesh)
    meta.to_empty(device=device)
    meta.load_state_dict(other.block.state_dict())
    errs["meta_init_then_load"] = rel_err(fdist.full_qkv_weight(meta), other.block.qkv_weight)
    if tmpdir is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmpdir, "tp_ckpt"))
        into_plain = make_layer(sz, device, seed=5)
        sd = into_plain.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmpdir, "tp_ckpt"))
        into_plain.load_state_dict(sd)
        errs["dcp_tp_to_plain"] = rel_err(into_plain.block.qkv_weight, other.block.qkv_weight)
        dcp.save(plain.state_dict(), checkpoint_id=os.path.join(tmpdir, "plain_ckpt"))
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmpdir, "plain_ckpt"))
        model.load_state_dict(sd)
        errs["dcp_plain_to_tp"] = rel_err(fdist.full_qkv_weight(model.block), w)
    errs = max_over_ranks(errs)
    return dict(check=f"tp{ws}[state_dict]", ok=all(v <= 0.0 for v in errs.values()), errors=errs,
                tolerances=dict(grad=0.0))


def check_tp_errors(sz, device):
    """Bad head counts / meshes raise a clear error before anything is sharded."""
    from torch.distributed.device_mesh import init_device_mesh

    _, ws = world()
    mesh = init_device_mesh(device.type, (ws,))
    msgs = {}
    bad = GQAQKVRoPEQKNorm(sz.hidden, 2 * ws, 1, sz.head_dim, device=device)  # 1 KV head over ws ranks
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
    ok = ("num_kv_heads=1" in msgs["kv_heads_not_divisible"] and f"tp={ws}" in msgs["kv_heads_not_divisible"]
          and "input_layouts" in msgs["bad_input_layout"] and "already head-parallel" in msgs["already_parallel"]
          and "got Linear" in msgs["not_a_block"])
    return dict(check=f"tp{ws}[errors]", ok=ok, errors={}, messages=msgs, tolerances={})


# --------------------------------------------------------------------------- all of them


def run_checks(device, sz: Sizes, dtype, compile_backend=None, steps=STEPS, tmpdir=None, only=None, log=None):
    """Every check; returns a list of results (dicts with 'check', 'ok', 'errors', ...)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cpu = device.type == "cpu"
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
        ("tp_reference", lambda: check_tp(sz, device, dtype, block="reference", steps=steps,
                                          qk_norm_position="before_rope")),
        ("tp_layouts", lambda: check_tp_block_layouts(sz, device, dtype)),
        ("tp_state_dict", lambda: check_tp_state_dict(sz, device, tmpdir)),
        ("tp_errors", lambda: check_tp_errors(sz, device)),
    ]
    if compile_backend:
        plan += [
            ("fsdp_compile", lambda: check_fsdp(sz, device, None if cpu else torch.bfloat16,
                                                compile_backend=compile_backend, steps=steps)),
            ("tp_compile", lambda: check_tp(sz, device, dtype, compile_backend=compile_backend, steps=steps)),
        ]
    if dist.get_world_size() == 4:
        plan += [("fsdp_tp", lambda: check_fsdp_tp(sz, device, dtype, steps=steps))]
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
