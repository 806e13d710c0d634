"""The GPU kernels compile for the GPU generations fusedqkv runs on, and the launchers use
Hopper-only features (TMA descriptors, programmatic dependent launch, 16-bit pair arithmetic)
only where the device has them. No GPU needed: Triton compiles for an explicit target offline.

The offline compiles (``_offline_compile.py``) cover every constexpr value the launchers can
select (pairwise over each kernel's axes, the target one of them: sm_80, sm_90, sm_100a, sm_120a;
the stage, forward and finish families' covers through the target passes or the front end, their
corners -- on sm_80 and sm_120a one per family -- and the products' covers to cubins: ``COVER_LEVELS``,
``corner_jobs``) and every kernel with its integer arguments specialised the way the JIT specialises them -- an
argument equal to 1 becomes a compile-time constant, so a kernel that calls a tensor method on it
(``M.to(tl.int64)``) fails to compile on the GPU for one token while the CPU interpreter, which
never specialises, runs it fine.

The Gluon forward GEMM (sm_90 only) compiles under the Triton it was validated with
(``_offline_compile.GEMM_TRITON``, fetched and cached like test_fast_path_gate's Tritons), in a child
process of its own: Triton 3.9 removed the TMA copy names it calls."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import _offline_compile as oc
import pytest
import torch
import triton
from _tritons import triton_path

from fusedqkv.ops import config, device, projection

JOBS = oc.all_jobs()
FAMILIES = sorted({j["label"].split()[0] for j in JOBS})
SCRIPT = Path(__file__).with_name("_offline_compile.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def _offline(args, triton_dir=None):
    """The script's results and the child process; ``triton_dir`` first on its PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    if triton_dir:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(triton_dir), str(SRC), *rest])
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=1800)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc


@pytest.fixture(scope="module")
def compiled():
    """label -> result of every offline compile, run once in child processes: the test session
    runs Triton's interpreter (TRITON_INTERPRET=1), under which the kernels take their emulated
    16-bit rounding instead of the GPU code paths. Triton's cache serves what passed before: the
    cubins (Triton's own) and the IR-level covers (``_offline_compile._ir_cache``, Triton's key).
    The jobs pinned to a Triton run in a child of their own with that Triton; where it cannot be
    had, its jobs fail with the reason."""
    results, proc = _offline([])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {r["label"]: r for r in results}
    for version in sorted({j["triton"] for j in JOBS if j.get("triton")}):
        try:
            results, proc = _offline(["--triton", version], triton_path(version))
            problem = "" if proc.returncode == 0 else f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - reported with the pinned jobs
            results, problem = [], f"no Triton {version}: {e}"
        out.update({r["label"]: r for r in results})
        for j in JOBS:
            if j.get("triton") == version and j["label"] not in out:
                out[j["label"]] = dict(label=j["label"], ok=False, info={},
                                       error=f"Triton {version} child: {problem or 'no result'}")
    return out


def _check_family(compiled, family, ones: bool) -> None:
    """Every job of ``family`` compiled: its one-at-a-time Triton IR jobs (``ones``), or the rest
    (covers at their target's level, corners, named configurations)."""
    jobs = [j for j in JOBS if j["label"].split()[0] == family and bool(j.get("one")) == ones]
    missing = [j["label"] for j in jobs if j["label"] not in compiled]
    bad = [compiled[j["label"]] for j in jobs if j["label"] in compiled and not compiled[j["label"]]["ok"]]
    assert jobs
    assert not missing, missing
    assert not bad, "\n\n".join(f"{r['label']}\n{r['error']}" for r in bad[:3]) + f"\n({len(bad)} failed)"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_constexpr_combination_compiles(compiled, family):
    """Pairwise over the kernel's constexpr axes and the targets, each job with its integer
    arguments plain, multiples of 16, all the constant 1, or 64-bit strides: to cubins, or (the
    stage, forward and finish covers) to their target's COVER_LEVELS."""
    _check_family(compiled, family, ones=False)


def test_every_family_compiles_to_a_cubin_on_every_target():
    """The cover families reach cubins on every target through their corners (the stage on sm_80 and
    sm_120a through 091's named job)."""
    for fam in ("stage", "stage_all_heads", "forward", "finish", "finish_cols"):
        for cc in oc.TARGETS:
            assert any(j["label"].split()[0] == fam and j["cc"] == cc and j["level"] == "cubin" for j in JOBS), (fam, cc)
    covers = [j for j in JOBS if "@" in j["label"]]
    assert covers and all(j["level"] == oc.COVER_LEVELS[j["cc"]] for j in covers)


@pytest.mark.parametrize("family", [f for f in FAMILIES if any(j.get("one") and j["label"].startswith(f + " ")
                                                               for j in JOBS)])
def test_each_int_argument_equal_to_one_compiles(compiled, family):
    """Base configurations with each integer argument, one at a time, the constant 1 (the front
    end, where a method call on a specialised int fails)."""
    _check_family(compiled, family, ones=True)


def test_job_list_covers_every_value_and_int_argument():
    """The job list itself: every value of every stage axis, every int mode per kernel family, and
    (for the families with base configurations) every integer argument of the kernel set to 1."""
    full = [j for j in JOBS if j["level"] == "cubin" or "@" in j["label"]]
    stage = [j for j in full if j["label"].startswith("stage ")]
    for axis, values in oc.STAGE_AXES.items():
        for v in values:
            assert any(_stage_value(j, axis, v) for j in stage), (axis, v)
    for fam in FAMILIES:
        if fam == "gemm_sm90":  # its own integer axes: the JIT's specialisations, by group of arguments
            continue
        modes = {j["ints"] for j in full if j["label"].split()[0] == fam}
        assert modes == set(oc.INT_MODES), (fam, modes)
    gemm = [j for j in full if j["label"].startswith("gemm_sm90 ")]
    cover = [dict(zip(oc.GEMM_AXES, r)) for r in oc.GEMM_COVER]
    assert not oc.uncovered_pairs(cover, oc.GEMM_AXES)  # the GEMM's cover is pairwise
    assert all(any(j["label"] == oc._gemm_job(fuse=True, **r)["label"] for j in gemm) for r in cover)
    for axis, values in oc.GEMM_INT_AXES.items():
        assert {j["int_axes"][axis] for j in gemm} == set(values), axis
    assert any(j["one_token"] for j in gemm)
    assert set(oc.GEMM_UNITS + oc.GEMM_INTS + ("N", "R")) == set(oc.int_args(oc._kernel(oc.GEMM_KERNEL)))
    for kernel in {j["kernel"] for j in JOBS if j.get("one")}:
        ones = {j["one"] for j in JOBS if j.get("one") and j["kernel"] == kernel}
        assert ones == set(oc.int_args(oc._kernel(kernel))), kernel
    # the M == 1 specialisation of the stage's grouped mode with grad_cos/sin (the one-token crash)
    assert any(j["one"] == "M" and j["consts"]["GROUPED"] and j["consts"]["GRAD_COS_SIN"]
               for j in JOBS if j["label"].startswith("stage "))


def _stage_value(job, axis, v):
    c = job["consts"]
    label = job["label"].split()
    if axis == "cc":
        return job["cc"] == v
    if axis == "mode":
        return label[2] == v
    if axis == "layout":
        return label[3] == v
    if axis == "d":
        return c["D"] == v
    if axis == "dtype":
        return label[5].split("/")[0] == v
    if axis == "heads":
        return label[6] == f"hq{v[0]}/hkv{v[1]}"
    if axis == "ints":
        return job["ints"] == v
    raise KeyError(axis)


def test_exact_stage_uses_16bit_pairs_only_on_sm90(compiled):
    """The exact stage compiles for sm_80 with fp32 math and a cast (the bf16x2 instructions are
    sm_90 only) and for sm_90 with bf16x2 pairs."""
    for cc, pairs in ((80, False), (90, True)):
        r = compiled[oc._stage_job(cc, "091", "group8", 128, "bf16", (32, 8), "plain")["label"]]
        assert r["ok"], r["error"]
        assert r["info"]["bf16x2"] is pairs, r


@pytest.mark.parametrize("cc", oc.PRODUCT_TARGETS)
def test_hybrid_dw_fits_its_programs_per_sm(compiled, cc):
    """The hybrid's dW tile leaves room for its programs per SM on sm_90 and sm_100 (228 KB of
    shared memory per SM, 1 KB per block reserved)."""
    assert oc.HYBRID_DW == config.Config().hybrid_dw  # the job list follows the launcher
    r = compiled[oc._matmul_job("hybrid_dw", "bf16", True, "per_sm", "plain", cc=cc)["label"]]
    assert r["ok"], r["error"]
    per_sm = config.Config().hybrid_dw[5]
    assert per_sm * (r["info"]["shared"] + 1024) <= 228 * 1024, r


def test_gemm_sm90_fits_shared_memory(compiled):
    """The Gluon GEMM's ring at the launcher's depth (5 stages of x and W tiles, 32 KB each) and its
    four epilogue buffers fit one block's 227 KB of shared memory on sm_90 (a launch past it fails)."""
    gemm = [j for j in JOBS if j["label"].startswith("gemm_sm90 ") and j["level"] == "cubin"]
    assert {j["consts"]["STAGES"] for j in gemm} >= {5, 4}
    for j in gemm:
        r = compiled[j["label"]]
        assert r["ok"], r["error"]
        assert r["info"]["shared"] <= 227 * 1024, r


def _known_gemm_spill(job) -> int:
    """Stack bytes a job is known to take: the norm before RoPE with weights, every integer argument
    not a multiple of 16: 16 bytes (32 bytes of spill stores, found in session 14)."""
    c = job["consts"]
    return 16 if (c["FUSE"] and not c["NORM_AFTER_ROPE"] and c["NORM_WEIGHT"]
                  and job["int_axes"]["ints"] == "plain") else 0


def test_gemm_sm90_does_not_spill(compiled):
    """The Gluon GEMM's register split (setmaxnreg per partition) leaves no partition spilling, at the
    launcher's tiles (a spilling epilogue ran 10-30% slower: NOTES, sessions 13-14), but for the one known case (``_known_gemm_spill``), which must not grow."""
    gemm = [j for j in JOBS if j["label"].startswith("gemm_sm90 ") and j["level"] == "cubin"]
    checked = 0
    for j in gemm:
        r = compiled[j["label"]]
        assert r["ok"], r["error"]
        if r["info"].get("stack") is None:  # no cuobjdump beside that Triton
            continue
        assert r["info"]["stack"] <= _known_gemm_spill(j), (j["label"], r["info"])
        checked += 1
    assert checked >= len(gemm) // 2, "cuobjdump missing for most jobs"


@pytest.mark.parametrize("cc", oc.PRODUCT_TARGETS)
def test_head_dim_512_kernels_do_not_spill(compiled, cc):
    """The launchers' head_dim 512 specialisations (Gemma 4's global layers: the stage's 4-token
    tiles, the forward stage, the finishes at 16 rows per step, the products with the finish)
    compile to cubins with no stack frame on sm_90 and sm_100a."""
    jobs = [j for j in oc.wide_head_jobs() if j["cc"] == cc]
    assert {j["label"].split()[0] for j in jobs} >= {"stage", "forward", "tma_matmul"}
    checked = 0
    for j in jobs:
        r = compiled[j["label"]]
        assert r["ok"], (j["label"], r["error"])
        if r["info"].get("stack") is None:  # no cuobjdump beside that Triton
            continue
        assert r["info"]["stack"] == 0, (j["label"], r["info"])
        checked += 1
    assert checked == len(jobs), "cuobjdump missing"


def test_blackwell_targets_compile_every_kernel(compiled):
    """sm_100a and sm_120a get offline compiles of every kernel the launchers select there: the
    stage, the forward stage, the finishes and the flush on both, the products, the LoRA block builder,
    QLoRA's dequantization and the mxfp8 cast on sm_100a."""
    fp8 = set(oc.FP8_KERNELS)
    for cc, kernels in ((100, {"stage", "stage_all_heads", "forward", "finish", "finish_cols", "tma_matmul", "l2_flush",
                               "lora_block", "dequant_4bit", "mx_cast", *fp8}),
                        (120, {"stage", "stage_all_heads", "forward", "finish", "finish_cols", "l2_flush", *fp8})):
        jobs = [j for j in JOBS if j["cc"] == cc]
        assert {j["label"].split()[0] for j in jobs} == kernels, cc
        bad = [compiled[j["label"]] for j in jobs if not compiled[j["label"]]["ok"]]
        assert not bad, bad[:2]


def test_sm90_or_newer_is_false_off_cuda():
    assert device.sm90_or_newer(torch.device("cpu")) is False


@pytest.mark.parametrize("cc", [(8, 0), (9, 0), (10, 0), (12, 0)])
def test_triton_products_only_on_hopper_and_datacenter_blackwell(cc, monkeypatch):
    """Without TMA and programmatic dependent launch (before sm_90), and on consumer Blackwell
    (sm_120: ~99 KB of shared memory per block, less than the products' tiles take), the products
    stay on cuBLAS."""
    hopper = cc[0] in (9, 10)
    monkeypatch.setattr(projection, "capability", lambda device: cc)
    cuda = torch.device("cuda", 0)
    M, nqkv, hidden = 128, 256, 64
    dqkv = torch.empty(M, nqkv, dtype=torch.bfloat16)
    w = torch.empty(nqkv, hidden, dtype=torch.bfloat16)
    x = torch.empty(M, hidden, dtype=torch.bfloat16)
    dx = torch.empty(M, hidden, dtype=torch.bfloat16)
    dw = torch.empty(nqkv, hidden, dtype=torch.bfloat16)
    cfg = config.current()
    expected = "chain" if hopper else "cublas"
    assert projection.choose_products(M, torch.bfloat16, cuda, 132, dqkv, w, x, dx, dw, cfg) == expected
    with config.override(chain_max_tokens=0):
        expected = "hybrid" if hopper else "cublas"
        assert projection.choose_products(M, torch.bfloat16, cuda, 132, dqkv, w, x, dx, dw,
                                          config.current()) == expected



def test_job_list_follows_the_launchers(monkeypatch):
    """The offline job list holds the launchers' configurations: the products' tile configs, the
    stage's (tokens per block, heads per group, warps) at every token count on an H200, and the
    Gluon GEMM's constexprs and options."""
    from fusedqkv.ops import internals
    from fusedqkv.ops import qkv_rope_norm_gemm as gemm

    assert internals._in_range(oc.GEMM_TRITON, internals.GLUON_SUPPORTED)  # compiled where the plan runs it
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    for nar, nw, fuse in ((True, True, True), (False, False, True), (True, True, False)):
        fwd = gemm.FusedGemmForward(4096, 6144, 4096, 4096, 32, 8, 128, 1e-6, nar, nw, torch.bfloat16, "cuda",
                                    fuse=fuse)
        job = oc._gemm_job("bf16", fuse, nar, nw, "one", "div16")
        assert job["consts"] == fwd.constexprs and job["options"] == {"num_warps": 4, "maxnreg": gemm.MAXNREG}
    # a configured tile: the same constexprs; one program per two [128, 128] tiles (384 tokens x 48 heads)
    fwd = gemm.FusedGemmForward(384, 6144, 4096, 384, 32, 8, 128, 1e-6, True, True, torch.bfloat16, "cuda",
                                STAGES=4)
    assert oc._gemm_job("bf16", True, True, True, "one", "div16", STAGES=4)["consts"] == fwd.constexprs
    assert fwd.grid == (72, )
    with pytest.raises(ValueError, match=r"tile: unknown options \['COOP'\]"):
        gemm.FusedGemmForward(384, 6144, 4096, 384, 32, 8, 128, 1e-6, True, True, torch.bfloat16, "cuda", COOP=True)
    cfg = config.Config()
    for name in ("CHAIN_DX", "CHAIN_DW", "CHAIN_DX_ABOVE_128", "CHAIN_DW_ABOVE_128", "HYBRID_DW"):
        assert getattr(oc, name) == getattr(cfg, name.lower()), name
    from fusedqkv.ops import rope_qk_norm as stage

    monkeypatch.setattr(stage, "sm_count", lambda device: oc.H200_SMS)
    # all8 / all8_tma, group16 / group16_tma, group8; above head_dim 256 all4, group16x4, group8
    narrow = {(8, 0), (8, 16), (4, 8)}
    wide = {(4, 0), (4, 16), (4, 8)}
    assert {oc.STAGE_LAYOUTS[n][:2] for n in oc.STAGE_LAYOUTS} == narrow | wide
    assert {(j["consts"]["BLOCK_T"], j["consts"]["GSIZE"] if j["consts"]["GROUPED"] else 0)
            for j in oc.wide_head_jobs() if j["kernel"].endswith("rope_qk_norm_bwd_kernel")} == wide
    for m in (1, 2, 3, 100, 1024, 1025, 3000, 3168, 3169, 100000):
        for d in oc.HEAD_DIMS + (oc.WIDE_HEAD_DIM,):
            block_t, hb, warps, pf, gsize = stage._launch_config(m, 32, 8, d, torch.device("cuda", 0))
            assert (block_t, gsize) in (narrow if d <= 256 else wide) and hb == 1 and pf == 3, (m, d)
            assert warps == max(1, min(16, block_t * oc._p2(d // 2) // 128)), (m, d)
    # the finishes' rows per step: 32 to head_dim 256, 16 at 512 (the jobs take the launchers')
    assert [stage.finish_rows(d) for d in (2, 128, 256, 512)] == [32, 32, 32, 16]


def test_fp8_weight_jobs_are_the_recipes_weight_casts():
    """The offline jobs of W's dual cast are each recipe's: the forward's side (r.weight) per row or
    the tensor's, the dX side (r.weight_for_grad_input) per column or the tensor's, both e4m3, its
    power-of-two rule; each job compiled (its family's test) to an sm_90 cubin."""
    from fusedqkv.ops import fp8

    assert set(oc.FP8_WEIGHT_RECIPES) == {n for n, r in fp8.RECIPES.items() if not r.mx}  # (MX: fp8.mx_cast)
    for name, (row_per, col_per, pow2) in oc.FP8_WEIGHT_RECIPES.items():
        r = fp8.RECIPES[name]
        assert (row_per, col_per, pow2) == (not r.weight.tensorwise, not r.weight_for_grad_input.tensorwise,
                                            r.round_scales_to_power_of_2)
        assert r.weight.dtype == r.weight_for_grad_input.dtype == fp8.E4M3
        jobs = [j for j in JOBS if j["label"].endswith(f" weight={name}")]
        assert jobs and all(j["cc"] == 90 and j["level"] == "cubin" and "fp8e4nv/fp8e4nv" in j["label"]
                            for j in jobs)


# Triton 3.6 (the H200's) gives the stage writing amax partials an 8-byte stack frame on sm_90 (the grouped
# rows-only and the TMA rows+columns layouts; session 24); Triton 3.9 none
STAGE_AMAX_STACK_ALLOWED = 0 if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9) else 8


def test_stage_amax_jobs_compile_without_spills(compiled):
    """The backward stage writing dQKV's amax partials (fp8.STAGE_AMAX) compiles on sm_90 and sm_100a,
    its cubins without a stack frame (the register caps the launcher gives it; Triton 3.6: at most
    :data:`STAGE_AMAX_STACK_ALLOWED` bytes), rows alone too at the
    8-token TMA layout (rowwise_with_gw_hp's row cast), and the finish and casts of its partials (bf16)
    with the launcher's tiles."""
    from fusedqkv.ops import fp8

    jobs = oc.stage_amax_jobs()
    stage = [j for j in jobs if j["label"].startswith("stage ")]
    assert {j["cc"] for j in stage} == set(oc.STAGE_AMAX_TARGETS)
    assert all(j["consts"]["ROW_AMAX"] and "arow_ptr" in j["types"] for j in stage)
    for j in jobs:
        r = compiled[j["label"]]
        assert r["ok"], (j["label"], r["error"])
        if j.get("no_spill") and r["info"].get("stack") is not None:
            assert r["info"]["stack"] <= STAGE_AMAX_STACK_ALLOWED, (j["label"], r["info"])
        if j["label"].startswith("fp8_dual_finish"):
            c = j["consts"]
            assert (c["FB"], c["BP"], c["FBC"], c["BPC"]) == (fp8._FB, fp8._FP_STAGE, fp8._FBC_STAGE, fp8._FPC_STAGE)
        if j["label"].startswith("fp8_rowwise_parts"):  # the row cast from the stage's row partials
            c = j["consts"]
            assert (c["BR"], c["BC"], c["BP"]) == (fp8._BR, fp8._BC, fp8._FP_STAGE)
            assert j["types"]["part_ptr"] == "*bf16"
    assert {j["cc"] for j in jobs if j["label"].startswith("fp8_rowwise_parts")} == set(oc.STAGE_AMAX_TARGETS)
    assert {j["cc"] for j in stage if not j["consts"]["COL_AMAX"] and j["consts"]["TMA"]} == set(oc.STAGE_AMAX_TARGETS)
    # the default build: the partials' pointers None (constexprs), so the kernel's code is unchanged
    default = oc._stage_job(90, "train_after", "all8_tma", 128, "bf16", (32, 8), "div16")
    assert default["none_args"] == ("arow_ptr", "acol_ptr") and not default["consts"]["COL_AMAX"]


def test_mx_cast_job_is_the_launchers(compiled):
    """The mxfp8 and mxfp8_rceil casts (fp8.mx_cast_triton) compile for sm_100a alone (the recipes are refused
    below it) at the launcher's tile with the hardware's e4m3 cast, in every integer mode and with a transposed
    read (the dW GEMM's operands), its cubins without a stack frame."""
    from fusedqkv.ops import fp8

    jobs = [j for j in JOBS if j["label"].startswith("mx_cast") and j["level"] == "cubin"]
    assert {j["cc"] for j in jobs} == {100} and [j["one"] for j in jobs if j["one"]] == ["stride_xr"] * 2
    for rceil in (False, True):  # mxfp8 (FLOOR) and mxfp8_rceil: each in every integer mode, each read transposed
        mode = [j for j in jobs if j["consts"]["RCEIL"] is rceil]
        assert {j["ints"] for j in mode} == set(oc.INT_MODES) and sum(j["one"] == "stride_xr" for j in mode) == 1
    for j in jobs:
        c = j["consts"]
        assert (c["BR"], c["BC"], c["FP8_MAX"], c["SOFT_ROUND"]) == (fp8._MX_BR, fp8._MX_BC, 448.0, False)
        r = compiled[j["label"]]
        assert r["ok"], (j["label"], r["error"])
        if r["info"].get("stack") is not None:  # (None: no cuobjdump beside that Triton)
            assert r["info"]["stack"] == 0, (j["label"], r["info"])


def test_fp8_input_amax_jobs_are_the_launchers():
    """The offline jobs of x's rowwise cast with column partials (fp8.input_cast_keeping_amax) hold the
    launcher's constexprs, warps and partials' dtype at hidden 4096 (16, 4 and 1 rows a partial), 5120
    (and 8192), 2048 and above 8192 (its chunked loops), on sm_90 and sm_100a, with the partials'
    reduction (a tile amax of bf16) and dW's cast from
    them; each compiled in its family's test."""
    from fusedqkv.kernels import fp8_cast
    from fusedqkv.ops import fp8

    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(kw, part_dtype=args[3].dtype)

    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(fp8_cast, "rowwise_cast_colamax_kernel", Recorder())
        # (tag, hidden, tokens, programs wanted: 1 keeps 16 rows a partial)
        for tag, hidden, tokens, programs in (("k4096", 4096, 40, 1), ("k4096_p4", 4096, 2048, 512),
                                              ("k4096_p1", 4096, 512, 512), ("k8192", 5120, 40, 1),
                                              ("k8192", 8192, 40, 1), ("k2048", 2048, 40, 1), ("chunked", 16384, 40, 512)):
            seen.clear()
            m.setattr(fp8, "_COLAMAX_PROGRAMS", programs)
            fp8._rowwise_colamax_triton(torch.zeros(tokens, hidden, dtype=torch.bfloat16), fp8.Cast(fp8.E4M3), True)
            rows, block, whole, warps, part_rows = oc.FP8_INPUT_AMAX_ROWWISE[tag]
            assert (seen["ROWS"], seen["BLOCK_C"], seen["WHOLE_ROW"], seen["num_warps"], seen["PART_ROWS"]) == \
                (rows, block, whole, warps, part_rows), (tag, seen)
            assert seen["part_dtype"] == torch.bfloat16, (tag, seen)
    jobs = [j for j in JOBS if " input=" in j["label"]]
    assert len(jobs) == len(oc.fp8_input_amax_jobs()) and {j["cc"] for j in jobs} == set(oc.PRODUCT_TARGETS)
    assert {j["label"].split()[-1] for j in jobs} == {f"input={t}" for t in oc.FP8_INPUT_AMAX_ROWWISE} | {
        "input=partials", "input=dw"}
    assert all(j["level"] == "cubin" and j["ints"] == "div16" for j in jobs)


@pytest.mark.parametrize("cc", oc.PRODUCT_TARGETS)
def test_fp8_input_amax_casts_do_not_spill(compiled, cc):
    """x's rowwise cast with column partials, at the launcher's steps: cubins with no stack frame."""
    jobs = [j for j in oc.fp8_input_amax_jobs() if j["cc"] == cc and j.get("no_spill")]
    assert jobs
    for j in jobs:
        r = compiled[j["label"]]
        assert r["ok"], (j["label"], r["error"])
        if r["info"].get("stack") is not None:  # (None: no cuobjdump beside that Triton)
            assert r["info"]["stack"] == 0, (j["label"], r["info"])


_IR_CACHE_CHILD = r'''
import json, sys, textwrap, importlib.util
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
import _offline_compile as oc

def kernel_from(tmp, name, body):
    path = Path(tmp) / f"{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(x_ptr, n):\n" + textwrap.indent(body, "    "))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.k

def src(fn):
    return triton.compiler.ASTSource(fn=fn, signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={}, attrs={})

tmp, out = sys.argv[1], {}
target = GPUTarget("cuda", 90, 32)
good = kernel_from(tmp, "good", "tl.store(x_ptr + tl.arange(0, 16), tl.full((16,), 1.0, tl.float32))\n")
other = kernel_from(tmp, "other", "tl.store(x_ptr + tl.arange(0, 16), tl.full((16,), 2.0, tl.float32))\n")
bad = kernel_from(tmp, "bad", "tl.store(x_ptr + tl.arange(0, 16), n.no_such_method())\n")
runs = []
real = oc._run_ir
oc._run_ir = lambda *a: (runs.append(a[0].fn.__module__), real(*a))
for fn in (good, good, other):
    oc._to_ir(src(fn), target, {"num_warps": 4}, upto="ttgir")
oc._to_ir(src(good), target, {"num_warps": 8}, upto="ttgir")  # other options: another key
oc._to_ir(src(good), target, {"num_warps": 4}, upto="ttir")  # another level: another key
for _ in range(2):
    try:
        oc._to_ir(src(bad), target, {"num_warps": 4}, upto="ttgir")
        out.setdefault("bad", []).append("passed")
    except Exception as e:  # noqa: BLE001
        out.setdefault("bad", []).append(type(e).__name__)
out["runs"] = runs
print(json.dumps(out))
'''


def test_ir_level_passes_are_cached_under_tritons_key(tmp_path):
    """The TTIR/TTGIR covers (not cached by Triton: it caches whole compiles) are kept in Triton's cache once
    passed: a second run of the same job does not compile again; another kernel source, option set or level
    compiles; a failure is never stored (it fails again)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(SRC), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_ALWAYS_COMPILE", None)
    proc = subprocess.run([sys.executable, "-c", _IR_CACHE_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["runs"] == ["good", "other", "good", "good", "bad", "bad"]
    assert out["bad"] == ["CompilationError", "CompilationError"]
