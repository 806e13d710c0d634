"""DDP, FSDP2 (also mixed precision, activation checkpointing, torch.compile) and head-parallel
TP=2 on the CPU: two processes over gloo (torch.multiprocessing), the block's PyTorch backend,
fp32, tiny sizes. Each check compares gradients of one step and a 20-step loss curve with the
single process's whole-batch run (tests/distributed/dist_harness.py).

The two processes run every check once (a module-scoped fixture); each test below asserts one
check's verdict. Skipped under torchrun (test_dist_torchrun.py runs the checks there).
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import dist_harness as H  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
    pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="under torchrun: test_dist_torchrun.py runs the checks"),
]

WORLD_SIZE = 2
DEADLINE_S = 300  # a hung collective must fail the test, not the CI job
CHECKS = ["ddp", "ddp_functional", "ddp_ac", "ddp_autocast", "fsdp", "fsdp_mp", "fsdp_functional_ac", "tp",
          "tp_kv_bias_offset", "tp_reference", "tp_layouts", "tp_layouts_kv_bias_offset", "tp_state_dict",
          "tp_state_dict_kv_bias", "tp_errors", "fsdp_compile", "tp_compile", "tp_compile_kv_bias_offset"]


def _spawn(tmp, world_size, opts):
    out = tmp / "results.json"
    H.run_processes(H.gloo_worker, (world_size, str(tmp / "pg"), str(out), opts), world_size, DEADLINE_S)
    with open(out) as f:
        return {r["key"]: r for r in json.load(f)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    # aot_eager: dynamo + AOT autograd through FSDP2's hooks and DTensor, without a C++ build
    return _spawn(tmp, WORLD_SIZE, dict(compile="aot_eager", tmpdir=str(tmp)))


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("key", CHECKS)
def test_check(results, key):
    r = results[key]
    bad = {k: v for k, v in r["errors"].items()
           if v > r["tolerances"].get("loss" if k == "loss_curve" else "grad", 0.0)}
    assert r["ok"], (f"{r['check']}: over tolerance {bad}; decreased={r.get('decreased')}; "
                     f"{r.get('messages', '')} {r.get('compile', '')}")


def test_loss_curves_are_twenty_steps(results):
    for key in ("ddp", "fsdp", "tp", "tp_kv_bias_offset", "fsdp_compile", "tp_compile"):
        r = results[key]
        assert len(r["losses"]) == len(r["single_losses"]) == H.STEPS
        assert r["decreased"], (key, r["single_losses"])


def test_compile_compiled_the_layer(results):
    # FSDP2's hooks are dynamo-disabled (graph breaks around them); the head-parallel layer is one graph
    assert results["fsdp_compile"]["compile"]["graphs"] >= 1
    assert results["tp_compile"]["compile"] == dict(graphs=1, graph_breaks=0, break_reasons=[])
    assert results["tp_compile_kv_bias_offset"]["compile"] == {
        "seq-sharded": dict(graphs=1, graph_breaks=0, break_reasons=[])}


def test_compiled_equals_eager(results):
    """The head-parallel block under torch.compile (the collectives traced) and its eager call
    (one autograd Function, c10d's collectives) agree: outputs and every gradient (also
    cos/sin's)."""
    errs = {k: v for k, v in results["tp_compile_kv_bias_offset"]["errors"].items() if "compiled_vs_eager" in k}
    assert len(errs) == 10 and max(errs.values()) <= 1e-6, errs  # q, k, v, input, cos, sin, 4 parameters


def test_shared_kv_heads_bias_and_offset_were_checked(results):
    """The checks of fewer KV heads than ranks, the bias and the offset compared what they claim."""
    r = results["tp_kv_bias_offset"]
    assert "grad:block.qkv_bias" in r["errors"] and "grad:trained:qkv_bias" in r["errors"]
    assert r["errors"]["global_shape_not_canonical:qkv_weight"] == 0.0
    lay = results["tp_layouts_kv_bias_offset"]["errors"]
    for layout in ("replicated", "seq-sharded", "dtensor-input"):
        assert f"{layout}:grad:qkv_bias" in lay and f"{layout}:input" in lay


def test_bf16_checks_are_looser_than_fp32(results):
    # mixed precision is compared at bf16 tolerance; everything else at fp32's
    assert results["fsdp_mp"]["tolerances"]["grad"] == H.TOLERANCES["cpu", torch.bfloat16]["grad"]
    assert results["fsdp"]["tolerances"]["grad"] == H.TOLERANCES["cpu", torch.float32]["grad"]
    assert results["fsdp"]["errors"]["grad:block.qkv_weight"] < 1e-6


@pytest.mark.skipif(os.environ.get("FUSEDQKV_TEST_4_PROCS") != "1",
                    reason="4 processes (~30 s on 2 cores): set FUSEDQKV_TEST_4_PROCS=1")
def test_fsdp2_on_top_of_tp(tmp_path):
    """4 processes: mesh 2 x 2, FSDP2 over dp on a head-parallel layer over tp (also with one KV
    head, bias and offset); tp=4 with KV heads shared by 2 and 4 ranks, checkpoints moving
    between tp=4, tp=2 and one process."""
    res = _spawn(tmp_path, 4, dict(only=["fsdp_tp", "fsdp_tp_kv_bias_offset", "tp_kv_degrees"],
                                   tmpdir=str(tmp_path)))
    assert sorted(res) == ["fsdp_tp", "fsdp_tp_kv_bias_offset", "tp_kv_degrees"]
    for r in res.values():
        assert r["ok"], (r["check"], r["errors"])
