"""What a fused forward computes with, decided once per state of the modules in the projection's place.

Every fused forward asks what sits in q/k/v_proj's places (:func:`~.fused_projection.projection_slots`:
the rows modules apply_to left, PEFT LoRA layers over them, anything else refused), which of
PEFT's adapters apply and how (:class:`~.peft.LoRAOperands`), and the FP8 recipe
(:func:`~.fused_projection.slots_fp8_recipe`): ~100 module attribute reads a layer, tens of
microseconds of host time per layer per step, for an answer that changes only when the model is
changed. :func:`projection_plan` keeps that answer per attention module with a fingerprint of
everything those decisions read, and reuses it while a new fingerprint is equal:

* the module in each place (``qkv_proj``, each of q/k/v_proj, the ``base_layer`` under a PEFT
  LoRA layer, the fused projection a rows module reads) by identity, and its class;
* ``qkv_proj``'s weight and bias classes, and the weight's torchao MX training config where
  ``quantize_`` wrapped it (:func:`~.fused_projection.slots_fp8_recipe` reads its recipe);
* the attention's other children (``o_proj``, the norms) by identity with their classes and their
  weights' classes (a torchao conversion of ``o_proj`` with the block left in 16 bits is warned of);
* the norms the block computes: their hooks, whether ``forward`` was set, and their eps attributes
  (the HF forward checks them again, and takes the block's eps from them, once per state: ``eps``);
* each such module's hooks (forward, forward pre, backward, backward pre: how many) and whether
  ``forward`` was set on it; in q/k/v_proj's places, the forward pre-hooks' functions too (PEFT's
  mixed-batch hook, new each call, is read every call by :class:`~.peft.MixedBatchLoRA`; another in
  its place is refused);
* per PEFT LoRA layer: ``disable_adapters``, ``merged``, the active adapters; per active adapter
  its A, B and dropout modules (with their classes and hooks), A's and B's weight parameters
  (identity, dtype; A's rank and device) and B's bias, the scaling, ``use_dora``, the LoRA
  variant, and the dropout's class, ``training`` and ``p``.

Any change to these gives a new fingerprint, so the full checks run again at the first forward
after it and raise there as they did before anything was kept. The decisions never read the
weights' values; what depends on tensor state runs every call: bitsandbytes' quantization state
(:func:`~.qlora.check_4bit`). (A rows module's view with an assigned ``.data`` writes the fused rows
at once: :class:`~.fused_projection.RowsView`.) A torchao ``Float8Linear`` in a rows module's place
(``convert_to_float8_training`` after ``apply_to``): its config, and its weight's and bias's and the fused
parameters' identities and storage addresses (what its check reads). Not kept: anything under
``torch.compile`` (traced as before).
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from .fused_projection import (UnsupportedModuleError, _is_float8_linear, hook_counts,
                               projection_slots, slots_fp8_recipe)
from ..ops.fp8 import forget_frozen_weight_casts
from .peft import LoRAOperands, MixedBatchLoRA, _pairs

# attention module -> its ProjectionPlan (weak: a plan never keeps a model alive, and is neither
# pickled nor deep-copied with it)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ProjectionPlan:
    """One state's answer: ``slots`` (:func:`projection_slots`' list), ``lora``
    (:class:`LoRAOperands`), ``fp8`` (the recipe), and ``key`` (the fingerprint it holds for;
    None: not kept)."""

    def __init__(self, attn, spec):
        self.slots = projection_slots(attn, spec.projs, spec.quantized, spec.fused_name)  # raises on anything unsupported
        n_rows = sum(spec.split)
        # PEFT's mixed-batch inference (adapter_names in the LoRA layers' pre-hooks), or the active adapters
        self.lora = (MixedBatchLoRA.of(self.slots, spec.split, n_rows)
                     or LoRAOperands(_pairs(self.slots, spec.split), n_rows))
        self.fp8 = slots_fp8_recipe(attn, self.slots, spec.block_kwargs.get("fp8"), spec.fused_name)
        self.quantized = spec.quantized
        self.where = type(attn).__name__
        self.key = None
        # the parameters whose id() is in the key stay alive with the plan (no id reused meanwhile)
        self.kept = [w for p in self.lora.pairs for w in (p[3].weight, p[4].weight)]
        if any(_is_float8_linear(m) for _, m, _ in self.slots):  # (their parameters' ids: _fingerprint)
            fused = attn._modules.get(spec.fused_name)
            self.kept += [m._parameters.get(a) for _, m, _ in self.slots for a in ("weight", "bias")]
            self.kept += [fused._parameters.get(a) for a in ("weight", "bias")]
        self._dequantized = {}  # (dtype, device) -> qlora.DequantizedQKV, kept with the plan
        self.eps = None  # the block's eps from the norms as this state holds them (the HF forward's checks set it)

    def dequantized(self, bases: list, dtype: torch.dtype, device: torch.device):
        """The 4-bit slots' :class:`~.qlora.DequantizedQKV` in ``dtype``: on a kept plan one per dtype
        and device, keeping the projections' dequantized absmax between calls; else a new one."""
        from .qlora import DequantizedQKV

        if self.key is None:
            return DequantizedQKV(bases, dtype, device)
        source = self._dequantized.get((dtype, device))
        if source is None or source.bases != bases:
            source = self._dequantized[(dtype, device)] = DequantizedQKV(bases, dtype, device, keep_absmax=True)
        return source

    def per_call(self) -> None:
        """What the fingerprint does not cover, on a kept plan: the 4-bit layers' quantization state."""
        if self.quantized:
            from .qlora import check_4bit

            for name, m, _ in self.slots:
                check_4bit(f"{self.where}.{name}", m, m.in_features, UnsupportedModuleError)


def projection_plan(attn, spec) -> ProjectionPlan:
    """The :class:`ProjectionPlan` of a fused attention's forward now (kept while its fingerprint
    holds; the full checks, and their errors, otherwise)."""
    if torch.compiler.is_compiling():
        return ProjectionPlan(attn, spec)
    key = _fingerprint(attn, spec.projs, spec.fused_name, spec.norms)
    plan = _PLANS.get(attn)
    if plan is not None and key is not None and plan.key == key:
        plan.per_call()
        return plan
    plan = ProjectionPlan(attn, spec)
    # the modules changed (PEFT's merge and unmerge write the fused weight through .data, which leaves its
    # version counter as it was): the fused weight's kept FP8 casts (config.fp8_frozen_weight_cache) go too
    w = getattr(attn._modules.get(spec.fused_name), "_parameters", {}).get("weight")
    if w is not None:
        forget_frozen_weight_casts(w)
    if key is not None:
        plan.key = key
        _PLANS[attn] = plan
    else:
        _PLANS.pop(attn, None)
    return plan


def _lora_classes() -> tuple:
    # the classes unwrap_lora takes (PEFT is imported wherever one exists)
    out = []
    for module, cls in (("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.bnb", "Linear4bit")):
        mod = sys.modules.get(module)
        c = getattr(mod, cls, None) if mod is not None else None
        if c is not None:
            out.append(c)
    return tuple(out)


def _fingerprint(attn, projs: tuple, fused_name: str, norms: tuple = ()):
    """Everything the plan's decisions read (the module docstring lists it), as one flat tuple
    compared with ``==`` (modules by identity; parameters by ``id``, kept alive by the plan);
    None where a place holds no module (the full checks name it). One function, locals only: it
    runs every forward of every layer."""
    mods = attn._modules
    fused = mods.get(fused_name)
    key = []
    add = key.extend
    if isinstance(fused, nn.Module):
        add((fused, type(fused), hook_counts(fused)))
        # its parameters' classes (and a wrapper's config): quantize_ with torchao's MX training config
        # swaps them for wrapped ones, whose recipe the block then runs
        w, b = fused._parameters.get("weight"), fused._parameters.get("bias")
        add((type(w), type(b), getattr(w, "config", None)))
    else:
        key.append(fused)
    # the attention's other children and their weights' classes: one of them in torchao's low precision
    # while the block stays in 16 bits is warned of (slots_fp8_recipe), a conversion after the first forward too
    for name, m in mods.items():
        if name != fused_name and name not in projs:
            add((m, type(m), type(m._parameters.get("weight")) if isinstance(m, nn.Module) else None))
    # the norms the block computes: their hooks and eps (HF's norms read their eps every call)
    for name in norms:
        m = mods.get(name)
        if isinstance(m, nn.Module):
            # a wrapper (PEFT's modules_to_save): the norms it holds too
            for sub in (m.modules() if m.__dict__["_modules"] else (m,)):
                d = sub.__dict__
                add((sub, type(sub), hook_counts(sub), d.get("variance_epsilon"), d.get("eps")))
    lora_classes = _lora_classes()
    float8_linear = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    float8_slots = False
    for name in projs:
        slot = mods.get(name)
        if not isinstance(slot, nn.Module):
            return None
        cls = type(slot)
        hooks = hook_counts(slot)
        add((slot, cls, hooks))
        if hooks[1]:  # forward pre-hooks: which functions (PEFT's adapter_names hook, new each call, or another)
            add(tuple(getattr(h, "func", h) for h in slot.__dict__["_forward_pre_hooks"].values()))
        if cls is float8_linear and isinstance(fused, nn.Module):
            # torchao's Float8Linear over the rows: what _check_float8_rows reads (the fused parameters' part once,
            # after the loop), its recipe's config
            float8_slots = True
            key.append(id(slot.__dict__.get("config")))
            add(_identity_and_storage(slot._parameters))
            continue
        if cls not in lora_classes:
            key.append(slot.__dict__.get("fused"))
            continue
        lora, children = slot, slot._modules
        base = children.get("base_layer")
        if not isinstance(base, nn.Module):
            return None
        add((base, type(base), hook_counts(base), base.__dict__.get("fused")))
        # what peft._adapters and LoRAOperands read of the LoRA layer
        disabled, merged = lora.disable_adapters, lora.merged
        add((disabled, merged))
        if disabled or merged:  # no adapter applies (disabled and merged: the full path unmerges)
            continue
        active = tuple(lora.active_adapters)
        key.append(active)
        a_dict, b_dict, drop_dict = children.get("lora_A"), children.get("lora_B"), children.get("lora_dropout")
        if not (isinstance(a_dict, nn.Module) and isinstance(b_dict, nn.Module) and isinstance(drop_dict, nn.Module)):
            return None
        scaling, use_dora, variants = lora.scaling, lora.use_dora, getattr(lora, "lora_variant", None) or {}
        for a in active:
            A = a_dict._modules.get(a)
            if A is None:  # not an adapter of this layer: skipped
                key.append(None)
                continue
            B, drop = b_dict._modules.get(a), drop_dict._modules.get(a)
            if B is None or drop is None:
                return None
            wa, wb = A._parameters.get("weight"), B._parameters.get("weight")
            if not (isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor)):
                return None
            add((A, B, type(A), type(B), hook_counts(A), hook_counts(B), hook_counts(drop), id(wa), id(wb), wa.dtype,
                 wb.dtype, wa.shape[0], wa.device, B._parameters.get("bias") is None, scaling.get(a),
                 bool(use_dora.get(a, False)), variants.get(a) is None, drop, type(drop), drop.training,
                 drop.__dict__.get("p")))
    if float8_slots:
        add(_identity_and_storage(fused._parameters))
    return tuple(key)


def _identity_and_storage(params: dict) -> tuple:
    """A module's weight's and bias's ids and storage addresses (0 where absent)."""
    w, b = params.get("weight"), params.get("bias")
    return (id(w), w.data_ptr() if w is not None else 0, id(b), b.data_ptr() if b is not None else 0)
