"""Session 40: apply_to under FSDP2 on one CUDA rank (NCCL, world size 1): the state-dict hooks' DTensor paths on CUDA
tensors (gather, shard, distribute_tensor without communication) and the Triton block under FSDP2, against the same
model without fusedqkv. Prints one line per flow; JSON to $OUT/w/fsdp_cuda.json."""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "tests")


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import _hf_models as H
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import fusedqkv

    built = H.build("qwen3", True, seed=3).cuda()
    ids = H.batch(2, 16).cuda()

    def shard(m):
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        return m

    def on_meta(fuse):
        with torch.device("meta"):
            m = H.model_class("qwen3")(H.config("qwen3", True))
        if fuse:
            fusedqkv.apply_to(m)
        shard(m).to_empty(device="cuda")
        set_model_state_dict(m, built.state_dict(), options=StateDictOptions(full_state_dict=True))
        return H.copy_unsaved_buffers(m, built)

    def compare(m, ref):
        full = [get_model_state_dict(x, options=StateDictOptions(full_state_dict=True)) for x in (m, ref)]
        sd_err = max(float((full[0][k] - full[1][k]).abs().max()) for k in full[1])
        outs = []
        for x in (m, ref):
            out = x(input_ids=ids, labels=ids)
            out.loss.backward()
            outs.append(out)
        g = m.model.layers[0].self_attn.qkv_proj.weight.grad.full_tensor()
        r = ref.model.layers[0].self_attn
        gr = torch.cat([getattr(r, f"{p}_proj").weight.grad.full_tensor() for p in "qkv"])
        return dict(keys_equal=list(full[0]) == list(full[1]), state_dict_max_err=sd_err,
                    logits_rel=float((outs[0].logits - outs[1].logits).abs().max() / outs[1].logits.abs().max()),
                    qkv_grad_rel=float((g - gr).abs().max() / gr.abs().max()),
                    fused_block_ran=type(m.model.layers[0].self_attn).__name__.startswith("FusedQKV"))

    res = {}
    m = copy.deepcopy(built)
    fusedqkv.apply_to(m)
    res["fsdp2"] = compare(shard(m), shard(copy.deepcopy(built)))
    res["meta"] = compare(on_meta(True), on_meta(False))
    os.makedirs(os.path.join(os.environ.get("OUT", "."), "w"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "w", "fsdp_cuda.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k, v in res.items():
        ok = v["keys_equal"] and v["state_dict_max_err"] == 0 and v["logits_rel"] < 1e-4 and v["qkv_grad_rel"] < 1e-3
        print(f"{k:8s} {'PASS' if ok else 'FAIL'} {v}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
