"""The GPU kernels compile for the GPU generations fusedqkv runs on, and the launchers use
Hopper-only features (TMA descriptors, programmatic dependent launch, 16-bit pair arithmetic)
only where the device has them. No GPU needed: Triton compiles for an explicit target offline."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fusedqkv.ops import config, launch, projection

# Compiled in a child process: the test session runs Triton's interpreter (TRITON_INTERPRET=1),
# under which the kernels take their emulated 16-bit rounding instead of the GPU code paths.
_COMPILE = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from fusedqkv.kernels.projection_grads import tma_matmul_kernel
    from fusedqkv.kernels.rope_qk_norm import rope_qk_norm_bwd_kernel
    from fusedqkv.ops import config

    FP32 = {"cs_ptr", "wpart_ptr", "wsup_ptr", "wgrp_ptr"}

    def compile_for(kernel, cc, consts, types, num_warps, num_stages=3):
        names = kernel.arg_names
        sig = {n: "constexpr" if n in consts else types(n) for n in names}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                        constexprs={(names.index(n),): v for n, v in consts.items()})
        return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})

    def stage_types(n):
        if n == "tick_ptr":
            return "*i32"
        if n.endswith("_ptr"):
            return "*fp32" if n in FP32 else "*bf16"
        return "fp32" if n == "eps" else "i32"

    # the exact (091) stage, 4-token head groups as launched at few tokens
    stage = dict(D=128, HALF=64, HALF_P2=64, D_P2=128, BLOCK_T=4, HB=1, EXACT=True, NORM_AFTER_ROPE=True,
                 SAVED_ROTATED=True, GRAD_COS_SIN=True, FUSED_FINISH=True, SUPER=32, RECOMPUTE_RSTD=False, PF=3,
                 GROUPED=True, NQG=4, NKG=1, GSIZE=8, TMA=False)
    for cc, lp2 in ((80, False), (90, True)):
        ck = compile_for(rope_qk_norm_bwd_kernel, cc, dict(stage, LP2=lp2), stage_types, 2)
        pairs = "mul.rn.bf16x2" in ck.asm["ptx"]
        print(f"stage sm{cc} bf16x2={pairs}")

    # the hybrid's dW: its programs per SM must fit the SM's shared memory (228 KB, 1 KB per block
    # reserved) on sm_90
    br, bc, bk, warps, stages, per_sm = config.current().hybrid_dw
    mm = dict(BR=br, BC=bc, BK=bk, TRANS_A=True, NPROG=264, PDL=True, TRIGGER=False, WAIT_AT_END=False,
              FINISH=True, FIN_D=128, FIN_D_P2=128)
    descs = {"a_desc": f"tensordesc<bf16[{bk}, {br}]>", "b_desc": f"tensordesc<bf16[{bk}, {bc}]>",
             "c_desc": f"tensordesc<bf16[{br}, {bc}]>"}
    ck = compile_for(tma_matmul_kernel, 90, mm,
                     lambda n: descs.get(n) or ("*fp32" if n.endswith("_ptr") else "i32"), warps, stages)
    print(f"hybrid_dw smem={ck.metadata.shared} per_sm={per_sm}")
""")


def test_kernels_compile_for_sm80_and_sm90():
    """The exact stage compiles for sm_80 (fp32 math and a cast: the bf16x2 instructions are
    sm_90 only) and for sm_90 (bf16x2 pairs); the hybrid's dW tile leaves room for its programs
    per SM on sm_90."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "stage sm80 bf16x2=False" in out, out
    assert "stage sm90 bf16x2=True" in out, out
    smem, per_sm = (int(v.split("=")[1]) for v in out.split("hybrid_dw ")[1].split())
    assert per_sm * (smem + 1024) <= 228 * 1024, out


def test_sm90_or_newer_is_false_off_cuda():
    assert launch.sm90_or_newer(torch.device("cpu")) is False


@pytest.mark.parametrize("hopper", [False, True])
def test_triton_products_only_on_sm90(hopper, monkeypatch):
    """Without TMA and programmatic dependent launch (before sm_90) the products stay on cuBLAS."""
    monkeypatch.setattr(projection, "sm90_or_newer", lambda device: hopper)
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
