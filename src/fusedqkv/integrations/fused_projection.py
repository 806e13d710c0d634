"""The modules in the projection's place after ``apply_to``, and the check that nothing else is.

* :class:`FusedQKVProjection` (``qkv_proj``): the one parameter of the joined q/k/v weights
  (rows ``[Q | K | V]``) and bias. It is deliberately no ``nn.Linear``: PEFT's ``all-linear``
  and torchao's float8 conversion would wrap it, and the fused block would not run their
  wrapper.
* :class:`ProjectionRows` (``q_proj``/``k_proj``/``v_proj``): an ``nn.Linear`` over rows of
  ``qkv_proj`` (its ``weight``/``bias`` are views of the fused parameters, no parameters of their
  own), so that what users target by HF's names -- PEFT's ``target_modules``, a module filter --
  finds the module it expects, and whatever wraps it is seen by the fused forward.
* :func:`projection_slots`: at every fused forward, what sits in those places. A PEFT LoRA layer
  over the rows is computed (:mod:`fusedqkv.integrations.peft`); anything else that replaces,
  wraps or hooks them raises :class:`UnsupportedModuleError` naming it: the fused block reads
  the weights itself, so such a module would otherwise never run. Over bitsandbytes 4-bit q/k/v
  (:mod:`fusedqkv.integrations.qlora`) there are no rows modules and no ``qkv_proj``: the slots
  are the 4-bit layers themselves, plain or under PEFT's ``lora.bnb.Linear4bit``.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UnsupportedModelError


class UnsupportedModuleError(UnsupportedModelError):
    """A module in the fused block's place (or a hook on it) that the block cannot compute."""


class FusedQKVProjection(nn.Module):
    """The joined q/k/v projection of a fused attention: ``weight`` ``[rows, in_features]``, rows
    ``[Q | K | V]`` (``split`` rows each), ``bias`` or None. Called directly it is ``x W^T + b``."""

    def __init__(self, weight: nn.Parameter, bias, split: tuple):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.split = tuple(split)
        self.weight = weight
        self.bias = bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} = {' + '.join(map(str, self.split))}, "
                f"bias={self.bias is not None}")


class ProjectionRows(nn.Linear):
    """Rows ``[start, stop)`` of a :class:`FusedQKVProjection`, as the ``nn.Linear`` HF had there.

    ``weight``/``bias`` are cached ``nn.Parameter`` views of the fused parameters' rows (never
    registered: the fused parameter is the one that trains and is saved). In-place changes through
    them (PEFT's merge) change the fused weight; a replaced ``.data`` (PEFT's safe merge) is
    copied back by :meth:`sync` (every fused forward and every state_dict calls it)."""

    def __init__(self, fused: FusedQKVProjection, start: int, stop: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = fused.in_features, stop - start
        # not a child: the fused projection is the attention's own child
        object.__setattr__(self, "fused", fused)
        object.__setattr__(self, "rows", (start, stop))
        object.__setattr__(self, "_views", {})

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):
            raise AttributeError(f"{type(self).__name__}.{name} is rows {self.rows[0]}:{self.rows[1]} of the fused "
                                 f"qkv_proj.{name}; assign to that parameter's data instead")
        super().__setattr__(name, value)

    def _row_ptr(self, src) -> int:
        return src.data_ptr() + self.rows[0] * src.stride(0) * src.element_size()

    def _view(self, name: str):
        src = getattr(self.fused, name)
        if src is None:
            return None
        start, stop = self.rows
        cached = self._views.get(name)
        if cached is not None:
            owner, ptr, view, row_ptr = cached
            if owner is src and ptr == src.data_ptr() and view.data_ptr() == row_ptr:
                if view.requires_grad != src.requires_grad:
                    view.requires_grad_(src.requires_grad)
                return view
        view = nn.Parameter(src.data[start:stop], requires_grad=src.requires_grad)
        # (the fused parameter, its address, the view, the rows' address: the view's own until its
        # .data is replaced)
        self._views[name] = (src, src.data_ptr(), view, self._row_ptr(src))
        return view

    @property
    def weight(self):
        return self._view("weight")

    @property
    def bias(self):
        return self._view("bias")

    def sync(self) -> None:
        """Copy a view whose ``.data`` was replaced back into the fused rows (and refresh it)."""
        if not self._views:  # (every fused forward calls this)
            return
        start, stop = self.rows
        params = self.fused._parameters  # (not Module.__getattr__: a microsecond a call)
        for name, (owner, ptr, view, row_ptr) in list(self._views.items()):
            src = params.get(name)
            if src is None:
                src = getattr(self.fused, name)
            if src is not owner or ptr != src.data_ptr():  # the fused parameter moved: the view is stale
                del self._views[name]
            elif view.data_ptr() != row_ptr:
                if tuple(view.shape) != (stop - start, *src.shape[1:]):
                    raise UnsupportedModuleError(
                        f"fusedqkv: rows {start}:{stop} of qkv_proj.{name} were replaced by a tensor of shape "
                        f"{tuple(view.shape)}; expected {(stop - start, *src.shape[1:])}")
                with torch.no_grad():
                    src.data[start:stop].copy_(view.data)
                # a write through .data leaves the version counter as it was: a frozen weight's kept FP8 casts go
                from ..ops.fp8 import forget_frozen_weight_casts

                forget_frozen_weight_casts(src)
                del self._views[name]

    def _apply(self, fn, recurse=True):
        self._views.clear()  # the fused parameters move with their own module
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows {self.rows[0]}:{self.rows[1]} of qkv_proj")


def _hooks(m: nn.Module) -> list:
    """The kinds of module hook ``m`` carries (the fused block never calls it: none would run)."""
    kinds = [("forward hook", m._forward_hooks), ("forward pre-hook", m._forward_pre_hooks),
             ("backward hook", m._backward_hooks), ("backward pre-hook", m._backward_pre_hooks)]
    return [kind for kind, hooks in kinds if hooks]


def hook_counts(m: nn.Module) -> tuple:
    """What a kept decision about ``m`` depends on of its hooks (:mod:`.projection_plan`)."""
    return (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks),
            "forward" in m.__dict__)


def unwrap_lora(m) -> tuple:
    """``(lora, base)``: a PEFT ``lora.Linear`` or, over a bitsandbytes 4-bit layer, PEFT's
    ``lora.bnb.Linear4bit`` (exactly those classes; PEFT is imported wherever one exists) and the
    module under it, or ``(None, m)``."""
    for module, cls in (("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.bnb", "Linear4bit")):
        mod = sys.modules.get(module)
        if mod is not None and type(m) is getattr(mod, cls, None):
            return m, m.base_layer
    return None, m


def _describe(m) -> str:
    cls = type(m)
    return f"{cls.__module__}.{cls.__qualname__}"


def projection_slots(attn, projs: tuple, quantized: bool = False) -> list:
    """What computes each fused projection: ``[(name, rows module, LoRA layer or None)]``, after
    checking that ``qkv_proj`` and the rows modules are the ones ``apply_to`` put there, unhooked,
    or PEFT LoRA layers over them (raises :class:`UnsupportedModuleError` naming anything else).
    ``quantized``: an attention fused over bitsandbytes 4-bit q/k/v (:mod:`.qlora`): those layers
    are the rows modules, and there is no ``qkv_proj``."""
    where = type(attn).__name__
    if quantized:
        return _quantized_slots(attn, projs, where)
    fused = attn._modules.get("qkv_proj")
    if type(fused) is not FusedQKVProjection:
        raise UnsupportedModuleError(
            f"fusedqkv: {where}.qkv_proj is a {_describe(fused)}; the fused block computes only the "
            f"FusedQKVProjection that apply_to put there (wrap q_proj/k_proj/v_proj instead, with a wrapper "
            f"fusedqkv supports: PEFT LoRA)")
    hooked = _hooks(fused)
    if hooked or "forward" in fused.__dict__:
        raise UnsupportedModuleError(f"fusedqkv: {where}.qkv_proj has a {hooked[0] if hooked else 'replaced forward'}; "
                                     f"the fused block never calls the module, so it would not run")
    out = []
    start = 0
    for name in projs:
        lora, m = unwrap_lora(attn._modules.get(name))
        stop = start + (m.out_features if isinstance(m, nn.Linear) else 0)
        if lora is None and _is_float8_linear(m) and not _hooks(m) and "forward" not in m.__dict__:
            _check_float8_rows(where, name, m, fused, start, stop)
            out.append((name, m, None))
            start = stop
            continue
        start = stop
        if type(m) is not ProjectionRows or m.fused is not fused:
            what = _describe(lora if lora is not None else m)
            if lora is not None:
                what += f" over a {_describe(m)}"
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{name} is a {what}; the fused block computes {name} as rows of qkv_proj, "
                f"plain or under a PEFT LoRA layer, and cannot compute this module (it would be bypassed)" +
                _hint(lora if lora is not None else m))
        _check_unhooked(where, name, lora, m)
        m.sync()
        out.append((name, m, lora))
    return out


def _is_torchao_mx(m) -> bool:
    """torchao's MX training in a projection's place: an ``MXFP8Linear``, or a weight that
    ``MXFP8TrainingOpConfig`` wrapped (``MXFP8TrainingWeightWrapperTensor``)."""
    return any(type(o).__module__.startswith("torchao.prototype") and type(o).__name__.upper().startswith("MX")
               for o in (m, getattr(m, "weight", None)))


def is_mx_wrapped(t) -> bool:
    """``t`` a parameter that torchao's MX training wrapped (``quantize_`` with an
    ``MXFP8TrainingOpConfig``: an ``MXFP8TrainingWeightWrapperTensor`` holding the plain tensor and
    the config)."""
    cls = type(t)
    return cls.__module__.startswith("torchao.prototype") and cls.__name__.startswith("MXFP8") and hasattr(t, "config")


def mx_plain(t):
    """``t``'s plain tensor where torchao's MX training wrapped it, else ``t`` (not differentiable:
    apply_to's copy of the weights)."""
    return t._data if is_mx_wrapped(t) else t


def torchao_mx_config(m):
    """What describes torchao's MX training of module ``m`` (:func:`_is_torchao_mx`): an
    ``MXFP8Linear`` itself (its fields are the config's), else its wrapped weight's config."""
    return m if type(m).__name__ == "MXFP8Linear" else m.weight.config


def fused_weights(proj: "FusedQKVProjection") -> tuple:
    """``(weight, bias)`` of the fused projection as the block reads them: a parameter that torchao's
    MX training wrapped (``quantize_`` over ``qkv_proj`` after apply_to) through torchao's
    differentiable unwrap, so that its gradient reaches the wrapped parameter."""
    w, b = proj.weight, proj.bias
    if is_mx_wrapped(w) or (b is not None and is_mx_wrapped(b)):
        from torchao.prototype.moe_training.utils import unwrap_weight

        w = unwrap_weight(w) if is_mx_wrapped(w) else w
        b = unwrap_weight(b) if b is not None and is_mx_wrapped(b) else b
    return w, b


def _is_float8_linear(m) -> bool:
    mod = sys.modules.get("torchao.float8.float8_linear")
    return mod is not None and type(m) is getattr(mod, "Float8Linear", None)


def _check_float8_rows(where: str, name: str, m, fused, start: int, stop: int) -> None:
    """A torchao ``Float8Linear`` in a rows module's place (``convert_to_float8_training`` after
    ``apply_to``) is computed by the fused block only over the fused rows themselves."""
    for attr in ("weight", "bias"):
        src, got = getattr(fused, attr), getattr(m, attr)
        if src is None and got is None:
            continue
        ok = (src is not None and got is not None and type(got.data) is torch.Tensor
              and tuple(got.shape) == (stop - start, *src.shape[1:])
              and got.data_ptr() == src.data_ptr() + start * src.stride(0) * src.element_size())
        if not ok:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{name} is a torchao Float8Linear whose {attr} is not rows {start}:{stop} of "
                f"qkv_proj.{attr} (a {type(got.data).__name__ if got is not None else 'None'}); the fused block "
                f"computes only the Float8Linear that convert_to_float8_training made of apply_to's rows")


def _is_torchao_tensor(t) -> bool:
    """``t`` one of torchao's tensor subclasses (a training wrapper, a quantized weight)."""
    return t is not None and type(t).__module__.startswith("torchao.")


def _torchao_low_precision(m) -> bool:
    """Module ``m`` computes in torchao's low precision: a ``Float8Linear``, an MX training layer or
    weight, or a weight of another torchao tensor subclass (``quantize_``)."""
    return _is_float8_linear(m) or _is_torchao_mx(m) or _is_torchao_tensor(getattr(m, "_parameters", {}).get("weight"))


def slots_fp8_recipe(attn, slots: list, given):
    """The FP8 recipe of a fused forward: ``given`` (``apply_to(fp8=...)``), or the torchao
    ``Float8Linear`` layers' in the rows' places (all of them, one recipe), or torchao's MX training
    wrapper on ``qkv_proj``'s weight; a mix raises, as does any other torchao tensor subclass on
    ``qkv_proj``. Where the block stays in 16 bits while another projection of the same attention
    computes in torchao's low precision, a warning says so."""
    recipe = _slots_fp8_recipe(attn, slots, given)
    if recipe is None:
        low = [name for name, m in attn._modules.items()
               if name != "qkv_proj" and m is not None and _torchao_low_precision(m)]
        if low:
            warnings.warn(
                f"fusedqkv: {type(attn).__name__}.{low[0]} computes in torchao's low precision but the fused q/k/v "
                f"projection (qkv_proj) does not: it runs in {attn._modules['qkv_proj'].weight.dtype}. torchao's "
                f"default quantize_ filter takes nn.Linear layers, and the fused qkv_proj is not one: pass a filter_fn "
                f"that also takes names ending in 'qkv_proj' (MXFP8TrainingOpConfig), use convert_to_float8_training "
                f"(it converts q/k/v_proj), or apply_to(model, fp8=...)", UserWarning, stacklevel=2)
    return recipe


def _slots_fp8_recipe(attn, slots: list, given):
    from ..ops.fp8 import recipe_of_torchao_config

    where = type(attn).__name__
    f8 = [(name, m) for name, m, _ in slots if _is_float8_linear(m)]
    fused = attn._modules.get("qkv_proj")
    w = getattr(fused, "weight", None)
    for attr, t in (("weight", w), ("bias", getattr(fused, "bias", None))):
        if _is_torchao_tensor(t) and not is_mx_wrapped(t):
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.qkv_proj.{attr} is torchao's {type(t).__name__}; the fused block computes with a "
                f"plain parameter or torchao's MX training wrapper (MXFP8TrainingOpConfig). For float8 training use "
                f"convert_to_float8_training (Float8Linear in q/k/v_proj's places) or apply_to(model, fp8=...)")
    if w is not None and is_mx_wrapped(w):  # torchao's MX training over qkv_proj (quantize_ after apply_to)
        from ..ops.fp8 import recipe_of_torchao_mx_config

        if f8:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.qkv_proj.weight is wrapped by torchao's MX training and {f8[0][0]} is a torchao "
                f"Float8Linear; the fused projection is one GEMM, one recipe")
        try:
            got = recipe_of_torchao_mx_config(w.config, f"{where}.qkv_proj.weight")
        except ValueError as e:
            raise UnsupportedModuleError(f"fusedqkv: {e}") from None
        if given is not None and given != got:
            raise UnsupportedModuleError(f"fusedqkv: {where}: apply_to(fp8={given.key!r}) but qkv_proj.weight is "
                                         f"wrapped by torchao's MX training of the recipe {got.key!r}")
        return got
    if not f8:
        return given
    if len(f8) != len(slots):
        plain = [name for name, m, _ in slots if not _is_float8_linear(m)]
        raise UnsupportedModuleError(
            f"fusedqkv: {where}.{f8[0][0]} is a torchao Float8Linear but {', '.join(plain)} is not; the fused "
            f"projection is one GEMM: convert all of {', '.join(name for name, _, _ in slots)} or none")
    recipes = {name: recipe_of_torchao_config(m.config, f"{where}.{name}") for name, m in f8}
    if len(set(recipes.values())) > 1:
        raise UnsupportedModuleError(f"fusedqkv: {where}: the Float8Linear layers of {', '.join(recipes)} have "
                                     f"different float8 configs; the fused projection is one GEMM, one recipe")
    got = next(iter(recipes.values()))
    if given is not None and given != got:
        raise UnsupportedModuleError(f"fusedqkv: {where}: apply_to(fp8={given.key!r}) but the Float8Linear layers "
                                     f"in q/k/v_proj's places have the recipe {got.key!r}")
    return got


def _check_unhooked(where: str, name: str, lora, m) -> None:
    for mod, label in ((lora, f"{name}"), (m, f"{name}" + (".base_layer" if lora is not None else ""))):
        if mod is None:
            continue
        hooked = _hooks(mod)
        if hooked or "forward" in mod.__dict__:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{label} has a {hooked[0] if hooked else 'replaced forward'} "
                f"({_describe(mod)}); the fused block never calls the module, so it would not run")


def _quantized_slots(attn, projs: tuple, where: str) -> list:
    from .qlora import check_4bit, is_4bit

    out = []
    for name in projs:
        lora, m = unwrap_lora(attn._modules.get(name))
        if not is_4bit(m):
            what = _describe(lora if lora is not None else m)
            if lora is not None:
                what += f" over a {_describe(m)}"
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{name} is a {what}; this attention was fused over bitsandbytes 4-bit q/k/v, and "
                f"the fused block computes {name} as a bitsandbytes Linear4bit, plain or under a PEFT LoRA layer, "
                f"and cannot compute this module (it would be bypassed)" + _hint(lora if lora is not None else m))
        _check_unhooked(where, name, lora, m)
        check_4bit(f"{where}.{name}", m, m.in_features, UnsupportedModuleError)
        out.append((name, m, lora))
    return out


def _hint(m) -> str:
    mod = type(m).__module__
    if mod.startswith("torchao.float8"):
        return "; fusedqkv runs torchao's Float8Linear over apply_to's rows only, unwrapped and unhooked"
    if mod.startswith("torchao.prototype") and type(m).__name__.upper().startswith("MX"):
        return ("; for torchao's MX training, convert q/k/v_proj before apply_to, or after it wrap qkv_proj's "
                "weight (quantize_ with a filter_fn that takes qkv_proj)")
    if mod.startswith("peft."):
        return "; of PEFT's methods fusedqkv computes LoRA (lora.Linear) only"
    if mod.startswith("bitsandbytes"):
        from .qlora import REFUSED_8BIT, is_8bit

        if is_8bit(m):
            return "; " + REFUSED_8BIT
        return ("; fusedqkv fuses 4-bit q/k/v only when apply_to finds them quantized (load the model with a "
                "BitsAndBytesConfig, then call apply_to)")
    return ""
