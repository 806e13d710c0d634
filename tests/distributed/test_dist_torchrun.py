"""DDP, FSDP2 (mixed precision, activation checkpointing, torch.compile with inductor) and
head-parallel TP on GPUs, one process per GPU over NCCL. Run on a 2-GPU machine with

    TRITON_INTERPRET=0 PYTHONPATH=src torchrun --nproc-per-node 2 -m pytest -q tests/distributed/test_dist_torchrun.py

Every rank runs the same checks in the same order (they are collective); verdicts are maxima
over ranks, so all ranks pass or fail together. Skipped outside torchrun or without
WORLD_SIZE CUDA devices.
"""

import datetime
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import dist_harness as H  # noqa: E402

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "0"))

pytestmark = pytest.mark.skipif(
    WORLD_SIZE < 2 or not torch.cuda.is_available() or torch.cuda.device_count() < WORLD_SIZE
    or not dist.is_nccl_available(),
    reason="run under torchrun --nproc-per-node 2 on a machine with 2 CUDA GPUs")


@pytest.fixture(scope="module")
def process_group():
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.fail("TRITON_INTERPRET=1 (tests/conftest.py's default): run with TRITON_INTERPRET=0 on the GPU")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    yield
    dist.destroy_process_group()


def _log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


@pytest.fixture(scope="module")
def bf16_results(process_group):
    # one directory for every rank (one machine), for the DCP checkpoints of the state-dict check
    tmp = [tempfile.mkdtemp(prefix="fusedqkv_dist_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    res = H.run_checks("cuda", H.GPU, torch.bfloat16, compile_backend="inductor", tmpdir=tmp[0], log=_log)
    return {r["key"]: r for r in res}


@pytest.fixture(scope="module")
def fp32_results(process_group):
    res = H.run_checks("cuda", H.GPU, torch.float32, log=_log,
                       only=["ddp", "fsdp", "tp", "tp_kv_bias_offset", "tp_reference", "tp_layouts",
                             "tp_layouts_kv_bias_offset"])
    return {r["key"]: r for r in res}


BF16_CHECKS = ["ddp", "ddp_functional", "ddp_ac", "ddp_autocast", "fsdp", "fsdp_mp", "fsdp_functional_ac", "tp",
               "tp_kv_bias_offset", "tp_reference", "tp_layouts", "tp_layouts_kv_bias_offset", "tp_state_dict",
               "tp_state_dict_kv_bias", "tp_errors", "fsdp_compile", "tp_compile", "tp_compile_kv_bias_offset"]


def _assert_ok(r):
    bad = {k: v for k, v in r["errors"].items()
           if v > r["tolerances"].get("loss" if k == "loss_curve" else "grad", 0.0)}
    assert r["ok"], f"{r['check']}: over tolerance {bad}; decreased={r.get('decreased')}; {r.get('messages', '')}"


@pytest.mark.parametrize("key", BF16_CHECKS)
def test_bf16(bf16_results, key):
    _assert_ok(bf16_results[key])


@pytest.mark.parametrize("key", ["ddp", "fsdp", "tp", "tp_kv_bias_offset", "tp_reference", "tp_layouts",
                                 "tp_layouts_kv_bias_offset"])
def test_fp32(fp32_results, key):
    _assert_ok(fp32_results[key])
