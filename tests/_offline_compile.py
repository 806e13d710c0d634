"""Offline GPU compiles of every fusedqkv Triton kernel, without a GPU (used by test_gpu_targets).

Triton compiles a kernel for an explicit ``GPUTarget`` with no device present: sm_80 (Ampere: no
TMA, fp32 math), sm_90 (Hopper: TMA, 16-bit pairs, the Triton products), sm_100a (datacenter
Blackwell: as sm_90, products included) and sm_120a (consumer Blackwell: the stage's TMA and
16-bit pairs, no products).
This module lists the compile jobs -- the constexpr combinations the launchers can select, and
the kernels with their integer arguments specialised as the JIT specialises them -- and runs
them in parallel processes. Run it as a script in a process *without* ``TRITON_INTERPRET=1``
(the kernels' GPU code paths are chosen at import). Prints one JSON line per job. A job that names a
Triton (``"triton"``) runs only with ``--triton VERSION``, that Triton imported.

How the JIT specialises a launch's arguments (triton 3.6, ``native_specialize_impl``): an
integer equal to 1 becomes a compile-time constant (signature ``"constexpr"``, value 1) -- the
kernel then sees a Python int, on which e.g. ``M.to(tl.int64)`` fails; an integer that is a
multiple of 16 gets the ``tt.divisibility=16`` attribute ("D"); one outside the 32-bit range is
typed ``i64``; a tensor gets "D" when its address is 16-byte aligned. A job's ``ints`` mode picks
one of these for all integer arguments at once ("plain", "div16", "ones"; "i64" for the strides:
sizes stay below 2**31), or ``one=NAME`` makes a single argument the constant 1.

The constexpr values come from the launchers (``fusedqkv/ops``):

* ``rope_qk_norm_bwd_kernel`` (``ops/rope_qk_norm.plan_backward_stage``): the 091 entry point runs
  EXACT, NORM_AFTER_ROPE, SAVED_ROTATED, GRAD_COS_SIN, rstd loaded, FUSED_FINISH unless a Triton
  dW runs the finish (then an fp32 placeholder for the tickets when not grouped); the training
  API runs not EXACT, either norm position, the raw projection output saved, rstd recomputed,
  grad_cos/sin only when cos/sin require grad, the fused finish. Layouts (``_launch_config``):
  8-token blocks with every head (4 warps at head_dim 128; TMA descriptors from sm_90 on where the
  tensors allow it), 8-token blocks in groups of 16 heads, 4-token blocks in groups of 8 heads;
  NQG/NKG = heads / group size rounded up; LP2 from sm_90 on; maxnreg 128 (96 for the grouped
  8-token blocks) where num_warps == 4.
* ``rope_qk_norm_fwd_kernel`` (``ops/gqa_forward``): BLOCK_T = min(32, 1024 // HALF_P2), GROUP
  4/2/1 with 4 warps (the launcher's choices), GROUP 8 with 8 warps (reachable through the
  config's forward_tile), either norm position.
* the block's variants (issue 25; ``ops/gqa_forward.Variant``, ``VARIANTS`` here): in both stages,
  training modes only, their constexprs (HALF/PASS of partial rotary at half or a quarter of head_dim,
  INTERLEAVED, NORM_WEIGHT, Q_GATE, V_NORM) pairwise with the other axes, as four per-head variants
  (``VARIANT_STAGE_AXES``: partial rotary alone and with interleaved pairs are the gate's
  constexprs); the query/key variants without TMA and without the register cap. The forward's
  ALL_HEADS programs hold one token's heads (BLOCK_T 1, HQ_P2/HKV_P2 the padded head counts, the
  launcher's warps).
* ``rope_qk_norm_bwd_all_heads_kernel`` (``_plan_all_heads_stage``, ``norm_scope='all_heads'``): the
  all-heads variants (weighted, partial rotary, unweighted with gate, v_norm and interleaved pairs)
  over head counts, either norm position, with and without grad_cos/sin, 1 or 3 loop stages.
* ``rope_qk_norm_bwd_finish_kernel`` (``NormWeightFinish``): BLOCK_R 32, 4 warps;
  ``rope_qk_norm_bwd_finish_cols_kernel`` (``AllHeadsNormWeightFinish``): BLOCK_R 16, BLOCK_C 128.
* ``tma_matmul_kernel`` (``ops/projection``, sm_90 and sm_100a only): the chain's dX and dW and the
  hybrid's dW configurations, with and without the norm-weight finish, NPROG from 1 up.
* ``l2_flush_kernel`` (the benchmark harness).
* the FP8 casts (``ops/fp8``, ``kernels/fp8_cast``; sm_90 and both Blackwells): rowwise, tile amax,
  the per-column/tensorwise cast (transposed or not) and the outer scale, pairwise over the
  activation dtype, the FP8 format, the power-of-two scales and the integer modes; the dual casts
  (session 21: amax partials, finish, one cast to two layouts) also over rows and columns each per
  axis or per tensor, and each side's FP8 format; the rowwise cast from row partials (session 24).
* ``mx_cast_kernel`` (``ops/fp8.mx_cast_triton``, the mxfp8 and mxfp8_rceil recipes; sm_100a only): the
  launcher's tile, each scale mode (FLOOR, RCEIL) in each integer mode, and the transposed read of a bf16
  operand (the dW GEMM's).
* ``qkv_rope_norm_gemm_sm90_kernel`` (Gluon, ``ops/qkv_rope_norm_gemm``; sm_90 only: wgmma, setmaxnreg):
  the launcher's tile (``TILE``, maxnreg ``MAXNREG``), head_dim 128, bf16/fp16, either norm position,
  weighted or not, pairwise with its integer arguments' specialisations by group (``GEMM_INT_AXES``);
  beside them the plain GEMM (FUSE off), one token of one query and one key head, 16-row norm chunks
  with fp32 norm weights, a 4-stage ring, the LoRA kernel, and the FP8 build (``SCALES``: e4m3 operands
  at the FP8 K step, rowwise and tensorwise scales; FP8 plans' activations are bf16). A Gluon
  kernel compiles from a ``GluonASTSource``; its descriptors' types (the shared layout included) are
  the launcher's, mangled as the JIT does. Its jobs name the Triton they compile under
  (``GEMM_TRITON``, the one the Gluon gate admits: ``--triton``, a child process of its own), except
  three under the Triton imported here (label ``current-triton``; one of them the FP8 build): an early
  warning where Gluon's API moves (Triton 3.8 renamed the TMA copies, 3.9 removed the old names).

Head dims: 64, 128, 256, 80 (HALF not a power of two: padded tiles, no TMA) and 2 (the
smallest the validation accepts). Dtypes: bf16, fp16, fp32 activations; fp32 norm weights
beside 16-bit activations.

The constexpr axes of each kernel, the compile target among them, are covered pairwise (every pair
of values of any two axes that the launchers can select together in at least one job: each target
with every value of every other axis, TMA layouts and products on the targets that have them), each
job compiled to a cubin. The covers are greedy (each row the best of 400 sampled rows), each with a
seed picked for few rows: at or within a few rows of the lower bound, the largest product of two
axes' sizes (the plain stage's mode x layout: 36 rows for 30 pairs). Beside them, the
configurations named in the job lists (as 091 launches them, fp32 norm weights). On top, each
kernel's base configurations are compiled to Triton IR with every integer argument, one at a time,
the constant 1.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
import traceback

HEAD_DIMS = (64, 128, 256, 80, 2)
DTYPES = ("bf16", "fp16", "fp32")
INT_MODES = ("plain", "div16", "ones", "i64")
H200_SMS = 132
# compile targets: Ampere, Hopper, datacenter Blackwell (sm_100a) and consumer Blackwell (sm_120a)
TARGETS = (80, 90, 100, 120)
# the Triton products (TMA + programmatic dependent launch) run on Hopper and datacenter Blackwell
PRODUCT_TARGETS = (90, 100)
# The pairwise covers of the stage, forward and finish families: on sm_90 through Triton's target passes
# to TritonGPU IR (layouts, pipelining, the TMA lowering: where a target refuses a configuration), on the
# others the front end to Triton IR; neither runs LLVM and ptxas (~55 % of a compile), which follow the
# tiles and dtypes rather than the constexpr pairs: the launchers' corners of each family (corner_jobs:
# the widest dtype at the largest head dim, the odd head dim, head_dim 2, a variant, the TMA tiles) go
# to cubins on the product targets, and so through sm_100a's target passes too (every stage layout,
# both TMA ones included, every dtype, the 091 and training modes). (Every cover row to a cubin cost
# ~800 s of CPU on an AVX2-only 2-core host: NOTES, session 18; sm_100a's covers to TritonGPU IR ~30 s
# more: session 20.)
COVER_LEVELS = {80: "ttir", 90: "ttgir", 100: "ttir", 120: "ttir"}
# On sm_80 and sm_120a (no Triton products) the corners but one per family stop at TritonGPU IR: a cubin
# per family and target shows their LLVM and ptxas; the stage's is 091's (named_jobs)
CORNER_CUBIN = {"forward": "d256"}


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def finish_rows(d: int) -> int:
    """The launchers' rows per step of a norm-weight finish at head_dim d (ops/rope_qk_norm)."""
    from fusedqkv.ops.rope_qk_norm import finish_rows as rows

    return rows(d)


# ------------------------------------------------------------------------------ pairwise cover


def pairwise(axes: dict, valid=lambda row: True, seed: int = 0, tries: int = 400) -> list:
    """Rows (dicts axis -> value) such that every pair of values of any two axes that some valid
    row holds appears in at least one row (greedy: each row the best of ``tries`` sampled valid
    rows; deterministic for a seed)."""
    names = list(axes)
    rng = random.Random(seed)
    every = [dict(zip(names, vals)) for vals in itertools.product(*(axes[n] for n in names))]
    every = [r for r in every if valid(r)]
    ids: dict = {}  # pair -> a small int: the rows' pair sets as sets of ints
    rows_pairs = [{ids.setdefault(((a, r[a]), (b, r[b])), len(ids)) for a, b in itertools.combinations(names, 2)}
                  for r in every]
    todo = set(ids.values())
    rows = []
    while todo:
        best, gain = None, 0
        for i in rng.sample(range(len(every)), min(tries, len(every))):
            g = len(rows_pairs[i] & todo)
            if g > gain:
                best, gain = i, g
        if best is None:  # the sample missed: take a row holding some uncovered pair
            # the smallest uncovered pair, not next(iter(todo)): a set's order may follow the string hash seed
            (a, va), (b, vb) = min(p for p, i in ids.items() if i in todo)
            best = next(i for i, r in enumerate(every) if r[a] == va and r[b] == vb)
        rows.append(every[best])
        todo -= rows_pairs[best]
    return rows


# ------------------------------------------------------------------------------------ the jobs


def _tt(dt: str) -> str:
    return {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dt]


# the block's variants (issue 25) as the training launchers build them (ops/gqa_forward.Variant); rot as a
# function of head_dim (partial rotary at half or a quarter of it)
VARIANTS = {
    "plain": dict(),
    "unweighted": dict(norm_weight=False),
    "partial": dict(rot=2),
    "interleaved": dict(interleaved=True),
    "partial_interleaved": dict(rot=4, interleaved=True),
    "gate": dict(q_gate=True, rot=4),
    "v_norm": dict(v_norm=True),
    "k_eq_v": dict(v_norm=True, k_eq_v=True),
    "all_heads": dict(all_heads=True),
    "all_heads_partial": dict(all_heads=True, rot=4),
    "all_heads_combo": dict(all_heads=True, norm_weight=False, q_gate=True, v_norm=True, interleaved=True, rot=2),
}


def variant_of(name: str, d: int):
    """The launchers' :class:`Variant` of a variant name at head_dim d, or None where it does not exist
    (a partial rotary width that is not an even size below head_dim)."""
    from fusedqkv.ops.gqa_forward import Variant

    kw = dict(VARIANTS[name])
    if "rot" in kw:
        rot = d // kw["rot"]
        rot -= rot % 2
        if not 2 <= rot < d:
            return None
        kw["rot"] = rot
    return Variant(**kw)


def _qk_variant(v) -> bool:
    """The variants that take the query/key heads through the variant path (no TMA, no register cap)."""
    return bool(v.rot or v.interleaved or not v.norm_weight or v.q_gate)


def _stage_job(cc, mode, layout, d, dtype, heads, ints, norm_fp32=False, level="cubin", one=None, variant="plain",
               amax=""):
    """One compile of ``rope_qk_norm_bwd_kernel``; ``amax``: dQKV's amax partials for the FP8 dual cast
    ("rows", "rows+cols"; "" none: the pointers None, as the launcher passes them)."""
    var = variant_of(variant, d)
    exact = mode.startswith("091")
    nar = mode in ("091", "091_finish_outside", "train_after", "train_after_nocs")
    gcs = exact or not mode.endswith("_nocs")
    fused = mode != "091_finish_outside" and var.norm_weight
    hq, hkv = heads
    block_t, gsize, tma = STAGE_LAYOUTS[layout]
    grouped = gsize > 0
    num_warps = max(1, min(16, block_t * _p2(d // 2) // 128))
    act = _tt(dtype)
    norm = "fp32" if norm_fp32 else act
    rstd = act if exact else "fp32"  # training: rstd recomputed, an fp32 placeholder
    half = d // 2
    n_tick = (1 if grouped else 0) + (1 if fused else 0)
    consts = dict(D=d, D_P2=_p2(d), BLOCK_T=block_t, HB=1, EXACT=exact,
                  NORM_AFTER_ROPE=nar, SAVED_ROTATED=exact, GRAD_COS_SIN=gcs, FUSED_FINISH=fused,
                  SUPER=finish_rows(d),
                  RECOMPUTE_RSTD=not exact, PF=3, GROUPED=grouped,
                  NQG=-(-hq // gsize) if grouped else 1, NKG=-(-hkv // gsize) if grouped else 1,
                  GSIZE=max(gsize, 1), TMA=tma, LP2=cc >= 90, **var.constexprs(d),
                  ROW_AMAX=amax.startswith("rows"), COL_AMAX=amax.endswith("cols"))
    types = {}
    for n in ("gq_ptr", "gk_ptr", "gv_ptr", "xq_ptr", "xk_ptr", "cos_ptr", "sin_ptr", "dqkv_ptr", "gcos_ptr",
              "gsin_ptr", "gg_ptr", "xv_ptr"):
        types[n] = "*" + act
    for n in ("rq_ptr", "rk_ptr"):
        types[n] = "*" + rstd
    for n in ("wq_ptr", "wk_ptr", "gwq_ptr", "gwk_ptr"):
        types[n] = "*" + norm if var.norm_weight else "*fp32"  # unweighted: w_part stands in
    for n in ("wpart_ptr", "wsup_ptr", "cs_ptr", "wgrp_ptr"):
        types[n] = "*fp32"
    types["tick_ptr"] = "*i32" if n_tick else "*fp32"  # no tickets: w_part stands in
    for n in ("gq_desc", "xq_desc", "gk_desc", "xk_desc"):
        types[n] = f"tensordesc<{act}[1, 1, {block_t}, {half}]>" if tma else "*" + act
    types["eps"] = "fp32"
    none_args = []
    for n, on in (("arow_ptr", consts["ROW_AMAX"]), ("acol_ptr", consts["COL_AMAX"])):
        if on:
            types[n] = "*" + act  # in dQKV's dtype
        else:
            none_args.append(n)
    options = {"num_warps": num_warps, "num_stages": 3, "enable_fp_fusion": not exact}
    if num_warps == 4 and not _qk_variant(var):
        options["maxnreg"] = 96 if grouped and block_t == 8 and not amax else 128
    label = (f"stage sm{cc} {mode} {layout} d{d} {dtype}{'/normfp32' if norm_fp32 else ''} "
             f"hq{hq}/hkv{hkv} ints={ints}{'' if variant == 'plain' else ' variant=' + variant}"
             f"{'' if one is None else ' one=' + one}{' amax=' + amax if amax else ''}")
    return dict(kernel="rope_qk_norm.rope_qk_norm_bwd_kernel", cc=cc, consts=consts, types=types, ints=ints,
                one=one, options=options, level=level, label=label, none_args=tuple(none_args))


# (tokens per block, heads per group or 0, TMA) of the stage's layouts (ops/rope_qk_norm._launch_config);
# above head_dim 256 the blocks of 8 tokens are 4 ("all4", "group16x4")
STAGE_LAYOUTS = {"all8": (8, 0, False), "all8_tma": (8, 0, True), "group16": (8, 16, False),
                 "group16_tma": (8, 16, True), "group8": (4, 8, False), "all4": (4, 0, False),
                 "group16x4": (4, 16, False)}


def _stage_valid(r):
    if r["layout"].endswith("_tma"):  # sm_90, head_dim/2 a power of two of >= 16 bytes
        es = 4 if r["dtype"] == "fp32" else 2
        half = r["d"] // 2
        return r["cc"] >= 90 and half & (half - 1) == 0 and half * es >= 16
    return True


STAGE_AXES = dict(
    cc=TARGETS,
    mode=("091", "091_finish_outside", "train_after", "train_after_nocs", "train_before", "train_before_nocs"),
    layout=("all8", "all8_tma", "group16", "group16_tma", "group8"),
    d=HEAD_DIMS,
    dtype=DTYPES,
    # NQG/NKG: 1/1 at any layout, 2/1 and 4/1 (GQA), 2/2 and 3/3 (MHA) in groups of 16 and of 8 heads
    # (hq = hkv = 7 gave the constexprs of (1, 1) at every layout)
    heads=((1, 1), (32, 8), (24, 24)),
    ints=INT_MODES,
)


def _variant_stage_valid(r):
    v = variant_of(r["variant"], r["d"])
    if v is None:
        return False
    if r["layout"].endswith("_tma") and _qk_variant(v):
        return False
    return _stage_valid(r)


# the per-head variants: training modes only, their layouts; partial rotary alone and with interleaved
# pairs are the gate's code (the same constexprs), left out to keep the CPU time of the suite down
VARIANT_STAGE_AXES = dict(
    cc=TARGETS,
    variant=("unweighted", "interleaved", "gate", "v_norm"),
    mode=("train_after", "train_after_nocs", "train_before", "train_before_nocs"),
    layout=("all8", "all8_tma", "group16", "group8"),
    d=(128, 80),
    dtype=DTYPES,
    heads=((32, 8), (7, 7)),
    ints=("plain", "ones", "i64"),
)


ALL_HEADS_VARIANTS = ("all_heads", "all_heads_partial", "all_heads_combo")


def stage_jobs() -> list:
    jobs = [_stage_job(**r) for r in pairwise(STAGE_AXES, _stage_valid, seed=27)]
    jobs += [_stage_job(**r) for r in pairwise(VARIANT_STAGE_AXES, _variant_stage_valid, seed=2)]
    return jobs


def named_jobs() -> list:
    """Configurations named for what they check, to cubins."""
    # 091 as launched at few tokens, sm_80 (fp32 math and a cast) and sm_90 (bf16x2 pairs)
    jobs = [_stage_job(cc, "091", "group8", 128, "bf16", (32, 8), "plain") for cc in TARGETS]
    # 091 with fp32 norm weights beside bf16 activations (the weights' dtype is free)
    jobs.append(_stage_job(90, "091", "group8", 128, "bf16", (32, 8), "plain", norm_fp32=True))
    jobs.append(_stage_job(90, "train_after", "all8_tma", 128, "bf16", (32, 8), "div16", norm_fp32=True))
    jobs.append(_stage_job(90, "train_before", "group16", 128, "bf16", (32, 8), "plain", norm_fp32=True,
                           variant="gate"))
    jobs.append(_fwd_job(90, 128, "bf16", 8, True, "plain", norm_fp32=True))
    return jobs


def _fwd_job(cc, d, dtype, group, nar, ints, norm_fp32=False, level="cubin", one=None, variant="plain",
             heads=(32, 8)):
    from fusedqkv.ops.variant import all_heads_warps

    var = variant_of(variant, d)
    act = _tt(dtype)
    norm = "fp32" if norm_fp32 else act
    block_t = 1 if var.all_heads else max(1, min(32, 1024 // _p2(d // 2)))
    consts = dict(D=d, BLOCK_T=block_t, GROUP=group, NORM_AFTER_ROPE=nar, D_P2=_p2(d), **var.constexprs(d),
                  ALL_HEADS=var.all_heads, **var.head_tiles(*heads), K_EQ_V=var.k_eq_v)
    warps = all_heads_warps(*heads, var.rotary(d) // 2, 32) if var.all_heads else (8 if group == 8 else 4)
    types = {n: "*" + act for n in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr")}
    types.update({n: "*" + norm if var.norm_weight else "*" + act for n in ("wq_ptr", "wk_ptr")})
    types.update({n: "*fp32" for n in ("rq_ptr", "rk_ptr")})
    types["eps"] = "fp32"
    label = (f"forward sm{cc} d{d} {dtype} group{group} nar={nar} ints={ints}"
             f"{'' if variant == 'plain' else ' variant=' + variant}"
             f"{f' hq{heads[0]}/hkv{heads[1]}' if var.all_heads else ''}{'' if one is None else ' one=' + one}")
    return dict(kernel="rope_qk_norm_fwd.rope_qk_norm_fwd_kernel", cc=cc, consts=consts, types=types, ints=ints,
                one=one, options={"num_warps": warps}, level=level, label=label)


def forward_jobs() -> list:
    axes = dict(cc=TARGETS, d=HEAD_DIMS, dtype=DTYPES, group=(1, 2, 4, 8), nar=(True, False), ints=INT_MODES)
    jobs = [_fwd_job(**r) for r in pairwise(axes, seed=2)]
    # the per-head variants of the stage's cover (partial rotary alone and with interleaved pairs: the
    # gate's constexprs, PASS > 0 with and without INTERLEAVED) and the all-heads ones at two head sets
    variant_axes = dict(cc=TARGETS, variant=VARIANT_STAGE_AXES["variant"] + ALL_HEADS_VARIANTS, d=(128, 80, 64),
                        dtype=DTYPES, group=(1, 4), nar=(True, False), ints=INT_MODES, heads=((32, 8), (32, 32)))
    jobs += [_fwd_job(**r) for r in pairwise(variant_axes, lambda r: variant_of(r["variant"], r["d"]) is not None,
                                             seed=7)]
    return jobs


def _stage_all_heads_job(cc, variant, d, dtype, heads, nar, gcs, stages, ints, level="cubin", one=None):
    """One compile of ``rope_qk_norm_bwd_all_heads_kernel`` as ``_plan_all_heads_stage`` launches it."""
    from fusedqkv.ops.variant import all_heads_warps

    var = variant_of(variant, d)
    hq, hkv = heads
    act = _tt(dtype)
    consts = dict(D=d, D_P2=_p2(d), PF=stages, NORM_AFTER_ROPE=nar, GRAD_COS_SIN=gcs, **var.constexprs(d),
                  **var.head_tiles(hq, hkv))
    types = {n: "*" + act for n in ("gq_ptr", "gk_ptr", "gv_ptr", "xq_ptr", "xk_ptr", "cos_ptr", "sin_ptr",
                                    "dqkv_ptr", "gcos_ptr", "gsin_ptr", "gg_ptr", "xv_ptr", "wq_ptr", "wk_ptr")}
    types["wpart_ptr"] = "*fp32" if var.norm_weight else "*" + act  # unweighted: gq stands in
    types["eps"] = "fp32"
    label = (f"stage_all_heads sm{cc} {variant} d{d} {dtype} hq{hq}/hkv{hkv} nar={nar} gcs={gcs} stages={stages} "
             f"ints={ints}{'' if one is None else ' one=' + one}")
    return dict(kernel="rope_qk_norm.rope_qk_norm_bwd_all_heads_kernel", cc=cc, consts=consts, types=types, ints=ints,
                one=one, options={"num_warps": all_heads_warps(hq, hkv, var.rotary(d) // 2, 8)}, level=level,
                label=label)


def stage_all_heads_jobs() -> list:
    axes = dict(cc=TARGETS, variant=ALL_HEADS_VARIANTS, d=(128, 80),
                dtype=DTYPES, heads=((32, 32), (7, 3)), nar=(True, False), gcs=(True, False), stages=(1, 3),
                ints=INT_MODES)
    return [_stage_all_heads_job(**r) for r in pairwise(axes, lambda r: variant_of(r["variant"], r["d"]) is not None,
                                                        seed=11)]


def _finish_job(cc, d, dtype, ints, level="cubin", one=None):
    consts = dict(D=d, D_P2=_p2(d), BLOCK_R=finish_rows(d))
    types = {"wpart_ptr": "*fp32", "gwq_ptr": "*" + _tt(dtype), "gwk_ptr": "*" + _tt(dtype)}
    return dict(kernel="rope_qk_norm.rope_qk_norm_bwd_finish_kernel", cc=cc, consts=consts, types=types, ints=ints,
                one=one, options={"num_warps": 4}, level=level,
                label=f"finish sm{cc} d{d} {dtype} ints={ints}{'' if one is None else ' one=' + one}")


def finish_jobs() -> list:
    axes = dict(cc=TARGETS, d=HEAD_DIMS, dtype=DTYPES, ints=INT_MODES)
    return [_finish_job(**r) for r in pairwise(axes, seed=0)]


def _finish_cols_job(cc, dtype, ints, level="cubin", one=None):
    """``rope_qk_norm_bwd_finish_cols_kernel`` (``AllHeadsNormWeightFinish``): BLOCK_R 16, BLOCK_C 128, 4 warps."""
    types = {"wpart_ptr": "*fp32", "gwq_ptr": "*" + _tt(dtype), "gwk_ptr": "*" + _tt(dtype)}
    return dict(kernel="rope_qk_norm.rope_qk_norm_bwd_finish_cols_kernel", cc=cc, consts=dict(BLOCK_R=16, BLOCK_C=128),
                types=types, ints=ints, one=one, options={"num_warps": 4}, level=level,
                label=f"finish_cols sm{cc} {dtype} ints={ints}{'' if one is None else ' one=' + one}")


def finish_cols_jobs() -> list:
    axes = dict(cc=TARGETS, dtype=DTYPES, ints=INT_MODES)
    return [_finish_cols_job(**r) for r in pairwise(axes, seed=0)]


# (tile rows, cols, K step, warps, stages, programs per SM) as in ops/projection
CHAIN_DX = (64, 64, 64, 4, 6, 1)
CHAIN_DW = (128, 128, 64, 8, 2, 1)
CHAIN_DX_ABOVE_128 = (64, 64, 64, 4, 6, 2)
CHAIN_DW_ABOVE_128 = (128, 128, 32, 4, 4, 2)
HYBRID_DW = (128, 128, 32, 4, 5, 2)
MATMUL_USES = {
    # use: (config, TRANS_A, TRIGGER, WAIT_AT_END)
    "chain_dx": (CHAIN_DX, False, True, False),
    "chain_dw": (CHAIN_DW, True, False, True),
    "chain_dx_above128": (CHAIN_DX_ABOVE_128, False, True, False),
    "chain_dw_above128": (CHAIN_DW_ABOVE_128, True, False, True),
    "hybrid_dw": (HYBRID_DW, True, False, False),
}


def _matmul_job(use, dtype, finish, nprog, ints, fin_d=128, norm_fp32=False, level="cubin", one=None, cc=90):
    (br, bc, bk, warps, stages, per_sm), trans_a, trigger, wait_at_end = MATMUL_USES[use]
    finish = finish and use.endswith("dw")  # only dW runs the norm-weight finish
    nprog = {"one": 1, "sms": H200_SMS, "per_sm": per_sm * H200_SMS}[nprog]
    act = _tt(dtype)
    consts = dict(BR=br, BC=bc, BK=bk, TRANS_A=trans_a, NPROG=nprog, PDL=True, TRIGGER=trigger,
                  WAIT_AT_END=wait_at_end, FINISH=finish, FIN_D=fin_d if finish else 1,
                  FIN_D_P2=_p2(fin_d) if finish else 1, FIN_ROWS=finish_rows(fin_d) if finish else 1)
    norm = "fp32" if norm_fp32 else act
    types = {"a_desc": f"tensordesc<{act}[{bk}, {br}]>" if trans_a else f"tensordesc<{act}[{br}, {bk}]>",
             "b_desc": f"tensordesc<{act}[{bk}, {bc}]>", "c_desc": f"tensordesc<{act}[{br}, {bc}]>",
             "fin_part_ptr": "*fp32" if finish else "*" + act,
             "fin_gwq_ptr": "*" + norm if finish else "*" + act, "fin_gwk_ptr": "*" + norm if finish else "*" + act}
    label = (f"tma_matmul sm{cc} {use} {dtype} finish={finish} fin_d{fin_d} nprog={nprog} ints={ints}"
             f"{'' if one is None else ' one=' + one}")
    return dict(kernel="projection_grads.tma_matmul_kernel", cc=cc, consts=consts, types=types, ints=ints, one=one,
                options={"num_warps": warps, "num_stages": stages}, level=level, label=label)


def matmul_jobs() -> list:
    axes = dict(use=tuple(MATMUL_USES), dtype=("bf16", "fp16"), finish=(True, False), nprog=("one", "sms", "per_sm"),
                ints=INT_MODES, cc=PRODUCT_TARGETS)
    jobs = [_matmul_job(**r) for r in pairwise(axes, seed=2)]
    jobs += [_matmul_job("hybrid_dw", "bf16", True, "per_sm", "plain", cc=cc) for cc in PRODUCT_TARGETS]  # as 091 launches it
    jobs.append(_matmul_job("hybrid_dw", "bf16", True, "per_sm", "div16", fin_d=80, norm_fp32=True))
    jobs.append(_matmul_job("chain_dw", "fp16", True, "sms", "plain", fin_d=256))
    return jobs


def _flush_job(ints, level="cubin", one=None, cc=90):
    return dict(kernel="l2_flush.l2_flush_kernel", cc=cc, consts=dict(BLOCK=4096), types={"buf_ptr": "*i32"},
                ints=ints, one=one, options={"num_warps": 4}, level=level,
                label=f"l2_flush sm{cc} ints={ints}{'' if one is None else ' one=' + one}")


# the Gluon forward GEMM (ops/qkv_rope_norm_gemm): sm_90 only (wgmma, setmaxnreg), head_dim 128. Its jobs
# compile under GEMM_TRITON, the Triton the plan runs it with, in a child process of their own
# (test_gpu_targets), and two under the Triton imported (Gluon's API moves between releases).
GEMM_TRITON = "3.6.0"  # the Triton the kernel was validated with on the GPU
GEMM_KERNEL = "qkv_rope_norm_gemm_sm90.qkv_rope_norm_gemm_sm90_kernel"
# the JIT's specialisations of the integer arguments, by group (each job's ``int_spec``)
GEMM_INT_AXES = dict(
    # the norm weights', rstd's position and cos/sin's column strides: always 1 (a constexpr): the plan takes
    # the kernel only for unit last strides (others spill)
    units=("one",),
    # rstd's batch/head and cos/sin's batch/position strides, and M, K, S, HQ, HKV (N = heads * 128: "D")
    ints=("plain", "div16"),
)
GEMM_UNITS = ("swq", "swk", "srq_s", "srk_s", "scos_d", "ssin_d")
GEMM_INTS = ("srq_b", "srq_h", "srk_b", "srk_h", "scos_b", "scos_s", "ssin_b", "ssin_s", "M", "K", "S", "HQ", "HKV")
# one token of one query and one key head: M = S = HQ = HKV = 1, and so rstd's head strides (S)
GEMM_ONE_TOKEN = ("M", "S", "HQ", "HKV", "srq_h", "srk_h")


def _gemm_job(dtype, fuse, nar, nw, units, ints, one_token=False, norm_fp32=False, level="cubin", one=None,
              triton=GEMM_TRITON, lora=False, scales=0, **tile):
    """One compile of ``qkv_rope_norm_gemm_sm90_kernel`` as ``FusedGemmForward`` launches it (``tile``:
    overrides of the launcher's ``TILE``; ``triton`` None: under the Triton imported; ``lora``: with
    LoRA adapters' U and B descriptors, their rank sum R an integer of the ``ints`` mode; ``scales``:
    the FP8 build, e4m3 x and W at the launcher's FP8 K step, fp32 scale pointers)."""
    from fusedqkv.ops.qkv_rope_norm_gemm import CONSUMER_REGS, FP8_BK, MAXNREG, PRODUCER_REGS, TILE

    t = {**TILE, **({"BK": FP8_BK} if scales else {}), **tile}
    consts = dict(BM=t["BM"], BN=128, BK=t["BK"], GROUP_M=t["GROUP_M"], STAGES=t["STAGES"], FUSE=fuse,
                  NORM_AFTER_ROPE=nar, NORM_WEIGHT=nw, RC=t["RC"], LORA=lora, SCALES=scales,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    act = _tt(dtype)
    norm = "*fp32" if norm_fp32 and nw else "*" + act  # unweighted: q stands in
    types = dict(wq_ptr=norm, wk_ptr=norm, rq_ptr="*fp32", rk_ptr="*fp32", cos_ptr="*" + act, sin_ptr="*" + act)
    if scales:
        types.update(xs_ptr="*fp32", ws_ptr="*fp32")
    spec = {n: {"one": "1", "plain": "i32"}[units] for n in GEMM_UNITS}
    spec.update({n: {"plain": "i32", "div16": "D"}[ints] for n in GEMM_INTS}, N="D")
    spec["R"] = {"plain": "i32", "div16": "D"}[ints] if lora else "D"
    if one_token:
        spec.update({n: "1" for n in GEMM_ONE_TOKEN})
    tiles = " ".join(f"{k}{t[k]}" for k in TILE)
    label = (f"gemm_sm90 sm90 {dtype}{'/normfp32' if norm_fp32 else ''} fuse={fuse} nar={nar} nw={nw} {tiles} "
             f"units={units} ints={ints}{' one_token' if one_token else ''}{'' if one is None else ' one=' + one}"
             f"{' lora' if lora else ''}{f' fp8 scales={scales}' if scales else ''}"
             f"{'' if triton else ' current-triton'}")
    none_args = (() if lora else ("u_desc", "b_desc")) + (() if scales else ("xs_ptr", "ws_ptr"))
    return dict(kernel=GEMM_KERNEL, cc=90, consts=consts, types=types, ints=ints, int_spec=spec,
                int_axes=dict(units=units, ints=ints), one_token=one_token, desc_types="_gemm_desc_types",
                dtype=dtype, options={"num_warps": 4, "maxnreg": MAXNREG}, level=level, label=label, one=one,
                triton=triton, none_args=none_args)  # no adapters, no FP8 scales: None arguments


def _gemm_desc_types(job) -> dict:
    """The descriptors' types as the JIT mangles the launcher's (made in the compiling process: the
    layouts spelt by the Triton in use)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from fusedqkv.ops.qkv_rope_norm_gemm import layouts

    c = job["consts"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[job["dtype"]]
    operands = torch.float8_e4m3fn if c["SCALES"] else dtype
    x_l, w_l, o_l = layouts(dtype, c["BM"], c["BN"], c["BK"], operands)
    t, a = torch.empty(256, 256, dtype=dtype), torch.empty(256, 256, dtype=operands)
    half = [c["BM"], c["BN"] // 2]
    descs = dict(x_desc=(a, [c["BM"], c["BK"]], x_l), w_desc=(a, [c["BN"], c["BK"]], w_l), qkv_desc=(t, half, o_l),
                 q_desc=(t, half, o_l), k_desc=(t, half, o_l))
    if c["LORA"]:  # U and B: x's and W's boxes
        descs.update(u_desc=descs["x_desc"], b_desc=descs["w_desc"])
    return {n: mangle_type(TensorDescriptor.from_tensor(u, block, layout)) for n, (u, block, layout) in descs.items()}


# the fused GEMM's axes, covered pairwise by 5 rows (the greedy cover took 6, each a ~6 s cubin under the
# pinned Triton): 4 two-valued axes need 5 (a strength-2 covering array: one row and the four at Hamming
# distance 3 from it); the rows include the known spill (fp16, norm before RoPE, weighted, plain ints: a row of
# the greedy cover too, as are two others). test_gpu_targets checks that every pair is covered.
GEMM_AXES = dict(dtype=("bf16", "fp16"), nar=(True, False), nw=(True, False), **GEMM_INT_AXES)
GEMM_COVER = (("bf16", True, False, "one", "plain"), ("bf16", False, True, "one", "div16"),
              ("fp16", True, True, "one", "div16"), ("fp16", False, False, "one", "div16"),
              ("fp16", False, True, "one", "plain"))


def uncovered_pairs(rows: list, axes: dict) -> list:
    """The pairs of values of two axes that no row holds (rows: dicts axis -> value)."""
    return [((a, va), (b, vb)) for a, b in itertools.combinations(axes, 2) for va in axes[a] for vb in axes[b]
            if not any(r[a] == va and r[b] == vb for r in rows)]


def gemm_jobs() -> list:
    rows = [dict(zip(GEMM_AXES, r)) for r in GEMM_COVER]
    jobs = [_gemm_job(fuse=True, **r) for r in rows]
    jobs.append(_gemm_job("bf16", False, True, True, "one", "div16"))  # the plain GEMM (benchmarks)
    jobs.append(_gemm_job("bf16", True, False, True, "one", "plain", one_token=True))
    jobs.append(_gemm_job("bf16", True, True, True, "one", "div16", norm_fp32=True, RC=16))  # a smaller chunk
    jobs.append(_gemm_job("fp16", True, False, False, "one", "plain", STAGES=4))  # a shallower ring
    # LoRA adapters in the GEMM (the training forward's LoRA plans; the producer's extra K steps are the same
    # code whatever the epilogue, which the rows above cover): one cubin
    jobs.append(_gemm_job("bf16", True, True, True, "one", "div16", lora=True))
    # the FP8 build (FP8 plans: bf16 activations, e4m3 codes, the scales in the epilogue): rowwise with 091's
    # norm position and weights, tensorwise with Qwen3's (the known spill's row), both with plain ints (the
    # most registers); the epilogue's code after the rounding is the 16-bit rows'
    jobs.append(_gemm_job("bf16", True, True, True, "one", "plain", scales=1))
    jobs.append(_gemm_job("bf16", True, False, True, "one", "plain", scales=2))
    # under the Triton this process imports (outside the Gluon gate: an early warning of Gluon's API moving;
    # the kernel's TMA names follow the release), to TritonGPU IR: Gluon's front end, where a renamed or
    # removed name fails (the cubins, their shared memory and spills, are the pinned Triton's above)
    for fuse in (True, False):
        jobs.append(_gemm_job("bf16", fuse, True, True, "one", "div16", triton=None, level="ttgir"))
    jobs.append(_gemm_job("bf16", True, True, True, "one", "div16", triton=None, level="ttgir", scales=1))
    return jobs


# the FP8 casts (ops/fp8.py, kernels/fp8_cast.py): FP8 GEMMs from sm_89 on, so the Hopper and Blackwell targets;
# the launchers' tiles (ROWS 4 x BLOCK_C 1024, or one whole row of up to 8192; 128 x 64 tiles, 64 partial rows a step), both FP8 formats
FP8_TARGETS = (90, 100, 120)
FP8_KERNELS = {
    "fp8_rowwise": ("rowwise_cast_kernel", dict(ROWS=4, BLOCK_C=1024, WHOLE_ROW=False), ("x_ptr", "y_ptr", "inv_ptr")),
    "fp8_rowwise_whole": ("rowwise_cast_kernel", dict(ROWS=1, BLOCK_C=8192, WHOLE_ROW=True),
                          ("x_ptr", "y_ptr", "inv_ptr")),
    # the rowwise cast of x that also stores its column amaxes' partials (ops/fp8.input_cast_keeping_amax):
    # 16 rows per program, one whole row of 4096 at a time (8 warps) or 16 rows in 256-column chunks
    "fp8_rowwise_colamax": ("rowwise_cast_colamax_kernel",
                            dict(PART_ROWS=16, ROWS=16, BLOCK_C=256, WHOLE_ROW=False),
                            ("x_ptr", "y_ptr", "inv_ptr", "cpart_ptr")),
    "fp8_rowwise_colamax_whole": ("rowwise_cast_colamax_kernel",
                                  dict(PART_ROWS=16, ROWS=1, BLOCK_C=4096, WHOLE_ROW=True),
                                  ("x_ptr", "y_ptr", "inv_ptr", "cpart_ptr")),
    "fp8_tile_amax": ("tile_amax_kernel", dict(BR=128, BC=64), ("x_ptr", "part_ptr")),
    "fp8_cast": ("cast_kernel", dict(BR=128, BC=64, BP=64), ("x_ptr", "y_ptr", "part_ptr", "inv_ptr")),
    "fp8_outer_scale": ("outer_scale_kernel", dict(BR=128, BC=64), ("y_ptr", "a_ptr", "b_ptr")),
    # session 24: the rowwise cast from row amax partials found beforehand (the stage's, in x's dtype)
    "fp8_rowwise_parts": ("rowwise_cast_parts_kernel", dict(BR=128, BC=64, BP=16),
                          ("x_ptr", "y_ptr", "part_ptr", "inv_ptr")),
    # session 21: dQKV's two casts from one amax pass, a finish and one cast pass (ops/fp8._dual_triton)
    "fp8_dual_amax": ("dual_amax_kernel", dict(BR=128, BC=64), ("x_ptr", "rpart_ptr", "cpart_ptr")),
    "fp8_dual_finish": ("dual_finish_kernel", dict(FB=128, BP=64, FBC=128, BPC=64),
                        ("rpart_ptr", "cpart_ptr", "rscale_ptr", "rinv_ptr", "cscale_ptr", "cinv_ptr")),
    "fp8_dual_cast": ("dual_cast_kernel", dict(BR=128, BC=64),
                      ("x_ptr", "yr_ptr", "yt_ptr", "rscale_ptr", "cscale_ptr", "tamax_ptr", "rinv_ptr", "cinv_ptr")),
}
_FP8_DUAL = ("fp8_dual_amax", "fp8_dual_finish", "fp8_dual_cast")
_FMAX = {"fp8e4nv": 448.0, "fp8e5": 57344.0}


# the LoRA block builder (ops/lora.block_b, kernels/lora_blocks.py): sm_90 and sm_100a (the GPUs the LoRA
# block is measured on), each integer mode once, the pair counts and both WRITE_ZEROS values, the
# launcher's BLOCK_M and its two BLOCK_R ends (a rank sum of 16 and >= 64), bf16/fp16/fp32 B and blocks
# (fp32 B into a bf16 block: autocast's fp32 adapters); unused pairs' pointers are the block's
LORA_BLOCK_JOBS = [  # (cc, B dtype, block dtype, N_PAIRS, WRITE_ZEROS, BLOCK_R, ints)
    (90, "bf16", "bf16", 3, True, 64, "plain"),
    (90, "fp32", "bf16", 4, False, 16, "div16"),
    (100, "fp16", "fp16", 1, True, 64, "ones"),
    (100, "fp32", "fp32", 2, True, 16, "i64"),
]


def _lora_block_job(cc, b_dtype, dtype, n_pairs, write_zeros, block_r, ints, level="cubin", one=None):
    types = {"out_ptr": "*" + dtype, **{f"b{k}_ptr": "*" + (b_dtype if k < n_pairs else dtype) for k in range(4)}}
    return dict(kernel="lora_blocks.lora_block_kernel", cc=cc, types=types, ints=ints, one=one, level=level,
                consts=dict(N_PAIRS=n_pairs, WRITE_ZEROS=write_zeros, BLOCK_M=64, BLOCK_R=block_r),
                options={"num_warps": 4},
                label=f"lora_block sm{cc} {b_dtype}->{dtype} pairs={n_pairs} zeros={write_zeros} r{block_r} "
                      f"ints={ints}{'' if one is None else ' one=' + one}")


def lora_block_jobs() -> list:
    return [_lora_block_job(*row) for row in LORA_BLOCK_JOBS]


# the mxfp8 recipe's cast (ops/fp8.mx_cast_triton, kernels/mx_cast.py; session 24, issue 35): sm_100a only (the MX
# GEMMs are Blackwell's; the recipe is refused below sm_100): the launcher's tile and the hardware's e4m3 cast,
# each integer mode, and a bf16 operand read transposed (the dW GEMM's, stride_xr the constant 1: the load's
# layout converted for the row-major stores; the row casts are the same code with stride_xc 1)
MX_CAST_TILE = dict(BR=32, BC=128)


def _mx_cast_job(ints, one=None, level="cubin", rceil=False):
    what = "transposed" if one == "stride_xr" else "rows"
    return dict(kernel="mx_cast.mx_cast_kernel", cc=100,
                consts=dict(FP8_MAX=448.0, SOFT_ROUND=False, RCEIL=rceil, **MX_CAST_TILE),
                types={"x_ptr": "*bf16", "y_ptr": "*u8", "s_ptr": "*u8"}, ints=ints, one=one,
                options={"num_warps": 4}, level=level,
                label=f"mx_cast sm100 bf16->fp8e4nv {'rceil' if rceil else 'floor'} {what} ints={ints}"
                      f"{'' if one is None else ' one=' + one}")


def mx_cast_jobs(level="cubin") -> list:
    # each scale mode (mxfp8: FLOOR, mxfp8_rceil: RCEIL, session 26) in every integer mode (as every family),
    # then the transposed read the dW GEMM's operands take
    return [_mx_cast_job(ints, one, level, rceil) for rceil in (False, True)
            for ints, one in [*((m, None) for m in INT_MODES), ("div16", "stride_xr")]]


# QLoRA's one-launch NF4 dequantization (ops/dequant_4bit.py, kernels/dequant_4bit.py): sm_90 and sm_100a,
# each integer mode once, the part counts the integration builds (3: q/k/v; 2: [Q | K] of a shared K/V) and
# one, bitsandbytes' default blocksize and another, every output dtype; unused parts' pointers are part 0's
DEQUANT_4BIT_JOBS = [  # (cc, out dtype, N_PARTS, BLOCKSIZE, ints)
    (90, "bf16", 3, 64, "plain"),
    (90, "fp16", 2, 128, "div16"),
    (100, "bf16", 3, 64, "ones"),
    (100, "fp32", 1, 256, "i64"),
]


def _dequant_4bit_job(cc, dtype, n_parts, blocksize, ints, level="cubin", one=None):
    types = {"out_ptr": "*" + dtype, "code_ptr": "*fp32",
             **{f"q{k}_ptr": "*u8" for k in range(4)}, **{f"a{k}_ptr": "*fp32" for k in range(4)}}
    return dict(kernel="dequant_4bit.dequant_4bit_kernel", cc=cc, types=types, ints=ints, one=one, level=level,
                consts=dict(N_PARTS=n_parts, BLOCKSIZE=blocksize, BYTES=1024), options={"num_warps": 4},
                label=f"dequant_4bit sm{cc} {dtype} parts={n_parts} blocksize={blocksize} ints={ints}"
                      f"{'' if one is None else ' one=' + one}")


def dequant_4bit_jobs() -> list:
    return [_dequant_4bit_job(*row) for row in DEQUANT_4BIT_JOBS]


def _fp8_job(family, cc, ints, src="bf16", f8="fp8e4nv", pow2=True, per_column=True, transpose=True, level="cubin",
             one=None, row_per=True, col_per=True, f8_col=None):
    if family in _FP8_DUAL:
        return _fp8_dual_job(family, cc, ints, src, f8, f8_col or f8, pow2, row_per, col_per, level, one)
    name, consts, ptrs = FP8_KERNELS[family]
    consts = dict(consts)
    fmax = {"fp8e4nv": 448.0, "fp8e5": 57344.0}[f8]
    if family in ("fp8_rowwise", "fp8_rowwise_whole", "fp8_cast", "fp8_rowwise_colamax", "fp8_rowwise_colamax_whole",
                  "fp8_rowwise_parts"):
        consts.update(FP8_MAX=fmax, POW2=pow2)
    if family == "fp8_cast":
        consts.update(PER_COLUMN=per_column, TRANSPOSE=transpose)
    types = dict(x_ptr="*" + src, y_ptr="*" + (src if family == "fp8_outer_scale" else f8), inv_ptr="*fp32",
                 part_ptr="*" + (src if family == "fp8_rowwise_parts" else "fp32"), a_ptr="*fp32", b_ptr="*fp32",
                 cpart_ptr="*fp32")
    warps = 8 if family in ("fp8_rowwise_whole", "fp8_rowwise_colamax_whole") else 4
    return dict(kernel=f"fp8_cast.{name}", cc=cc, consts=consts, types={k: types[k] for k in ptrs}, ints=ints,
                one=one, options={"num_warps": warps}, level=level,
                label=f"{family} sm{cc} {src}->{f8} pow2={pow2} col={per_column} t={transpose} ints={ints}"
                      f"{'' if one is None else ' one=' + one}")


def _fp8_dual_job(family, cc, ints, src, f8, f8_col, pow2, row_per, col_per, level, one):
    name, consts, ptrs = FP8_KERNELS[family]
    consts = dict(consts)
    if family == "fp8_dual_amax":
        consts.update(ROW_PART=row_per)
    else:
        consts.update(ROW_PER=row_per, COL_PER=col_per, FP8_MAX_R=_FMAX[f8], FP8_MAX_C=_FMAX[f8_col], POW2=pow2)
    types = dict(x_ptr="*" + src, yr_ptr="*" + f8, yt_ptr="*" + f8_col)
    types = {k: types.get(k, "*fp32") for k in ptrs}
    return dict(kernel=f"fp8_cast.{name}", cc=cc, consts=consts, types=types, ints=ints, one=one,
                options={"num_warps": 4}, level=level,
                label=f"{family} sm{cc} {src}->{f8}/{f8_col} pow2={pow2} row={row_per} col={col_per} ints={ints}"
                      f"{'' if one is None else ' one=' + one}")


def fp8_jobs() -> list:
    jobs = []
    for family in FP8_KERNELS:
        axes = dict(cc=FP8_TARGETS, ints=INT_MODES, src=("bf16", "fp16", "fp32"), f8=("fp8e4nv", "fp8e5"),
                    pow2=(True, False))
        if family == "fp8_cast":
            axes.update(per_column=(True, False), transpose=(True, False))
        if family in _FP8_DUAL:  # the launcher's (per row or tensor) x (per column or tensor), each FP8 format
            axes.update(row_per=(True, False), col_per=(True, False), f8_col=("fp8e4nv", "fp8e5"))
            if family == "fp8_dual_amax":
                axes = dict(cc=FP8_TARGETS, ints=INT_MODES, src=axes["src"], row_per=(True, False))
        jobs += [_fp8_job(family, **r) for r in pairwise(axes, seed=3)]
    return jobs + fp8_weight_jobs() + fp8_input_amax_jobs()


# W's two casts as each recipe's forward makes them (fp8.weight_casts: a bf16 W, sizes in multiples of 16;
# the forward's side per row or the tensor's, the dX side per column or the tensor's, both e4m3): the
# exact specialisations the GPU runs, to sm_90 cubins (the pairwise covers above hold their pairs only)
FP8_WEIGHT_RECIPES = {"rowwise": (True, True, True), "rowwise_with_gw_hp": (True, False, True),
                      "tensorwise": (False, False, False)}  # row per axis, column per axis, pow2


def fp8_weight_jobs() -> list:
    jobs = []
    for name, (row_per, col_per, pow2) in FP8_WEIGHT_RECIPES.items():
        families = (["fp8_dual_amax"] if name != "rowwise_with_gw_hp" else []) + ["fp8_dual_cast"] \
            + (["fp8_dual_finish"] if row_per or col_per else [])  # (the amax: rowwise's specialisation)
        for family in families:
            j = _fp8_job(family, 90, "div16", pow2=pow2, row_per=row_per, col_per=col_per)
            jobs.append(dict(j, label=f"{j['label']} weight={name}"))
    return jobs


# dQKV's amax partials written by the backward stage (fp8.STAGE_AMAX; ops/rope_qk_norm.plan_backward_stage's
# row_amax/col_amax): the training stage's layouts as the FP8 recipes run them (rows and columns: rowwise and
# the per-column custom mixes; rows alone: tensorwise, and rowwise_with_gw_hp's or a frozen weight's row cast
# at 8-token blocks of every head, session 24), on the FP8 GEMMs' product targets, to cubins; the finish of the
# stage's partials (bf16, the column programs FBC 32 wide, BPC 256 partial rows a step) and the row cast from
# them (bf16 partials, e4m3, power-of-two scales)
STAGE_AMAX_TARGETS = (90, 100)


def stage_amax_jobs() -> list:
    jobs = [  # (their stack frames recorded: the register caps hold without spills)
        dict(_stage_job(cc, "train_after", "all8_tma", 128, "bf16", (32, 8), "div16", amax="rows+cols"), no_spill=True)
        for cc in STAGE_AMAX_TARGETS]
    jobs += [dict(_stage_job(cc, "train_after", "all8_tma", 128, "bf16", (32, 8), "div16", amax="rows"), no_spill=True)
             for cc in STAGE_AMAX_TARGETS]
    jobs += [dict(_stage_job(90, "train_before_nocs", "group16", 128, "bf16", (32, 8), "plain", amax="rows"),
                  no_spill=True),
             _stage_job(90, "train_before", "all8", 80, "fp16", (7, 7), "ones", amax="rows+cols", variant="v_norm",
                        level="ttgir")]
    for cc in STAGE_AMAX_TARGETS:
        for row_per, col_per, pow2 in ((True, True, True), (False, True, False))[:2 if cc == 90 else 1]:
            j = _fp8_job("fp8_dual_finish", cc, "div16", pow2=pow2, row_per=row_per, col_per=col_per)
            j["consts"].update(BP=16, FBC=32, BPC=256)
            j["types"].update(rpart_ptr="*bf16", cpart_ptr="*bf16")
            jobs.append(dict(j, label=f"{j['label']} stage_amax"))
    j = _fp8_job("fp8_dual_cast", 90, "div16", f8="fp8e5", pow2=False, row_per=False, col_per=False)
    j["types"].update(tamax_ptr="*bf16")
    jobs.append(dict(j, label=f"{j['label']} stage_amax"))
    for cc in STAGE_AMAX_TARGETS:
        j = _fp8_job("fp8_rowwise_parts", cc, "div16")
        jobs.append(dict(j, label=f"{j['label']} stage_amax", no_spill=True))
    return jobs


# x's cast with its amaxes kept for dW (fp8.input_cast_keeping_amax) as the GPU runs it on sm_90 and sm_100a:
# a bf16 x, hidden a multiple of 16; the rowwise cast with column partials (stored in bf16) at the launcher's
# whole-row steps (hidden 4096: 1 row of 4096; 5120 and 8192: 1 row of 8192; 2048: 1 of 2048 at 4 warps), 16
# rows per partial and, for hidden 4096, the fewer of small token counts (fp8.colamax_part_rows: 4 at 2048
# tokens, 1 at 512), and its chunked loops (above 8192), the partials' reduction (tile amax of bf16), the
# per-column cast from them (rowwise: e4m3, pow2) and the tensorwise recipe's cast of x (its tile amax and cast
# as before, jobs above)
FP8_INPUT_AMAX_ROWWISE = {  # label -> (ROWS, BLOCK_C, WHOLE_ROW, num_warps, PART_ROWS)
    "k4096": (1, 4096, True, 8, 16), "k4096_p4": (1, 4096, True, 8, 4), "k4096_p1": (1, 4096, True, 8, 1),
    "k8192": (1, 8192, True, 8, 16), "k2048": (1, 2048, True, 4, 16), "chunked": (16, 256, False, 4, 16),
}


def fp8_input_amax_jobs() -> list:
    jobs = []
    for cc in PRODUCT_TARGETS:
        for tag, (rows, block, whole, warps, part_rows) in FP8_INPUT_AMAX_ROWWISE.items():
            j = _fp8_job("fp8_rowwise_colamax_whole" if whole else "fp8_rowwise_colamax", cc, "div16")
            j = dict(j, consts=dict(j["consts"], ROWS=rows, BLOCK_C=block, PART_ROWS=part_rows),
                     types=dict(j["types"], cpart_ptr="*bf16"), options={"num_warps": warps})
            jobs.append(dict(j, label=f"{j['label']} input={tag}", no_spill=True))
        j = _fp8_job("fp8_tile_amax", cc, "div16", src="bf16")
        jobs.append(dict(j, label=f"{j['label']} input=partials"))
        j = _fp8_job("fp8_cast", cc, "div16", per_column=True, transpose=True)
        jobs.append(dict(j, label=f"{j['label']} input=dw"))
    return jobs


# head_dim 512 (Gemma 4's global layers), on the targets that train it (sm_90, sm_100a): the launchers'
# specialisations there, not in the pairwise covers above (each compile costs the suite CPU time); their
# cubins' stack frames are recorded (``no_spill``: test_gpu_targets holds them to none)
WIDE_HEAD_DIM = 512


def wide_head_jobs() -> list:
    d = WIDE_HEAD_DIM
    heads = (32, 4)  # Gemma 4 31B's global layers: 32 query heads, 4 KV heads
    jobs = []
    for cc in PRODUCT_TARGETS:
        jobs += [
            # the training stage as Gemma 4 runs it: weighted norms before RoPE, v normed, no grad_cos/sin
            _stage_job(cc, "train_before_nocs", "all4", d, "bf16", heads, "div16", variant="v_norm"),
            _stage_job(cc, "091", "group8", d, "bf16", heads, "plain"),
            _fwd_job(cc, d, "bf16", 4, False, "div16", variant="k_eq_v"),
            _matmul_job("hybrid_dw", "bf16", True, "per_sm", "div16", fin_d=d, cc=cc),
        ]
    jobs += [
        _stage_job(90, "train_before", "group16x4", d, "fp16", heads, "plain", variant="v_norm"),
        _stage_job(90, "train_after", "group8", d, "fp32", heads, "i64"),
        _stage_job(90, "train_before", "group8", d, "bf16", heads, "plain", variant="gate"),
        _fwd_job(90, d, "fp32", 1, True, "plain"),
        _finish_job(90, d, "bf16", "plain"),
        _matmul_job("chain_dw", "bf16", True, "sms", "plain", fin_d=d),
    ]
    for j in jobs:
        j["no_spill"] = True
    return jobs


def _covers(jobs: list) -> list:
    """Pairwise cover rows, compiled to their target's COVER_LEVELS (their labels say so)."""
    out = []
    for j in jobs:
        level = COVER_LEVELS[j["cc"]]
        out.append(dict(j, level=level, label=f"{j['label']} @{level}"))
    return out


def corner_jobs() -> list:
    """Per target, each cover family at the launchers' corners, to cubins on the product targets and
    on the others one per family (CORNER_CUBIN; see COVER_LEVELS)."""
    jobs = []
    for cc in TARGETS:
        corners = [
            _stage_job(cc, "train_before", "group16", 256, "fp32", (24, 24), "plain"),
            _stage_job(cc, "train_after_nocs", "all8", 80, "fp16", (1, 1), "i64"),
            _stage_job(cc, "091_finish_outside", "group8", 2, "bf16", (32, 8), "div16"),
            _stage_job(cc, "train_after", "group8", 128, "bf16", (32, 8), "ones", variant="gate"),
            _fwd_job(cc, 256, "fp32", 8, True, "plain"), _fwd_job(cc, 80, "bf16", 1, False, "i64"),
            _fwd_job(cc, 2, "fp16", 4, True, "ones"),
            _fwd_job(cc, 128, "bf16", 4, False, "div16", variant="all_heads_combo", heads=(32, 32)),
            _stage_all_heads_job(cc, "all_heads_combo", 128, "bf16", (7, 3), True, True, 3, "plain"),
            _finish_job(cc, 256, "fp32", "plain"), _finish_job(cc, 2, "bf16", "i64"),
            _finish_cols_job(cc, "fp32", "plain"),
        ]
        if cc not in PRODUCT_TARGETS:
            corners = [_corner_level(j) for j in corners]
        jobs += corners
        if cc in PRODUCT_TARGETS:  # the TMA tiles
            jobs += [_stage_job(cc, "train_after", "all8_tma", 256, "fp32", (32, 8), "div16"),
                     _stage_job(cc, "091", "group16_tma", 128, "bf16", (24, 24), "plain")]
    return jobs


def _corner_level(job: dict) -> dict:
    """A corner on a target without the Triton products: to TritonGPU IR, but for one cubin per family
    (the stage's is 091's in named_jobs, the forward's CORNER_CUBIN; the other families' corners stay
    cubins: the finishes' take tenths of a second, the all-heads stage has one)."""
    family = job["label"].split()[0]
    if family == "stage" or (family in CORNER_CUBIN and f" {CORNER_CUBIN[family]} " not in job["label"]):
        return dict(job, level="ttgir", label=f"{job['label']} to-ttgir")
    return job


def full_jobs() -> list:
    """Every constexpr value (pairwise: the covers to COVER_LEVELS, the products' to cubins), the
    corners and the named configurations to cubins."""
    covers = _covers(stage_jobs() + stage_all_heads_jobs() + forward_jobs() + finish_jobs() + finish_cols_jobs())
    return (covers + named_jobs() + corner_jobs() + matmul_jobs()
            + [_flush_job(m, cc=cc) for m in INT_MODES for cc in (90, 100, 120)] + gemm_jobs() + fp8_jobs()
            + wide_head_jobs() + lora_block_jobs() + dequant_4bit_jobs() + stage_amax_jobs() + mx_cast_jobs())


def one_at_a_time_jobs(kernel_args: dict) -> list:
    """Each kernel's base configurations to Triton IR with every integer argument, one at a time,
    the constant 1. ``kernel_args``: kernel -> its integer argument names (from the kernel)."""
    bases = [
        _stage_job(90, "091", "group8", 128, "bf16", (32, 8), "plain", level="ttir"),
        _stage_job(90, "train_before", "all8_tma", 128, "fp16", (32, 8), "plain", level="ttir"),
        _stage_all_heads_job(90, "all_heads_combo", 128, "bf16", (32, 8), False, True, 3, "plain", level="ttir"),
        _fwd_job(90, 128, "bf16", 4, True, "plain", level="ttir"),
        _fwd_job(90, 128, "bf16", 4, False, "plain", level="ttir", variant="all_heads_combo"),
        _finish_job(90, 128, "bf16", "plain", level="ttir"),
        _finish_cols_job(90, "bf16", "plain", level="ttir"),
        _matmul_job("chain_dw", "bf16", True, "sms", "plain", level="ttir"),
        _matmul_job("chain_dx", "bf16", False, "sms", "plain", level="ttir"),
        _flush_job("plain", level="ttir"),
        *(_fp8_job(family, 90, "plain", level="ttir") for family in FP8_KERNELS),
        _gemm_job("bf16", True, True, True, "plain", "plain", level="ttir"),
        _mx_cast_job("plain", level="ttir"),
        _mx_cast_job("plain", level="ttir", rceil=True),
    ]
    jobs = []
    for base in bases:
        for name in kernel_args[base["kernel"]]:
            j = dict(base, one=name)
            j["label"] = base["label"] + f" one={name}"
            jobs.append(j)
    return jobs


# ------------------------------------------------------------------------------- compiling


def _kernel(path: str):
    import importlib

    module, name = path.split(".")
    return getattr(importlib.import_module(f"fusedqkv.kernels.{module}"), name)


# integer arguments that are sizes (token, head, row counts, matrix dims): below 2**31 on any GPU
# (and TMA coordinates are 32-bit); the others are strides, which pass 2**31 elements on big tensors
SIZE_ARGS = {"M", "S", "HQ", "HKV", "NQG", "R", "C", "K", "fin_rows", "n_rows", "n", "NQ", "NK"}
# runtime fp32 arguments (not integers)
FLOAT_ARGS = {"eps", "scale0", "scale1", "scale2", "scale3"}


def int_args(kernel) -> list:
    """The kernel's runtime integer arguments: every non-constexpr parameter that is not a
    pointer, a descriptor or a float (FLOAT_ARGS)."""
    import inspect

    params = inspect.signature(kernel.fn).parameters.values()  # a JITFunction or the interpreter's
    return [p.name for p in params if "constexpr" not in str(p.annotation)
            and not p.name.endswith(("_ptr", "_desc")) and p.name not in FLOAT_ARGS]


def _cpu() -> float:
    t = os.times()  # this process and its finished children (ptxas)
    return t.user + t.system + t.children_user + t.children_system


def compile_job(job: dict) -> dict:
    """Compile one job; returns {label, ok, error, seconds, info}."""
    import triton
    from triton.backends.compiler import GPUTarget

    t0, c0 = time.time(), _cpu()
    res = dict(label=job["label"], level=job["level"], ok=False, error="", info={})
    try:
        kernel = _kernel(job["kernel"])
        names = list(kernel.arg_names)
        ints = set(int_args(kernel))
        consts = dict(job["consts"], **{n: None for n in job.get("none_args", ())})  # None: a constexpr
        types = dict(job["types"])
        if job.get("desc_types"):  # Gluon descriptors: their type spells the shared layout
            types.update(globals()[job["desc_types"]](job))
        sig, attrs = {}, {}
        for i, n in enumerate(names):
            if n in consts:
                sig[n] = "constexpr"
            elif n in ints:
                # per argument ("1", "D": i32 divisible by 16, "i32", "i64"), else the job's mode
                spec = job.get("int_spec", {}).get(n) or {"ones": "1", "div16": "D"}.get(job["ints"]) or (
                    "i64" if job["ints"] == "i64" and n not in SIZE_ARGS else "i32")
                if job.get("one") == n:
                    spec = "1"
                if spec == "1":
                    sig[n] = "constexpr"
                    consts[n] = 1
                else:
                    sig[n] = "i64" if spec == "i64" else "i32"
                    if spec == "D":
                        attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[n] = types.get(n) or job.get("default_ptr") or ("fp32" if n in FLOAT_ARGS else None)
                assert sig[n], f"no type for {n}"
                if sig[n].startswith("*"):  # the JIT marks 16-byte aligned tensors
                    attrs[(i,)] = [["tt.divisibility", 16]]
        source = triton.compiler.ASTSource
        if getattr(kernel, "is_gluon", lambda: False)():  # Gluon: its own front end (Language.GLUON)
            from triton.experimental.gluon._runtime import GluonASTSource as source
        src = source(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                     attrs=attrs)
        target = GPUTarget("cuda", job["cc"], 32)
        if job["level"] in ("ttir", "ttgir"):
            _to_ir(src, target, job["options"], upto=job["level"])
        else:
            ck = triton.compile(src, target=target, options=job["options"])
            res["info"] = {"shared": ck.metadata.shared, "bf16x2": "mul.rn.bf16x2" in ck.asm["ptx"],
                           "f16x2": "mul.rn.f16x2" in ck.asm["ptx"]}
            if job["kernel"] == GEMM_KERNEL or job.get("no_spill"):  # designed for no spills: the cubin's stack frame
                res["info"]["stack"] = _cubin_stack_bytes(ck.asm["cubin"])
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported, with the job
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        res["error"] = "".join(tb)[-3000:]
        if os.environ.get("OFFLINE_COMPILE_RAISE"):  # debugging one job: the whole traceback
            raise
    res["seconds"] = round(time.time() - t0, 2)
    res["cpu_seconds"] = round(_cpu() - c0, 2)
    return res


def _cubin_stack_bytes(cubin: bytes):
    """The stack frame (spills, local arrays) of a cubin's kernel by ``cuobjdump -res-usage`` of
    the Triton in use; None where that tool is missing."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"STACK:(\d+)", out)
    return int(m.group(1)) if m else None


def _ir_cache(src, backend, opts, upto):
    """Triton's cache entry for a passed IR-level job, or None where it cannot be keyed (another Triton's
    internals) or Triton is told to always compile. Triton caches what ``triton.compile`` builds, the
    cubin jobs' too, but not a pipeline stopped at TTIR/TTGIR: these covers ran their ~2 CPU-minutes
    again on every run. Keyed as Triton keys a compile (its own version and sources, the kernel's
    source and every jit function it calls, signature, constexprs, attributes, target, options,
    cache-invalidating environment), plus the level: a changed kernel or Triton compiles again.
    Only a pass is stored, so a failure is always compiled again."""
    import hashlib

    try:
        from triton import knobs
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.cache import get_cache_key, get_cache_manager
    except ImportError:
        return None
    if knobs.compilation.always_compile:
        return None
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    digest = hashlib.sha256(f"{key}-fusedqkv-offline-{upto}".encode()).hexdigest()
    return get_cache_manager(digest), f"{src.name[:150]}.{upto}-passed.json"


def _to_ir(src, target, options, upto="ttir"):
    """The front end (Python AST -> Triton IR: where a Python-level error in the kernel source, a
    method on a specialised int or a constexpr mismatch, shows), and with ``upto="ttgir"`` the
    target's passes to TritonGPU IR; LLVM and ptxas are left out. A pass is kept in Triton's cache
    (:func:`_ir_cache`); a job found there passed with the same key."""
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    manager, passed = _ir_cache(src, backend, opts, upto) or (None, None)
    if manager is not None and manager.get_file(passed) is not None:
        return
    _run_ir(src, target, options, upto, backend, opts)
    if manager is not None:
        manager.put(json.dumps({"level": upto, "passed": True}), passed, binary=False)


def _run_ir(src, target, options, upto, backend, opts):
    from triton._C.libtriton import ir

    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    except TypeError:  # a Triton whose make_ir takes other arguments: compile fully instead
        import triton

        triton.compile(src, target=target, options=options)
        return
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    first = "ttir" if "ttir" in stages else next(iter(stages))  # Gluon: its own passes to TritonGPU IR
    metadata = {"hash": "offline", "target": target, **opts.__dict__}
    module = stages[first](module, metadata)
    if upto == "ttgir" and first == "ttir":
        stages["ttgir"](module, metadata)


def all_jobs() -> list:
    """Every job, each label once."""
    full = full_jobs()
    kernels = {j["kernel"] for j in full}
    jobs = {}
    for j in full + one_at_a_time_jobs({k: int_args(_kernel(k)) for k in kernels}):
        jobs.setdefault(j["label"], j)
    return list(jobs.values())


def run(jobs: list, processes: int | None = None) -> list:
    import concurrent.futures as cf
    import multiprocessing as mp

    processes = processes or max(1, os.cpu_count() or 1)
    # long jobs first: the sm_90 stage and matmul cubins
    order = sorted(range(len(jobs)), key=lambda i: (("cubin", "ttgir", "ttir").index(jobs[i]["level"]),
                                                    "stage" not in jobs[i]["label"]))
    out = [None] * len(jobs)
    if processes == 1:
        for i in order:
            out[i] = compile_job(jobs[i])
        return out
    with cf.ProcessPoolExecutor(processes, mp_context=mp.get_context("fork")) as pool:
        futs = {pool.submit(compile_job, jobs[i]): i for i in order}
        for f in cf.as_completed(futs):
            out[futs[f]] = f.result()
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--only", default="", help="run jobs whose label contains this")
    ap.add_argument("--list", action="store_true")
    # e.g. OFFLINE_COMPILE_RAISE=1 TRITON_INTERPRET=0 PYTHONPATH=src python tests/_offline_compile.py \
    #          --processes 1 --only "stage sm90 091 group8 d128 bf16 hq32/hkv8 ints=ones"
    ap.add_argument("--triton", default=None,
                    help="run the jobs pinned to this Triton version (it must be the one imported); "
                         "without it, the jobs pinned to none")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if a.triton:
        import triton

        if triton.__version__ != a.triton:
            print(f"--triton {a.triton} but Triton {triton.__version__} is imported", file=sys.stderr)
            return 2
    jobs = [j for j in all_jobs() if a.only in j["label"] and j.get("triton") == a.triton]
    if a.list:
        for j in jobs:
            print(j["level"], j["label"])
        return 0
    for r in run(jobs, a.processes):
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
