"""What the LoRA and QLoRA tests share: one training step's logits and trainable gradients, the
relative error they are compared by, and a QLoRA model's dense twin."""

import copy

import torch
from torch import nn


def step(m, ids):
    """(logits, {name: grad}) of one loss.backward() from zeroed gradients."""
    m.zero_grad(set_to_none=True)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}


def rel(a, b):
    """The relative error ||a - b|| / ||b|| (Frobenius, in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def dense_copy(m):
    """A deep copy of ``m`` with every bitsandbytes 4-bit layer replaced by a frozen nn.Linear of
    its dequantized weight (bitsandbytes has no fp32/fp64 product of its own to compare with)."""
    import bitsandbytes as bnb

    m = copy.deepcopy(m)
    for mod in list(m.modules()):
        for name, child in list(mod.named_children()):
            if type(child) is bnb.nn.Linear4bit:
                w = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state)
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device=w.device)
                with torch.no_grad():
                    lin.weight.copy_(w)
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                lin.requires_grad_(False)
                setattr(mod, name, lin)
    return m


# register_<kind> -> the module's hook dict it writes
_HOOK_DICTS = {"forward_hook": "_forward_hooks", "forward_pre_hook": "_forward_pre_hooks",
               "full_backward_hook": "_backward_hooks", "full_backward_pre_hook": "_backward_pre_hooks"}


def add_hook(mod, kind="forward_hook"):
    """A no-op hook on ``mod`` (``mod.register_<kind>``), its handle returned. fusedqkv's own modules in the
    projection's place refuse the registration (checked here); on those the hook is written into the hook dict
    as ``register_<kind>`` writes it, which the next forward must still refuse."""
    import pytest
    from torch.utils.hooks import RemovableHandle

    from fusedqkv.integrations.fused_projection import FusedQKVProjection, ProjectionRows, UnsupportedModuleError

    def fn(*args):
        return None

    if not isinstance(mod, (FusedQKVProjection, ProjectionRows)):
        return getattr(mod, f"register_{kind}")(fn)
    with pytest.raises(UnsupportedModuleError, match=f"{type(mod).__name__} refuses a"):
        getattr(mod, f"register_{kind}")(fn)
    hooks = getattr(mod, _HOOK_DICTS[kind])
    handle = RemovableHandle(hooks)
    hooks[handle.id] = fn
    return handle
