"""Launcher for the RoPE + QK-norm backward stage, with CPU/GPU dispatch (the forward's
launcher is :mod:`fusedqkv.ops.gqa_forward`).

The backward stage takes the gradients of q/k/v (``[batch, heads, seq, head_dim]``)
and writes dQKV token-major ``[tokens, (Hq + 2*Hkv) * D]`` -- what the projection
GEMMs read -- plus grad_cos/grad_sin and the two norm-weight gradients.

Two backends with one semantics:
* ``"triton"``: the kernels in :mod:`fusedqkv.kernels.rope_qk_norm` (CUDA, or the
  CPU under ``TRITON_INTERPRET=1``, which the tests use);
* ``"torch"``: vectorised PyTorch, the CPU path. In ``exact`` mode it performs each
  operation in the activation dtype, exactly as an eager reference does, so its
  roundings are the reference's; otherwise it computes in fp32 and rounds once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import config
from .config import INTERPRET
from . import device as _device
from .device import current_stream, max_shared_bytes, sm90_or_newer, sm_count
from .launch import BoundLaunch, Desc, Ptr, Table, next_pow2 as _next_pow2
from .variant import PLAIN, Variant, all_heads_warps, heads_of, pad_rotary, rotate

try:  # Triton is a dependency on Linux only; the torch backend serves without it
    from ..kernels.rope_qk_norm import (rope_qk_norm_bwd_all_heads_kernel, rope_qk_norm_bwd_finish_cols_kernel,
                                        rope_qk_norm_bwd_finish_kernel, rope_qk_norm_bwd_kernel)
except ImportError:  # pragma: no cover
    rope_qk_norm_bwd_kernel = rope_qk_norm_bwd_finish_kernel = rope_qk_norm_bwd_finish_cols_kernel = None
    rope_qk_norm_bwd_all_heads_kernel = None


def _launch_config(M: int, hq: int, hkv: int, d: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(tokens per block, heads per step, num_warps, pipeline stages of the head loop, heads
    per group or 0) for the backward stage; tiles are [heads per step x tokens per block rows,
    D/2] of ~4 elements per thread, one head per step (two or more heads per step cost a
    cross-warp sum per token: slower on every workload measured).

    Many tokens (3+ blocks of 8 per SM): a program takes every query and key head of an
    8-token block, and grad_cos/sin need no partials. Fewer: programs take one group of 16
    heads of 8 tokens, or from 1k tokens down 8 heads of 4 tokens ("grouped"), so that there
    are enough of them; the last group of a block to finish sums the groups' partials.
    Measured on the H200: benchmarks/NOTES.md, v9c.

    Above head_dim 256 blocks are capped at ``STAGE_TILE_ELEMENTS`` per tile (4 tokens at 512), so a
    thread holds as many elements of a tile as at 256 (8 tokens of 512 took 16 warps, whose 128
    registers per thread spilled: sm_90 offline, NOTES session 17).
    """
    sms = sm_count(device)
    cap = max(1, STAGE_TILE_ELEMENTS // _next_pow2(d // 2))
    if -(-M // 8) >= 3 * sms:
        block_t, group = min(8, cap), 0
    elif M > 1024:
        block_t, group = min(8, cap), 16
    else:
        block_t, group = min(4, cap), 8
    return block_t, 1, _warps_for(block_t, d, 4), PREFETCH, group


# The largest [tokens, head_dim/2] tile of the stage: 8 tokens of 256 (1024 elements), 4 of 512.
STAGE_TILE_ELEMENTS = 1024
# fp32 elements of one head set's tile of the norm-weight finish ([rows, head_dim]): 32 rows of 256
# (the layout head_dim 256 compiles without spills, sm_90 offline); fewer rows above
FINISH_TILE_ELEMENTS = 8192


def finish_rows(d: int, most: int = 32) -> int:
    """Rows of partials a norm-weight finish sums per step (a power of two, at most ``most``), so that
    its [rows, head_dim] tiles stay within ``FINISH_TILE_ELEMENTS``: 32 to head_dim 256, 16 at 512."""
    return max(1, min(most, FINISH_TILE_ELEMENTS // _next_pow2(d)))


# Register cap of the stage kernel with 4 warps: four programs per SM. The 16-bit math took
# a 4-token x 2-head tile to 151 registers (3 per SM) and 2048 tokens from 36.5 to 51.8 us;
# capped, ptxas fits it in 128 without spills (sm_90, offline). (The 2-warp tile spills under
# the cap and runs uncapped, six programs per SM.)
MAX_REGISTERS = 128
# ... and for the head groups of 8-token blocks (1k-3k tokens): 96 (no spills, sm_90 offline)
# lets five programs share an SM instead of four, which pays there (2048 tokens 33.6/32.2 ->
# 30.1/30.6 us) but not for every head of a block (8192 tokens 94 -> 102 us): v10c.
MAX_REGISTERS_GROUPED_8 = 96


def _warps_for(block_t: int, d: int, per_thread: int = 2) -> int:
    # the per-element working set of the exact-mode math is ~20-30 fp32 registers, so more
    # than ~4 tile elements per thread spill on sm_90
    return max(1, min(16, block_t * _next_pow2(d // 2) // (32 * per_thread)))


def pick_backend(device: torch.device, backend: Optional[str]) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not INTERPRET:
        # Triton's launcher would only fail inside, on the first CPU pointer
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
                         f"the tensors are on {device}")
    return backend


def _rstd3(r: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """rstd as [B, H, S] (drops a trailing keepdim axis of size 1)."""
    return r[..., 0] if r is not None and r.dim() == 4 else r


# --------------------------------------------------------------------------- backward


def rope_qk_norm_backward(
    grad_q, grad_k, grad_v, saved_q, saved_k, rstd_q, rstd_k, q_norm_weight, k_norm_weight, cos, sin,
    *, dqkv, grad_cos=None, grad_sin=None, grad_q_norm_weight, grad_k_norm_weight,
    exact: bool, norm_after_rope: bool = True, saved_rotated: bool = True, backend: Optional[str] = None,
    scratch: Optional[torch.Tensor] = None, eps: Optional[float] = None, variant: Variant = PLAIN,
    grad_gate: Optional[torch.Tensor] = None, saved_v: Optional[torch.Tensor] = None,
):
    """Backward of RoPE + per-head RMSNorm for q and k, plus the V copy, into ``dqkv``; one
    unplanned call (the public entry points keep plans: :mod:`fusedqkv.ops.backward_091`, :mod:`fusedqkv.ops.training_backward`).

    Arguments are already validated. ``saved_q``/``saved_k`` are the rotated pre-norm
    tensors (``saved_rotated=True``, SOL-ExecBench 091) or the raw projection outputs.
    ``grad_cos``/``grad_sin`` may be None to skip them. Outputs are written in place.
    ``rstd_q``/``rstd_k`` may be None: the stage then recomputes rstd = 1/sqrt(mean(n^2) + eps)
    from the saved tensor (``eps`` required), as the forward did. ``scratch``: a tensor whose
    memory may hold the fp32 partials (the caller overwrites it afterwards).

    ``variant`` (not ``PLAIN``: the training mode only -- not exact, raw saved tensors, rstd
    recomputed): the block's variants (:class:`~fusedqkv.ops.gqa_forward.Variant`); norm weights
    and their gradients None without a norm weight; ``grad_gate`` ``[B, Hq, S, D]`` with
    ``q_gate``; ``saved_v`` (the raw v) with ``v_norm``.

    Returns the :class:`StagePlan` it ran (None on the torch backend).
    """
    if (rstd_q is None) != (rstd_k is None) or (rstd_q is None and eps is None):
        raise ValueError("rstd_q/rstd_k: give both, or neither together with eps (then rstd is recomputed)")
    if pick_backend(grad_q.device, backend) == "torch":
        backward_torch(grad_q, grad_k, grad_v, saved_q, saved_k, rstd_q, rstd_k, q_norm_weight, k_norm_weight,
                       cos, sin, dqkv, grad_cos, grad_sin, grad_q_norm_weight, grad_k_norm_weight, exact,
                       norm_after_rope, saved_rotated, eps, variant, grad_gate, saved_v)
        return None
    table = Table()
    operands = dict(grad_q=grad_q, grad_k=grad_k, grad_v=grad_v, saved_q=saved_q, saved_k=saved_k, rstd_q=rstd_q,
                    rstd_k=rstd_k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos=cos, sin=sin,
                    dqkv=dqkv, grad_cos=grad_cos, grad_sin=grad_sin, grad_q_norm_weight=grad_q_norm_weight,
                    grad_k_norm_weight=grad_k_norm_weight, scratch=scratch, grad_gate=grad_gate, saved_v=saved_v)
    slots = [None if t is None else table.add(name, t) for name, t in operands.items()]
    stage = plan_backward_stage(table, *slots[:17], exact=exact, norm_after_rope=norm_after_rope,
                                saved_rotated=saved_rotated, eps=eps, finish_outside=False, cfg=config.current(),
                                variant=variant, gg=slots[17], xv=slots[18])
    stream = current_stream(grad_q.device)
    tensors = table.tensors({**operands, **stage.call_inputs(stream)})
    for launch in stage.launches():
        launch.launch(tensors, None, stream)
    return stage


# pipeline stages of the stage kernel's head loop (heads whose tiles are in flight, plus
# the one computed); the stage is bound by memory latency (benchmarks/NOTES.md, v7)
PREFETCH = 3


def _tma_4d(t: torch.Tensor, half: int) -> bool:
    """A [B, H, S, D] tensor a TMA descriptor can address in [1, 1, rows, D/2] boxes."""
    es = t.element_size()
    if not (INTERPRET or (t.is_cuda and sm90_or_newer(t.device))):
        return False
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0 and half & (half - 1) == 0 and half * es >= 16
            and all((st * es) % 16 == 0 for st in t.stride()[:3]))


def _partial_layout(shapes):
    """Byte offsets of fp32 buffers of the given shapes packed one after another (each 16-byte
    aligned), and the total bytes."""
    offs, off = [], 0
    for shape in shapes:
        offs.append(off)
        off += -(-math.prod(shape) // 4) * 16
    return offs, off


def _scratch_fits(t: torch.Tensor, nbytes: int) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() * t.element_size() >= nbytes


def stage_tensor_args(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, w_part, w_sup, tick,
                      cs_part, w_grp):
    """The stage kernel's leading tensor arguments (:class:`Ptr` slots), each followed by its
    strides, in parameter order. ``rq`` None (rstd recomputed), ``wq`` None (no norm weight):
    placeholders with zero strides that the kernel never reads."""
    def st(p, n=None):
        s = p.like.stride()
        return s if n is None else s[:n]

    if rq is None:
        rq = rk = w_part
        rq_strides = rk_strides = (0, 0, 0)
    else:
        rq_strides, rk_strides = st(rq, 3), st(rk, 3)
    if wq is None:
        wq = wk = gwq = gwk = w_part
        w_strides = (0, 0, 0, 0)
    else:
        w_strides = (st(wq)[0], st(wk)[0], st(gwq)[0], st(gwk)[0])
    return (
        gq, *st(gq), gk, *st(gk), gv, *st(gv),
        xq, *st(xq), xk, *st(xk),
        rq, *rq_strides, rk, *rk_strides,
        wq, w_strides[0], wk, w_strides[1],
        cos, *st(cos), sin, *st(sin),
        dqkv, st(dqkv)[0],
        gcos, *st(gcos), gsin, *st(gsin),
        gwq, w_strides[2], gwk, w_strides[3], w_part, w_sup, tick, cs_part, w_grp,
    )


def variant_tensor_args(gv, xk, gg=None, xv=None):
    """The stage kernel's trailing tensor arguments (after the descriptors): the gate's gradient
    ``gg`` (Q_GATE) with its strides and the raw v ``xv`` (V_NORM, ``xk``'s strides); absent, the
    v gradient as a placeholder the kernel never reads."""
    gg, gg_strides = (gv, (0, 0, 0, 0)) if gg is None else (gg, gg.like.stride())
    if xv is None:
        xv = gv
    elif xv.like.stride() != xk.like.stride():
        raise ValueError("saved_v: expected the strides of saved_k (both views of the projection output)")
    return (gg, *gg_strides, xv)


class NormWeightFinish:
    """The last step of the norm-weight gradients: fp32 rows ``part`` [n_rows, 2 (query, key), D],
    one per stage program, summed in a fixed order into ``gwq``/``gwk`` (slots). As a launch
    (``launch``) it is ``rope_qk_norm_bwd_finish_kernel``; the Triton dW product may instead
    run ``_finish_norm_weight`` on these fields (after the stage has completed)."""

    def __init__(self, part: Ptr, n_rows: int, gwq: Ptr, gwk: Ptr, d: int):
        self.part, self.n_rows, self.gwq, self.gwk, self.d = part, n_rows, gwq, gwk, d
        self.rows = finish_rows(d)  # partial rows summed per step (the Triton dW's finish too)
        self.launch = BoundLaunch(
            rope_qk_norm_bwd_finish_kernel, (1,),
            (part, n_rows, gwq, gwq.like.stride(0), gwk, gwk.like.stride(0)),
            dict(D=d, D_P2=_next_pow2(d), BLOCK_R=self.rows, num_warps=4))


class AllHeadsNormWeightFinish:
    """The norm-weight gradients of ``norm_scope='all_heads'`` (``[Hq*D]``, ``[Hkv*D]``): the stage's
    fp32 rows ``part`` [n_rows, (Hq + Hkv) * D] summed per column in a fixed order, as a launch
    (``rope_qk_norm_bwd_finish_cols_kernel``) queued after the stage."""

    BLOCK_C = 128

    def __init__(self, part: Ptr, n_rows: int, gwq: Ptr, gwk: Ptr, nq: int, nk: int):
        self.launch = BoundLaunch(
            rope_qk_norm_bwd_finish_cols_kernel, (-(-(nq + nk) // self.BLOCK_C),),
            (part, n_rows, nq, nk, gwq, gwq.like.stride(0), gwk, gwk.like.stride(0)),
            dict(BLOCK_R=16, BLOCK_C=self.BLOCK_C, num_warps=4))


class StagePlan:
    """The backward stage of one input signature: its launch, the norm-weight finish when that
    is not fused (``finish``: a :class:`NormWeightFinish` for the caller to launch or hand to
    the Triton dW), and what the call must supply besides its own tensors (``call_inputs``):
    the stream's tickets, where the partials don't fit in the scratch a buffer of
    ``part_bytes``, and dQKV's amax partials where the stage writes them (``amax_shapes``:
    entry name -> shape, in dQKV's dtype ``amax_dtype``)."""

    def __init__(self, launch, finish, n_tick, own_partials, part_bytes, device, amax_shapes=None, amax_dtype=None):
        self.launch, self.finish = launch, finish
        self.n_tick, self.own_partials, self.part_bytes = n_tick, own_partials, part_bytes
        self.device = device
        self.amax_shapes, self.amax_dtype = amax_shapes or {}, amax_dtype
        self._kept = None  # (stream, device generation, call_inputs of that stream): see kept_inputs

    def call_inputs(self, stream: int = 0, capture: Optional[bool] = None) -> dict:
        """The table entries the stage adds to the caller's, by name: ``tickets``, ``partials``,
        ``amax_rows``, ``amax_cols`` (per call: the FP8 casts read them after the stage).
        ``capture``: whether ``stream`` is being captured, where the caller asked already."""
        out = {}
        if self.n_tick:
            out["tickets"] = _device.tickets(self.device, stream, self.n_tick, capture)
        if self.own_partials:
            out["partials"] = torch.empty(self.part_bytes // 4, dtype=torch.float32, device=self.device)
        for name, shape in self.amax_shapes.items():
            out[name] = torch.empty(shape, dtype=self.amax_dtype, device=self.device)
        return out

    def kept_inputs(self, stream: int, capture: bool) -> dict:
        """``call_inputs``, kept per stream where none of them is per call (no partials of the
        stage's own, no amax partials) and ``stream`` is not being captured (``capture``): the
        tickets are the stream's kept ones (each kernel leaves them zero); a dropped device state
        (``fusedqkv.clear_caches()``) is asked for again."""
        if capture or self.own_partials or self.amax_shapes:
            return self.call_inputs(stream, capture)
        kept = self._kept
        if kept is None or kept[0] != stream or kept[1] != _device.generation:
            kept = self._kept = (stream, _device.generation, self.call_inputs(stream, False))
        return kept[2]

    def launches(self, with_finish: bool = True) -> list:
        fin = [self.finish.launch] if with_finish and self.finish is not None else []
        return [self.launch] + fin


def plan_backward_stage(table: Table, gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                        scratch, *, exact: bool, norm_after_rope: bool, saved_rotated: bool, eps, finish_outside: bool,
                        cfg: config.Config, variant: Variant = PLAIN, gg=None, xv=None, row_amax: bool = False,
                        col_amax: bool = False) -> StagePlan:
    """Plan the stage kernel over table slots (``rq``/``rk`` None: rstd recomputed with ``eps``;
    ``gcos`` None: no grad_cos/grad_sin; ``scratch`` None or a slot whose memory may hold the
    fp32 partials). ``finish_outside``: leave the norm-weight gradients' last reduction (a
    chain of dependent L2 round trips at the stage's end, 3-4 us at few tokens) to the returned
    ``finish`` -- which a later kernel of the caller's runs, or which the caller launches.
    Adds the stage's own entries to the table after the caller's (see ``call_inputs``).

    ``variant``: the block's variants, training mode only (see :func:`rope_qk_norm_backward`;
    ``wq``..``gwk`` None without a norm weight, ``gg`` the gate's gradient with ``q_gate``, ``xv``
    the raw v with ``v_norm``). Those of the query/key heads run without TMA; ``all_heads`` in
    persistent programs of every head of a token (``_plan_all_heads_stage``).

    ``row_amax`` / ``col_amax`` (the FP8 backward's dual cast of dQKV): the stage also writes the
    amax partials of the dQKV it stores, rows' ``amax_rows [kinds, M]`` and columns' ``amax_cols
    [programs, dQKV's columns]`` (table entries, in dQKV's dtype: see :func:`stage_amax_supported`)."""
    B, HQ, S, D = gq.like.shape
    HKV = gk.like.shape[1]
    M = B * S
    device = gq.like.device
    grad_cos_sin = gcos is not None
    if variant != PLAIN and (exact or saved_rotated or rq is not None):
        raise ValueError("the block's variants run in the training mode only: exact=False, saved_rotated=False, "
                         "rstd recomputed")
    # the variants that take the query/key heads through _head_set_bwd_variants
    if variant.all_heads:
        return _plan_all_heads_stage(table, gq, gk, gv, xq, xk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                                     norm_after_rope=norm_after_rope, eps=eps, cfg=cfg, variant=variant, gg=gg, xv=xv)
    qk_variant = variant.qk_variant
    if (row_amax or col_amax) and not stage_amax_supported(variant, exact):
        raise ValueError(f"row_amax/col_amax: dQKV's amax partials come from the plain training stage only, not "
                         f"exact={exact} or variant {variant}")
    block_t, hb, num_warps, prefetch, gsize = cfg.stage_tile or _launch_config(M, HQ, HKV, D, device)
    if cfg.stage_tile:
        num_warps = _warps_for(block_t * hb, D, 4)
    grouped = gsize > 0
    nqg, nkg = (-(-HQ // gsize), -(-HKV // gsize)) if grouped else (1, 1)
    # (the 4-token tiles of few tokens measured no faster through TMA: v10)
    tma = (cfg.stage_tma and not qk_variant and block_t >= 8 and hb == 1
           and all(_tma_4d(t.like, D // 2) for t in (gq, xq, gk, xk)))
    # TMA: blocks of one sequence each (a box never spans two)
    n_prog = B * -(-S // block_t) if tma else -(-M // block_t)
    super_rows = finish_rows(D, cfg.finish_super_rows)  # the fused finish's first level
    n_sup = -(-n_prog // super_rows)
    # (no norm weight: no weight gradients)
    fused = cfg.fused_finish and not finish_outside and variant.norm_weight
    # The fused finish consumes the partials inside the kernel, so the dX output (written by the
    # GEMM after it) can hold them; the separate finish runs after the GEMMs and needs memory of
    # its own. (The grouped mode's grad_cos/sin partials and group rows are always consumed
    # inside the kernel.)
    shapes = [(n_prog, 2, D), (n_sup, 2, D)]
    if grouped:
        shapes += [(nqg + nkg, 2, M, D) if grad_cos_sin else (1,), (n_prog, nqg + nkg, D)]
    offs, nbytes = _partial_layout(shapes)
    n_tick = (n_prog if grouped else 0) + (n_sup + 1 if fused else 0)
    # a stand-in of the stream's tickets (the plan keeps no buffer: the call supplies them)
    tick = table.add("tickets", torch.empty(max(n_tick, 1), dtype=torch.int32, device=device)) if n_tick else None
    own_partials = not (fused and scratch is not None and _scratch_fits(scratch.like, nbytes))
    if own_partials:
        scratch = table.add("partials", torch.empty(nbytes // 4, dtype=torch.float32, device=device))
    n_kinds = nqg + nkg + 1 if grouped else 2
    amax_shapes = {}
    if row_amax:
        amax_shapes["amax_rows"] = (n_kinds, M)
    if col_amax:
        amax_shapes["amax_cols"] = (n_prog, dqkv.like.shape[1])
    amax_slots = {name: table.add(name, torch.empty(shape, dtype=dqkv.like.dtype, device=device))
                  for name, shape in amax_shapes.items()}
    part_names = ("w_part", "w_sup", "cs_part", "w_grp")
    parts = [table.derive(name, scratch, off, shape) for name, off, shape in zip(part_names, offs, shapes)]
    w_part, w_sup = parts[:2]
    cs_part, w_grp = parts[2:] if grouped else (w_part, w_part)
    if not grad_cos_sin:
        gcos = gsin = cos  # never written: the kernel is compiled without those stores
    recompute = rq is None
    box = [1, 1, block_t, D // 2]
    launch = BoundLaunch(
        rope_qk_norm_bwd_kernel, (n_prog, n_kinds),
        (*stage_tensor_args(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                            w_part, w_sup, tick or w_part, cs_part, w_grp),
         M, S, HQ, HKV, float(eps) if recompute else 0.0,
         *((Desc(gq, box), Desc(xq, box), Desc(gk, box), Desc(xk, box)) if tma else (gq, gq, gq, gq)),
         *variant_tensor_args(gv, xk, gg, xv), amax_slots.get("amax_rows"), amax_slots.get("amax_cols")),
        dict(D=D, D_P2=_next_pow2(D), BLOCK_T=block_t, HB=hb,
             EXACT=exact, NORM_AFTER_ROPE=norm_after_rope, SAVED_ROTATED=saved_rotated,
             GRAD_COS_SIN=grad_cos_sin, FUSED_FINISH=fused, SUPER=super_rows, RECOMPUTE_RSTD=recompute,
             PF=prefetch, GROUPED=grouped, NQG=nqg, NKG=nkg, GSIZE=max(gsize, 1), TMA=tma,
             LP2=sm90_or_newer(device), **variant.constexprs(D), ROW_AMAX=row_amax, COL_AMAX=col_amax,
             # EXACT mode reproduces separately rounded eager ops: no mul+add contraction into FMA
             num_warps=num_warps, enable_fp_fusion=not exact,
             # (the register caps were measured for the plain query/key path)
             # (the amax partials' registers: the grouped cap spilled them, sm_90 offline)
             **({"maxnreg": MAX_REGISTERS_GROUPED_8 if grouped and block_t == 8 and not (row_amax or col_amax)
                 else MAX_REGISTERS}
                if num_warps == 4 and device.type == "cuda" and not qk_variant else {})),
    )
    finish = None if not variant.norm_weight or fused else NormWeightFinish(w_part, n_prog, gwq, gwk, D)
    return StagePlan(launch, finish, n_tick, own_partials, nbytes, device, amax_shapes, dqkv.like.dtype)


def stage_amax_supported(variant: Variant, exact: bool = False) -> bool:
    """Whether the stage can write dQKV's amax partials: the training mode's plain query/key path
    (``rope_qk_norm_bwd_kernel`` with ``_head_set_bwd``; v normed or not). Not the query/key
    variants, ``all_heads`` (another kernel), nor ``k_eq_v`` (v's gradient is added to k's after the
    stage, so the stored values are not what the casts read)."""
    return not (exact or variant.qk_variant or variant.all_heads or variant.k_eq_v)


# the all-heads stage's persistent programs per SM and pipeline stages of their token loop (where
# they fit: all_heads_stages), with 8 elements of a [heads, pairs] tile per thread (H200, OLMo 3's
# 32 heads of 128: NOTES, session 12)
ALL_HEADS_PROGRAMS_PER_SM = 1
ALL_HEADS_STAGES = 3


def all_heads_stages(hq: int, hkv: int, d: int, variant: Variant, act_bytes: int, cos_bytes: int,
                     device: torch.device) -> int:
    """Pipeline stages of the all-heads stage's token loop: ``ALL_HEADS_STAGES`` where they fit
    in shared memory, fewer where not. Each stage in flight holds a token's loaded tiles there
    (OLMo 3's 32 + 32 heads of 128 in bf16: ~42 KB; 5 stages asked 233,600 bytes of the H200's
    232,448 at launch), beside ~32 KB of reduction scratch."""
    cx, tiles = variant.constexprs(d), variant.head_tiles(hq, hkv)
    hq2, hkv2, d2 = tiles["HQ_P2"], tiles["HKV_P2"], _next_pow2(d)
    head = 2 * cx["HALF_P2"] + (cx["PASS_P2"] if cx["PASS"] else 0)  # a head's pair and pass-through columns
    elems = (2 * (hq2 + hkv2) * head  # g and x of q and k
             + hkv2 * d2 * (2 if variant.v_norm else 1) + (hq2 * d2 if variant.q_gate else 0))
    per_stage = elems * act_bytes + 4 * cx["HALF_P2"] * cos_bytes
    fit = (max_shared_bytes(device) - 32 * 1024) // per_stage
    return max(1, min(ALL_HEADS_STAGES, fit))


def _plan_all_heads_stage(table: Table, gq, gk, gv, xq, xk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, *,
                          norm_after_rope: bool, eps, cfg: config.Config, variant: Variant, gg, xv) -> StagePlan:
    """``plan_backward_stage`` for ``norm_scope='all_heads'``: persistent programs, each holding
    every query (key) head of a token in one tile (``rope_qk_norm_bwd_all_heads_kernel``); the
    norm-weight gradients from one fp32 row per program, summed per column by a second launch.
    ``cfg.all_heads_stage`` (warps, programs per SM, pipeline stages) overrides the choice."""
    B, HQ, S, D = gq.like.shape
    HKV = gk.like.shape[1]
    M = B * S
    device = gq.like.device
    half = variant.rotary(D) // 2
    num_warps, per_sm, stages = cfg.all_heads_stage or (
        all_heads_warps(HQ, HKV, half, 8), ALL_HEADS_PROGRAMS_PER_SM,
        all_heads_stages(HQ, HKV, D, variant, gq.like.element_size(), cos.like.element_size(), device))
    n_prog = max(1, min(M, per_sm * (sm_count(device) if device.type == "cuda" else 2)))
    w_part = None
    if variant.norm_weight:
        w_part = table.add("partials", torch.empty(n_prog * (HQ + HKV) * D, dtype=torch.float32, device=device))
    place = gq if w_part is None else w_part  # placeholders the kernel never reads
    if not variant.norm_weight:
        wq = wk = place
    grad_cos_sin = gcos is not None
    if not grad_cos_sin:
        gcos = gsin = cos  # never written: the kernel is compiled without those stores
    st = lambda p: p.like.stride()  # noqa: E731
    launch = BoundLaunch(
        rope_qk_norm_bwd_all_heads_kernel, (n_prog,),
        (gq, *st(gq), gk, *st(gk), gv, *st(gv), xq, *st(xq), xk, *st(xk),
         wq, st(wq)[0] if variant.norm_weight else 0, wk, st(wk)[0] if variant.norm_weight else 0,
         cos, *st(cos), sin, *st(sin), dqkv, st(dqkv)[0], gcos, *st(gcos), gsin, *st(gsin),
         place, M, S, HQ, HKV, float(eps), *variant_tensor_args(gv, xk, gg, xv)),
        dict(D=D, D_P2=_next_pow2(D), PF=stages, NORM_AFTER_ROPE=norm_after_rope, GRAD_COS_SIN=grad_cos_sin,
             **variant.constexprs(D), **variant.head_tiles(HQ, HKV), num_warps=num_warps),
    )
    finish = None
    if variant.norm_weight:
        finish = AllHeadsNormWeightFinish(w_part, n_prog, gwq, gwk, HQ * D, HKV * D)
    return StagePlan(launch, finish, 0, variant.norm_weight, n_prog * (HQ + HKV) * D * 4, device)


def _rope(x, cos, sin):
    return x * cos + rotate(x, x.shape[-1], False) * sin


def _rope_transpose(g, cos, sin, exact):
    """dL/dx of y = x*cos + rotate_half(x)*sin. ``exact``: 091's reference formula
    g*cos + cat(g2, -g1)*sin, equal to the true transpose only when sin's halves agree."""
    h = g.shape[-1] // 2
    if exact:
        return g * cos + torch.cat((g[..., h:], -g[..., :h]), dim=-1) * sin
    return g * cos + torch.cat((g[..., h:] * sin[..., h:], -g[..., :h] * sin[..., :h]), dim=-1)


def _rms_norm_backward_torch(g, x, w, r, out_dtype, eps=None):
    """Same operation order as the eager reference; all fp32, one rounding at the end.
    ``r`` None: recomputed from x (as the forward computes it)."""
    g = g.float()
    x = x.float()
    w = w.float()
    r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) if r is None else r.float().unsqueeze(-1)
    grad_w = (g * (x * r)).sum(dim=(0, 1, 2))
    direct = g * w * r
    grad_rstd = (g * w * x).sum(dim=-1, keepdim=True)
    dx = direct + grad_rstd * (-r.pow(3) * x / x.shape[-1])
    return dx.to(out_dtype), grad_w


def backward_torch(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                   exact, norm_after_rope, saved_rotated, eps=None, variant: Variant = PLAIN, gg=None, xv=None):
    """The stage on the torch backend (CPU path): outputs written in place."""
    if variant != PLAIN or gq.dtype == torch.float64:  # (fp64: the general path computes in fp64)
        _backward_torch_variant(gq, gk, gv, xq, xk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, norm_after_rope,
                                eps, variant, gg, xv)
        return
    rq, rk = _rstd3(rq), _rstd3(rk)
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    # exact: every op in the activation dtype rounds its result, as the eager reference;
    # otherwise fp32 throughout
    lp = gq.dtype if exact else torch.float32
    c = cos.unsqueeze(1).to(lp)
    s = sin.unsqueeze(1).to(lp)

    def head_set(g, x, r, w):
        g = g.to(lp)
        x = x.to(lp)
        if norm_after_rope:
            o = _rope(x, c, s)
            n, p = (x, o) if saved_rotated else (o, x)
            gn, grad_w = _rms_norm_backward_torch(g, n, w, r, lp, eps)
            dx = _rope_transpose(gn, c, s, exact)
            q = gn
        else:
            gn = _rope_transpose(g, c, s, exact)
            if r is None:
                r = torch.rsqrt(x.float().pow(2).mean(dim=-1) + eps)
            dx, grad_w = _rms_norm_backward_torch(gn, x, w, r, lp)
            p = (x.float() * r.float().unsqueeze(-1) * w.float()).to(lp)
            q = g
        gc = (q * p).sum(dim=1) if gcos is not None else None
        gs = (q * rotate(p, p.shape[-1], False)).sum(dim=1) if gcos is not None else None
        return dx, gc, gs, grad_w

    dxq, gcq, gsq, gwq32 = head_set(gq, xq, rq, wq)
    dxk, gck, gsk, gwk32 = head_set(gk, xk, rk, wk)
    view = dqkv.view(B, S, dqkv.shape[1])
    view[..., : HQ * D].view(B, S, HQ, D).copy_(dxq.transpose(1, 2))
    view[..., HQ * D: (HQ + HKV) * D].view(B, S, HKV, D).copy_(dxk.transpose(1, 2))
    view[..., (HQ + HKV) * D:].view(B, S, HKV, D).copy_(gv.transpose(1, 2))
    if gcos is not None:
        gcos.copy_(gcq + gck)
        gsin.copy_(gsq + gsk)
    gwq.copy_(gwq32)
    gwk.copy_(gwk32)


def _backward_torch_variant(gq, gk, gv, xq, xk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, norm_after_rope, eps,
                            variant, gg, xv):
    """The training mode's stage with the block's variants (fp32, one rounding -- fp64 for fp64
    inputs; x the raw projection output, rstd recomputed). RoPE is ``x*c + rotate(x)*s`` with cos/sin widened by
    1/0 over the pass-through dims; its transpose ``g*c - rotate(g*s)``. The all-heads norm is
    the per-head one over a token's heads taken together."""
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    rot, il = variant.rotary(D), variant.interleaved
    ct = torch.promote_types(gq.dtype, torch.float32)  # fp32 math (fp64 for fp64 inputs: the gradient checks)
    c = pad_rotary(cos.to(ct), D, 1.0).unsqueeze(1)
    s = pad_rotary(sin.to(ct), D, 0.0).unsqueeze(1)

    def head_set(g, x, w):
        g, x = g.to(ct), x.to(ct)
        H = x.shape[1]
        if norm_after_rope:
            n, gn = x * c + rotate(x, rot, il) * s, g
        else:
            n, gn = x, g * c - rotate(g * s, rot, il)
        dims, N = ((1, 3), H * D) if variant.all_heads else ((3,), D)
        r = torch.rsqrt(n.pow(2).mean(dim=dims, keepdim=True) + eps)
        wf = 1.0 if w is None else (w.to(ct).view(H, 1, D) if variant.all_heads else w.to(ct))
        gw = gn * wf
        dn = gw * r + (gw * n).sum(dim=dims, keepdim=True) * (-r.pow(3) * n / N)
        if norm_after_rope:
            dx, q, p = dn * c - rotate(dn * s, rot, il), dn, x
        else:
            dx, q, p = dn, g, n * r * wf
        grad_w = None
        if w is not None:
            grad_w = (gn * (n * r)).sum(dim=(0, 2))
            grad_w = grad_w.reshape(-1) if variant.all_heads else grad_w.sum(0)
        gc = (q * p).sum(dim=1)[..., :rot] if gcos is not None else None
        gs = (q * rotate(p, rot, il)).sum(dim=1)[..., :rot] if gcos is not None else None
        return dx, gc, gs, grad_w

    dxq, gcq, gsq, gwq32 = head_set(gq, xq, wq)
    dxk, gck, gsk, gwk32 = head_set(gk, xk, wk)
    dq, dk, dv, dgate = heads_of(dqkv.view(B, S, dqkv.shape[1]), HQ, HKV, D, variant.q_gate)
    dq.copy_(dxq)
    dk.copy_(dxk)
    if variant.v_norm:
        x, g = xv.to(ct), gv.to(ct)
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        dv.copy_(g * r + (g * x).sum(dim=-1, keepdim=True) * (-r.pow(3) * x / D))
    else:
        dv.copy_(gv)
    if variant.q_gate:
        dgate.copy_(gg)
    if gcos is not None:
        gcos.copy_(gcq + gck)
        gsin.copy_(gsq + gsk)
    if gwq is not None:
        gwq.copy_(gwq32)
        gwk.copy_(gwk32)
