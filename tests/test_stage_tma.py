"""The backward stage's TMA-fed tiles (host descriptors, one sequence per token block) against
its per-thread loads and against the torch backend: bit for bit, on sequences whose length is
not a multiple of the block, several batches, one KV head, both precisions."""

import pytest
import torch

from fusedqkv.ops import config
from fusedqkv.ops import rope_qk_norm as stage


def _inputs(B, HQ, HKV, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    gq, gk, gv = rn(B, HQ, S, D), rn(B, HKV, S, D), rn(B, HKV, S, D)
    xq, xk = rn(B, HQ, S, D), rn(B, HKV, S, D)
    rq = (torch.randn(B, HQ, S, 1, generator=g).abs() + 0.1).to(dtype)
    rk = (torch.randn(B, HKV, S, 1, generator=g).abs() + 0.1).to(dtype)
    wq, wk = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype), (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    ang = torch.randn(B, S, D, generator=g).clamp(-3, 3)
    return [gq, gk, gv, xq, xk, rq, rk, wq, wk, ang.cos().to(dtype), ang.sin().to(dtype)]


def _run(args, exact, backend="triton"):
    gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin = args
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    dqkv = torch.empty(B * S, (HQ + 2 * HKV) * D, dtype=gq.dtype)
    gcos, gsin = torch.empty_like(cos), torch.empty_like(sin)
    gwq, gwk = torch.empty_like(wq), torch.empty_like(wk)
    planned = stage.rope_qk_norm_backward(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv=dqkv, grad_cos=gcos,
                                          grad_sin=gsin, grad_q_norm_weight=gwq, grad_k_norm_weight=gwk, exact=exact,
                                          backend=backend)
    _run.tma = bool(planned and planned.launch.constexprs["TMA"])
    return dqkv, gcos, gsin, gwq, gwk


# (tokens per block, heads per step, warps, stages, heads per group or 0): every head of a block
# (many tokens) and head groups with partials (mid sizes), forced at interpreter sizes
CONFIGS = {"all_heads": (8, 1, 0, 3, 0), "groups": (8, 1, 0, 3, 2)}


SHAPES = [(3, 4, 2, 13, 64), (2, 4, 1, 9, 128)]
MODES = {"exact_bf16": (True, torch.bfloat16), "accurate_bf16": (False, torch.bfloat16),
         "accurate_fp32": (False, torch.float32)}
# pairwise: every mode with both layouts, and each shape with every mode and both layouts
CASES = [pytest.param(SHAPES[(i + j) % 2], *MODES[mode], config_name,
                      id="B{}_Hq{}_Hkv{}_S{}_D{}".format(*SHAPES[(i + j) % 2]) + f"-{mode}-{config_name}")
         for i, mode in enumerate(MODES) for j, config_name in enumerate(CONFIGS)]


@pytest.mark.parametrize("shape,exact,dtype,config_name", CASES)
def test_tma_tiles_equal_per_thread_loads(config_name, exact, dtype, shape):
    B, HQ, HKV, S, D = shape
    args = _inputs(B, HQ, HKV, S, D, dtype)
    with config.override(stage_tile=CONFIGS[config_name], stage_tma=False):
        ref = _run(args, exact)
        assert not _run.tma
    with config.override(stage_tile=CONFIGS[config_name], stage_tma=True):
        got = _run(args, exact)
        assert _run.tma  # the TMA path ran
    for name, a, b in zip(("dqkv", "grad_cos", "grad_sin", "grad_q_norm_weight", "grad_k_norm_weight"), got, ref):
        if name.endswith("norm_weight"):  # sums over a different split of the tokens into blocks
            torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
        else:
            assert torch.equal(a, b), name
    if exact:  # and the reference's roundings (the torch backend performs each eager op)
        cpu = _run(args, exact, backend="torch")
        assert torch.equal(got[0], cpu[0])
        assert torch.equal(got[1], cpu[1]) and torch.equal(got[2], cpu[2])


def test_tma_skipped_for_tensors_it_cannot_address():
    args = _inputs(2, 4, 2, 11, 64, torch.bfloat16)
    ref = _run(args, True, backend="torch")
    # grad_query with head_dim not the innermost axis in memory (a transposed copy viewed back)
    strided = list(args)
    strided[0] = args[0].transpose(2, 3).contiguous().transpose(2, 3)
    assert strided[0].stride(3) != 1
    with config.override(stage_tile=CONFIGS["all_heads"], stage_tma=True):
        got = _run(strided, True)
        assert not _run.tma
    for a, b in zip(got[:3], ref[:3]):
        assert torch.equal(a, b)
    # head_dim whose half is not a power of two (no TMA box for it)
    assert not stage._tma_4d(torch.empty(1, 2, 3, 96, dtype=torch.bfloat16), 48)
    assert stage._tma_4d(torch.empty(1, 2, 3, 128, dtype=torch.bfloat16), 64)
