"""Decode-like and tiny shapes through the Triton kernels (interpreter): the shape classes of
issue 15 and of benchmarks/gpu_fuzz.py -- one token (batch 1, seq 1), a single head group,
2 and 3 tokens, one-token sequences in a batch, the smallest head_dims -- for the 091 entry point
(bit-equal to the CPU path, which reproduces the official reference) and the training API (against
float64 autograd). The GPU compile of these specialisations (an int argument equal to 1 is a
compile-time constant there, not here) is test_gpu_targets' part."""

import functools

import _oracle
import pytest
import torch

import fusedqkv
from fusedqkv import gqa_qkv_rope_qk_norm, gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem
from fusedqkv.module import reference_block
from fusedqkv.ops import config

# (batch, heads, kv_heads, seq, head_dim)
TINY_091 = {
    "b1_s1_one_head": (1, 1, 1, 1, 64),          # one token, one query and one KV head
    "b1_s1_one_group_each": (1, 8, 8, 1, 128),   # one token, one 8-head group of each
    "b1_s1_gqa": (1, 4, 1, 1, 256),
    "b1_s2": (1, 4, 2, 2, 64),
    "b1_s3": (1, 2, 1, 3, 64),
    "b3_s1_decode": (3, 2, 1, 1, 64),            # one-token sequences in a batch
    "b2_s3_mha": (2, 3, 3, 3, 64),
    "head_dim_2": (1, 2, 1, 1, 2),               # HALF = 1
    "head_dim_6": (1, 2, 2, 3, 6),               # HALF = 3, padded to 4
}

make_inputs = functools.partial(_oracle.make_inputs, hidden=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", list(TINY_091.values()), ids=list(TINY_091))
def test_091_triton_bit_equals_cpu_path_at_tiny_shapes(shape, dtype):
    args = make_inputs(*shape, dtype=dtype, seed=sum(shape))
    cpu = gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    tri = gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    for name, a, b in zip(_oracle.OUTPUT_NAMES, cpu, tri):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if dtype == torch.float32:  # fp32 sums in another order: a few ulps
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max())), name
        else:  # 16-bit: every rounding point of the reference reproduced
            assert torch.equal(a, b), name


@pytest.mark.parametrize("shape", [TINY_091[k] for k in ("b1_s1_one_head", "b1_s3", "b3_s1_decode")],
                         ids=["b1_s1_one_head", "b1_s3", "b3_s1_decode"])
def test_091_triton_matches_official_reference_at_tiny_shapes(shape):
    """The official reference (its head constants set to the shape's) and its tolerance check."""
    ref = _oracle.official_reference_for(shape[1], shape[2], shape[4])
    if ref is None:
        pytest.skip("official SOL-ExecBench pack not found beside the repo")
    args = make_inputs(*shape, seed=7)
    got = gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    want = ref(*args)
    w = problem.load_definition().workload("w11_b1_s128")  # the smallest workload's tolerance
    for c in problem.check_outputs(_oracle.OUTPUT_NAMES, got, want, w):
        assert c.passed, c
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # grad_cos / grad_sin


@pytest.mark.parametrize("products", ["pdl_chain", "hybrid"])
@pytest.mark.parametrize("shape", [TINY_091[k] for k in ("b1_s1_one_head", "b1_s2", "b3_s1_decode")],
                         ids=["b1_s1_one_head", "b1_s2", "b3_s1_decode"])
def test_091_triton_products_at_one_to_three_tokens(shape, products):
    """The Triton product paths the GPU takes at a few tokens (the TMA matmul chained behind the
    stage, the hybrid dW) with one to three rows of dQKV."""
    changes = dict(triton_products_in_interpreter=True, chain_min_balance=0.0)
    if products == "hybrid":
        changes["chain_max_tokens"] = 0
    args = make_inputs(*shape, seed=11)
    cpu = gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    with config.override(**changes):
        tri = gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
        assert fusedqkv.ops.backward_091.PLANS.last().path == ("chain" if products == "pdl_chain" else "hybrid")
    for name, a, b in zip(_oracle.OUTPUT_NAMES, cpu, tri):
        if name in ("grad_hidden_states", "grad_qkv_weight"):  # fp32 sums in another order than torch.mm
            a32, b32 = a.float(), b.float()
            assert ((a32 - b32).abs() <= a32.abs() * 2 ** -7 + 1e-6).all(), name
        else:
            assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ training API


def _reference(x, w, wq, wk, cos, sin, hq, hkv, eps, position):
    return reference_block(x, w, wq, wk, cos, sin, hq, hkv, eps, position == "after_rope")


# (batch, heads, kv_heads, seq, head_dim, hidden)
TINY_TRAIN = {
    "b1_s1_one_head": (1, 1, 1, 1, 64, 32),
    "b1_s1_one_group_each": (1, 8, 8, 1, 64, 16),
    "b1_s2_mqa": (1, 4, 1, 2, 128, 24),
    "b1_s3": (1, 2, 1, 3, 64, 33),
    "b3_s1_decode": (3, 2, 2, 1, 64, 16),
    "head_dim_2": (1, 3, 1, 2, 2, 8),
}


@pytest.mark.parametrize("cos_grad", [True, False], ids=["cos_trainable", "cos_frozen"])
@pytest.mark.parametrize("position", ["after_rope", "before_rope"])
@pytest.mark.parametrize("shape", list(TINY_TRAIN.values()), ids=list(TINY_TRAIN))
def test_training_api_triton_at_tiny_shapes(shape, position, cos_grad):
    """fp32 outputs and every gradient (cos/sin ones when trainable) within 1e-4 of float64
    autograd (relative to the largest value)."""
    b, hq, hkv, s, d, hidden = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(b, s, hidden, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, hidden, generator=g) / hidden ** 0.5
    wq, wk = 1 + 0.2 * torch.randn(d, generator=g), 1 + 0.2 * torch.randn(d, generator=g)
    ang = torch.randn(b, s, d // 2, generator=g) * 3
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    grads = [torch.randn(b, n, s, d, generator=g) for n in (hq, hkv, hkv)]

    def run(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, wq, wk)]
        cs = [t.detach().to(dtype).requires_grad_(cos_grad) for t in (cos, sin)]
        out = fn(*leaves, *cs)
        wrt = leaves + (cs if cos_grad else [])
        return list(out) + list(torch.autograd.grad(out, wrt, [t.to(dtype) for t in grads]))

    ours = run(torch.float32, lambda *a: gqa_qkv_rope_qk_norm(*a, num_heads=hq, num_kv_heads=hkv, eps=1e-6,
                                                              qk_norm_position=position, backend="triton"))
    ref = run(torch.float64, lambda *a: _reference(*a, hq, hkv, 1e-6, position))
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert a.shape == r.shape, i
        err = float((a.detach().double() - r.detach()).abs().max() / r.detach().abs().max().clamp_min(1e-30))
        assert err < 1e-4, (i, err)


# ------------------------------------------------------------------------------ error messages


def _mismatched_hidden(api):
    """hidden_states 4088 wide against a 4096-column qkv_weight (the issue's example)."""
    hq, hkv, d, b, s = 2, 1, 64, 1, 2
    x = torch.randn(b, s, 4088)
    w = torch.randn((hq + 2 * hkv) * d, 4096)
    if api == "train":
        return lambda: fusedqkv.gqa_qkv_rope_qk_norm(x, w, torch.ones(d), torch.ones(d), torch.ones(b, s, d),
                                                    torch.zeros(b, s, d), num_heads=hq, num_kv_heads=hkv)
    args = make_inputs(b, hq, hkv, s, d, hidden=4096, dtype=torch.float32)
    args[3], args[6] = x, w
    return lambda: fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)


@pytest.mark.parametrize("api", ["091", "train"])
def test_hidden_size_mismatch_names_both_arguments_and_sizes(api):
    with pytest.raises(ValueError) as info:
        _mismatched_hidden(api)()
    msg = str(info.value)
    for word in ("hidden_states", "qkv_weight", "4088", "4096"):
        assert word in msg, (word, msg)
