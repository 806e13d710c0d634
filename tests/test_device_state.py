"""fusedqkv.cache_info() and fusedqkv.clear_caches() on the CPU (the Triton interpreter keeps
the same per-stream buffers as a GPU): what is kept is listed, with its bytes, and clearing drops
plans and buffers; the next call rebuilds them with the same result."""

import pytest
import torch

import fusedqkv
from fusedqkv.ops import config

# the CPU tensors go through the Triton interpreter (on a GPU machine: tests/test_gpu_graphs.py)
pytestmark = pytest.mark.skipif(not config.INTERPRET, reason="runs the Triton kernels on CPU tensors: TRITON_INTERPRET=1")

from _oracle import make_inputs


def _plans(info):
    return {name: c["plans"] for name, c in info["plans"].items()}


def test_cache_info_lists_plans_and_buffers_and_clear_drops_them():
    fusedqkv.clear_caches()
    info = fusedqkv.cache_info()
    assert info["bytes"] == 0 and info["buffers"] == [] and set(_plans(info).values()) == {0}
    assert set(info["plans"]) == {"backward_091", "training_forward", "training_backward", "fp8 cast launches",
                                  "fp8 scaled matmuls"}
    args = make_inputs(1, 4, 2, 9, 32, hidden=32, seed=2)
    ref = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    torch.manual_seed(0)
    x = torch.randn(1, 5, 32, requires_grad=True)
    w = torch.randn(64, 32, requires_grad=True)
    wq, wk = torch.ones(8, requires_grad=True), torch.ones(8, requires_grad=True)
    ang = torch.randn(1, 5, 8)
    q, k, v = fusedqkv.gqa_qkv_rope_qk_norm(x, w, wq, wk, ang.cos(), ang.sin(), num_heads=4, num_kv_heads=2,
                                            backend="triton")
    (q.sum() + k.sum() + v.sum()).backward()
    info = fusedqkv.cache_info()
    assert _plans(info)["backward_091"] == 1
    assert _plans(info)["training_forward"] == 1 and _plans(info)["training_backward"] == 1
    # the interpreter's stage keeps its tickets per stream, as on a GPU
    kinds = {b["kind"] for b in info["buffers"]}
    assert "tickets" in kinds
    assert info["bytes"] == sum(b["bytes"] for b in info["buffers"]) > 0
    assert "fast_path" in info
    fusedqkv.clear_caches()
    info = fusedqkv.cache_info()
    assert info["bytes"] == 0 and info["buffers"] == [] and set(_plans(info).values()) == {0}
    again = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(ref, again))
    assert fusedqkv.cache_info()["plans"]["backward_091"]["plans"] == 1


def test_builds_count_and_config_keys():
    fusedqkv.clear_caches()
    args = make_inputs(1, 4, 2, 6, 32, hidden=32, seed=3)
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    with config.override(hybrid_max_tokens=0):  # another config: another plan
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="torch")
    c = fusedqkv.cache_info()["plans"]["backward_091"]
    assert c["plans"] == 2 and c["builds"] >= 2


def test_config_changes_parse_as_the_fields_types():
    """``config.parse_changes`` (the benchmarks' ``--variant`` and ``--config``) types each value as its
    field's default, and refuses an unknown field or a value of the wrong kind, naming it."""
    got = config.parse_changes("chain_dx_above_128=128,64,64,4,6,1; chain_min_balance=0;cublaslt=0;"
                               "fused_forward=on;stage_tile=none;hybrid_dx_first_max_tokens=0")
    assert got == dict(chain_dx_above_128=(128, 64, 64, 4, 6, 1), chain_min_balance=0.0, cublaslt=False,
                       fused_forward="on", stage_tile=None, hybrid_dx_first_max_tokens=0)
    assert type(got["chain_min_balance"]) is float and type(got["hybrid_dx_first_max_tokens"]) is int
    with config.override(**got) as cfg:
        assert cfg.chain_dx_above_128 == (128, 64, 64, 4, 6, 1) and cfg.cublaslt is False
    assert config.parse_changes("") == {}
    assert config.parse_variant("dwfirst:hybrid_dx_first_max_tokens=0") == ("dwfirst", dict(hybrid_dx_first_max_tokens=0))
    for bad in ("no_colon", ":cublaslt=0"):
        with pytest.raises(ValueError, match="NAME:CHANGES"):
            config.parse_variant(bad)
    for bad, named in (("no_such_field=1", "no_such_field"), ("chain_dx=1,x", "chain_dx"),
                       ("cublaslt=maybe", "cublaslt"), ("chain_max_tokens", "chain_max_tokens")):
        with pytest.raises(ValueError, match=named):
            config.parse_changes(bad)
