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


def assert_bf16_like_peft(got, grads, want, want_grads, want32, grads32):
    """The three-way rule of a bf16 run: the fused model's logits and trainable gradients (``got``,
    ``grads``) against the fp32 reference (``want32``, ``grads32``), beside the unfused model's in the
    same precision (``want``, ``want_grads``).

    * the logits' error at most twice the unfused model's, plus 1e-3;
    * every gradient's error at most 4x the unfused model's, plus 2e-2: a wrong gradient (an adapter
      left out, a scaling missed) is off by 0.3 or more, while bf16 rounding in another order puts
      one tiny model's gradient anywhere from 0.4x to 3.2x the unfused model's error (session 39: 12
      seeds of the QLoRA autocast case, geomean 1.00x; the former 2x + 1e-2 failed 2 of them);
    * all gradients together (one vector) at most 1.5x the unfused model's error (0.75-1.21x over
      those seeds): a precision lost throughout shows here."""
    assert rel(got, want32) <= 2 * rel(want, want32) + 1e-3
    names = sorted(grads32)
    assert sorted(grads) == names
    for n in names:
        assert rel(grads[n], grads32[n]) <= 4 * rel(want_grads[n], grads32[n]) + 2e-2, n

    def cat(g):
        return torch.cat([g[n].detach().double().flatten() for n in names])

    assert rel(cat(grads), cat(grads32)) <= 1.5 * rel(cat(want_grads), cat(grads32))


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
