"""``fusedqkv.apply_to`` on a Hugging Face model under FSDP2, on the CPU: two gloo processes, a tiny Qwen3
(``tests/_hf_models.py``), fp32. Each flow runs on the fused model and on the same model without fusedqkv,
and the two must agree:

- ``fsdp2``: apply_to, then ``fully_shard`` per layer: the loss and every gradient of a step, three AdamW
  steps, the full state dict (HF's keys and values), the sharded one (q/k/v as DTensors placed as the
  unfused model's);
- ``meta``: deferred init (torchtitan's order): built on meta, apply_to, ``fully_shard``, ``to_empty``,
  ``set_model_state_dict(full_state_dict=True)``; ``meta_gemma4`` the same with Gemma 4 (rows [Q | K]);
- ``accelerate``: accelerate's FSDP2 low-memory loading (``cpu_ram_efficient_loading``): rank 0 loaded,
  the other ranks on meta, apply_to on each, then ``fsdp2_load_full_state_dict``;
- ``dcp``: sharded ``torch.distributed.checkpoint`` checkpoints from the unfused model into the fused one
  and back;
- ``sharded_first``: apply_to after ``fully_shard`` is refused, naming the remedy, before anything changes;
- ``broadcast``: ``set_model_state_dict(broadcast_from_rank0=True)``, which cannot reach the fused
  parameter on ranks other than 0 (it sends parameter names), fails there naming q/k/v's keys (not a silent
  partial load).

Skipped under torchrun.
"""

import copy
import datetime
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import dist_harness  # noqa: E402

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
    pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="under torchrun"),
]

WORLD_SIZE = 2
DEADLINE_S = 240
COLLECTIVE_TIMEOUT_S = 30
FLOWS = ["fsdp2", "meta", "meta_gemma4", "accelerate", "dcp", "sharded_first", "broadcast"]
TOL = 1e-5  # relative, fp32: the fused block against HF's eager attention input


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _worker(rank, world_size, init_file, out_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    torch.set_num_threads(1)
    # a flow that fails on one rank leaves the other in a collective: it times out and the next flow runs
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        results = _flows(rank, out_dir)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


def _flows(rank, out_dir):
    import _hf_models as H
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import fusedqkv

    built = H.build("qwen3", True, seed=3)
    ids = H.batch(2, 10, seed=rank)  # each rank its own data

    def shard(m):
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        return m

    def on_meta(fuse, make=lambda: H.model_class("qwen3")(H.config("qwen3", True))):
        with torch.device("meta"):
            m = make()
        if fuse:
            fusedqkv.apply_to(m)
        return m

    def unsaved_buffers(m, built=built):  # HF's non-persistent buffers (rotary inv_freq): in no state dict
        return H.copy_unsaved_buffers(m, built)

    def compare(m, ref, steps=1):
        """The fused model ``m`` against ``ref``: the full state dicts (HF's keys), then the losses of ``steps``
        AdamW steps and the first step's gradients (the fused weight's against HF's three joined)."""
        full = [get_model_state_dict(x, options=StateDictOptions(full_state_dict=True)) for x in (m, ref)]
        errs = {"full_state_dict_keys": float(list(full[0]) != list(full[1])),
                "full_state_dict": max(float((full[0][k] - full[1][k]).abs().max()) for k in full[1])}
        opts = [torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (m, ref)]
        for step in range(steps):
            losses = []
            for x, opt in zip((m, ref), opts):
                loss = x(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.detach())
            errs[f"loss{step}"] = _rel(*losses)
            if step == 0:
                got = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
                want = {n: p.grad.full_tensor() for n, p in ref.named_parameters()}
                for n, g in got.items():
                    if ".qkv_proj." in n:  # HF's projections joined in the block's order (Gemma 4's [Q | K])
                        base, kind = n.split(".qkv_proj.")
                        w = torch.cat([want[f"{base}.{p}.{kind}"] for p in m.get_submodule(base)._fusedqkv.projs])
                    else:
                        w = want[n]
                    errs[f"grad:{n}"] = _rel(g, w)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        return errs

    out = {}

    def flow(name, fn):
        try:
            out[name] = dict(errors=fn())
        except Exception as e:  # noqa: BLE001 - the verdict names it
            out[name] = dict(raised=f"{type(e).__name__}: {e}")

    def fsdp2():
        m = copy.deepcopy(built)
        fusedqkv.apply_to(m)
        m, ref = shard(m), shard(copy.deepcopy(built))
        sd, sd_ref = m.state_dict(), ref.state_dict()
        errs = {"sharded_keys": float(list(sd) != list(sd_ref))}
        for p in ("q", "k", "v"):
            key = f"model.layers.0.self_attn.{p}_proj.weight"
            a, b = sd[key], sd_ref[key]
            same = (isinstance(a, DTensor) and a.placements == b.placements and a.to_local().shape == b.to_local().shape
                    and torch.equal(a.to_local(), b.to_local()))
            errs[f"sharded:{p}_proj"] = float(not same)
        return {**errs, **compare(m, ref, steps=3)}

    def meta():
        models = []
        for fuse in (True, False):
            m = shard(on_meta(fuse))
            m.to_empty(device="cpu")
            set_model_state_dict(m, built.state_dict(), options=StateDictOptions(full_state_dict=True))
            models.append(unsaved_buffers(m))
        return compare(*models)

    def meta_gemma4():
        """The same with Gemma 4 (its global layer's rows are [Q | K]: v is the k projection; the KV-shared
        layer stays HF's)."""
        import _hf_families as F

        fam = F.family("gemma4_text")
        built4 = F.build(fam, seed=3)
        models = []
        for fuse in (True, False):
            m = shard(on_meta(fuse, lambda: F.model_class(fam)(F.config(fam))))
            m.to_empty(device="cpu")
            set_model_state_dict(m, built4.state_dict(), options=StateDictOptions(full_state_dict=True))
            models.append(unsaved_buffers(m, built4))
        errs = compare(*models)
        errs["k_eq_v_layer_fused"] = float(not any(mod._fusedqkv.projs == ("q_proj", "k_proj")
                                                   for mod in models[0].modules() if hasattr(mod, "_fusedqkv")))
        return errs

    def accelerate():
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

        class Accelerator:  # what fsdp2_load_full_state_dict reads of one
            is_main_process = rank == 0
            device = torch.device("cpu")

        models = []
        for fuse in (True, False):
            m = copy.deepcopy(built) if rank == 0 else on_meta(False)
            if fuse:
                fusedqkv.apply_to(m)
            full = m.state_dict()  # accelerate's fsdp2_prepare_model: the state dict, then the model to meta
            m = shard(m.to(torch.device("meta")))
            fsdp2_load_full_state_dict(Accelerator, m, full)
            models.append(unsaved_buffers(m))
        return compare(*models)

    def dcp():
        import torch.distributed.checkpoint as dcp

        ref = shard(copy.deepcopy(built))
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1.25)
        dcp.save(ref.state_dict(), checkpoint_id=os.path.join(out_dir, "unfused"))
        m = copy.deepcopy(built)
        fusedqkv.apply_to(m)
        m = shard(m)
        sd = m.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(out_dir, "unfused"))
        m.load_state_dict(sd)
        errs = compare(m, ref)
        dcp.save(m.state_dict(), checkpoint_id=os.path.join(out_dir, "fused"))
        back = shard(copy.deepcopy(built))
        sd = back.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(out_dir, "fused"))
        back.load_state_dict(sd)
        errs["fused_to_unfused"] = max(_rel(a.full_tensor(), b.full_tensor()) for a, b in
                                       zip(back.state_dict().values(), m.state_dict().values()))
        return errs

    def sharded_first():  # apply_to after fully_shard: refused before anything changes
        m = shard(copy.deepcopy(built))
        keys = list(m.state_dict())
        try:
            fusedqkv.apply_to(m)
        except ValueError as e:
            return {"unchanged": float(list(m.state_dict()) != keys
                                       or type(m.model.layers[0].self_attn).__name__ != "Qwen3Attention"),
                    "message": str(e)}
        return {"refused": 0.0}

    def broadcast():  # last: rank 0 loads, the others refuse; no collective follows
        m = shard(on_meta(True))
        m.to_empty(device="cpu")
        set_model_state_dict(m, built.state_dict() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return {}

    for name in FLOWS:
        flow(name, locals()[name])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_fsdp")
    dist_harness.run_processes(_worker, (WORLD_SIZE, str(tmp / "pg"), str(tmp)), WORLD_SIZE, DEADLINE_S, poll_s=2)
    out = []
    for r in range(WORLD_SIZE):
        with open(tmp / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("name", ["fsdp2", "meta", "meta_gemma4", "accelerate", "dcp"])
def test_flow_matches_the_model_without_fusedqkv(results, name):
    if name == "accelerate":
        pytest.importorskip("accelerate")
    if name == "meta_gemma4":
        import _hf_families

        _hf_families.family("gemma4_text")  # skips where the installed transformers has no Gemma 4
    for rank, res in enumerate(results):
        r = res[name]
        assert "raised" not in r, (rank, r.get("raised"))
        bad = {k: v for k, v in r["errors"].items() if v > TOL}
        assert not bad, (rank, bad)
        assert any(k.startswith("grad:") and "qkv_proj" in k for k in r["errors"])


def test_apply_to_after_fully_shard_is_refused_with_the_remedy(results):
    for res in results:
        r = res["sharded_first"]["errors"]
        assert "message" in r, r
        assert "is a DTensor" in r["message"] and "call apply_to before fully_shard" in r["message"], r["message"]
        assert r["unchanged"] == 0.0


def test_broadcast_from_rank0_fails_on_the_other_ranks_naming_hfs_keys(results):
    """Rank 0 loads; the others raise, with q/k/v missing under HF's names (as the model without fusedqkv
    would name them), not a silent partial load."""
    assert "raised" not in results[0]["broadcast"], results[0]["broadcast"]
    for res in results[1:]:
        msg = res["broadcast"].get("raised", "")
        assert "Missing key(s)" in msg and "self_attn.q_proj.weight" in msg and "self_attn.v_proj.bias" in msg, msg
        assert "qkv_proj" not in msg, msg
