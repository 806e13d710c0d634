"""The modules in the projection's place after ``apply_to``, and the check that nothing else is.

* :class:`FusedQKVProjection` (``qkv_proj``): the one parameter of the joined q/k/v weights
  (rows ``[Q | K | V]``) and bias. It is deliberately no ``nn.Linear``: PEFT's ``all-linear``
  and torchao's float8 conversion would wrap it, and the fused block would not run their
  wrapper.
* :class:`ProjectionRows` (``q_proj``/``k_proj``/``v_proj``): an ``nn.Linear`` over rows of
  ``qkv_proj`` (its ``weight``/``bias`` are views of the fused parameters, no parameters of their
  own), so that what users target by HF's names -- PEFT's ``target_modules``, a module filter --
  finds the module it expects, and whatever wraps it is seen by the fused forward. Where HF's
  attention already has one joined ``qkv_proj`` Linear (Ergo), that name is the rows module over
  all rows and the fused projection is ``qkv_fused``.
* :func:`projection_slots`: at every fused forward, what sits in those places. A PEFT LoRA layer
  over the rows is computed (:mod:`fusedqkv.integrations.peft`); anything else that replaces,
  wraps or hooks them raises :class:`UnsupportedModuleError` naming it: the fused block reads
  the weights itself, so such a module would otherwise never run. Over bitsandbytes 4-bit q/k/v
  (:mod:`fusedqkv.integrations.qlora`) there are no rows modules and no ``qkv_proj``: the slots
  are the 4-bit layers themselves, plain or under PEFT's ``lora.bnb.Linear4bit``.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UnsupportedModelError
from ..ops.internals import assume_constant_result, compile_guards_new_hooks


class UnsupportedModuleError(UnsupportedModelError):
    """A module in the fused block's place (or a hook on it) that the block cannot compute."""


class RowsAssignmentError(UnsupportedModuleError, AttributeError):
    """A new weight or bias assigned to a :class:`ProjectionRows` (an AttributeError too: the attribute
    cannot be set)."""


TORCHAO_QUANTIZED = ("torchao's quantize_ with an inference config (int8/int4/float8 weight-only or dynamic) is not "
                     "computed by the fused block, which takes q/k/v in 16 bits, in FP8 training (apply_to(fp8=...), "
                     "torchao's convert_to_float8_training, or quantize_ with its MX training config and a filter_fn "
                     "that takes qkv_proj) or as bitsandbytes 4-bit layers: give quantize_ a filter_fn that leaves "
                     "q/k/v_proj out, or leave apply_to out of an inference model")


class _RefusesHooks:
    """Module hooks refused as they are registered: the fused block computes these modules' rows itself and
    never calls them. Refused here, not only at the next forward: under ``torch.compile`` on torch 2.11 a
    hook added after compiling is not seen (no empty module hook dict is guarded there), so the next call
    would not look. A hook written straight into a hook dict is still refused at the next forward (compiled:
    from torch 2.12)."""

    def register_forward_hook(self, *args, **kwargs):
        _refuse_hook(self, "forward hook")

    def register_forward_pre_hook(self, *args, **kwargs):
        _refuse_hook(self, "forward pre-hook")

    def register_full_backward_hook(self, *args, **kwargs):
        _refuse_hook(self, "backward hook")

    def register_full_backward_pre_hook(self, *args, **kwargs):
        _refuse_hook(self, "backward pre-hook")

    def register_backward_hook(self, *args, **kwargs):
        _refuse_hook(self, "backward hook")

    def register_parameter(self, name, param):
        # only the fused projection's own weight and bias (set, assigned or loaded); refused before anything
        # changes, since a reparametrisation's first step is to register the original under a new name
        if not (isinstance(self, FusedQKVProjection) and name in ("weight", "bias")):
            _refuse_parameter(self, name)
        super().register_parameter(name, param)


class FusedQKVProjection(_RefusesHooks, nn.Module):
    """The joined q/k/v projection of a fused attention: ``weight`` ``[rows, in_features]``, rows
    ``[Q | K | V]`` (``split`` rows each), ``bias`` or None. Called directly it is ``x W^T + b``."""

    def __init__(self, weight: nn.Parameter, bias, split: tuple):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.split = tuple(split)
        self.weight = weight
        self.bias = bias
        # (name, start) -> (the fused parameter, the RowsView over its rows) of every rows view made and not let go:
        # what a torchao Float8Linear in a rows module's place must hold (_check_float8_rows)
        self.__dict__["_rows_views"] = {}

    def __setattr__(self, name, value):
        _refuse_forward(self, name)
        super().__setattr__(name, value)

    def __getstate__(self):
        # a copy's views are other storage than its rows: none of them is registered
        state = self.__dict__.copy()
        state["_rows_views"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_rows_views", {})  # (pickled by a release without the register)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        # where the parameters got other storage (.to(), .half()), the views made before no longer show their rows
        registry = self.__dict__["_rows_views"]
        for key, (src, view) in list(registry.items()):
            now = self._parameters.get(key[0])
            if now is not src or view.data_ptr() != _rows_ptr(now, key[1]):
                del registry[key]
        return out

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} = {' + '.join(map(str, self.split))}, "
                f"bias={self.bias is not None}")


# the ``.data`` and ``.requires_grad`` descriptors of every tensor (torch's own attributes, read and written through
# them), and its ``requires_grad_``
_TENSOR_DATA = torch.Tensor.data
_TENSOR_REQUIRES_GRAD = torch.Tensor.requires_grad
_TENSOR_REQUIRES_GRAD_ = torch.Tensor.requires_grad_


def _shows_fused_rows(view: torch.Tensor):
    """``(fused parameter, start, stop)`` where ``view`` still shows its rows, else None."""
    fused, start, stop, _, _ = view.__dict__.get("_fusedqkv_rows", (None, 0, 0, None, None))
    if fused is None or _TENSOR_DATA.__get__(view).data_ptr() != _rows_ptr(fused, start):
        return None  # (the fused parameter moved: a plain tensor of its own)
    return fused, start, stop


def _check_rows_requires_grad(view: torch.Tensor, value) -> None:
    """Refuse a ``requires_grad`` on rows of the fused parameter other than that parameter's own."""
    rows = _shows_fused_rows(view)
    if rows is None:
        return
    fused, start, stop = rows
    if bool(value) != fused.requires_grad:
        raise UnsupportedModuleError(
            f"fusedqkv: requires_grad={bool(value)} on rows {start}:{stop} of the fused q/k/v projection's parameter, "
            f"which has requires_grad={fused.requires_grad}: q, k and v are one parameter after apply_to and train or "
            f"freeze together. Set it on the fused parameter (the FusedQKVProjection's, `qkv_proj.weight`/`.bias` in "
            f"named_parameters), or freeze q/k/v_proj before apply_to (all three alike: apply_to refuses a mix)"
            f"{_peft_setter_hint()}")


def _peft_setter_hint() -> str:
    """Where PEFT itself set it: PEFT's other methods freeze the base weight as they wrap a projection (AdaLoRA's
    SVDLinear), so the user meets this error inside get_peft_model: name the module and what fusedqkv takes."""
    frame = sys._getframe(1)  # the first frame outside fusedqkv, whatever the depth of fusedqkv's own calls
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fusedqkv."):
        frame = frame.f_back
    caller = "" if frame is None else frame.f_globals.get("__name__", "")
    if not caller.startswith("peft."):
        return ""
    return f" (set by {caller} as it wrapped the projection: of PEFT's methods fusedqkv computes LoRA only)"


def _refuse_rows_grad(view: torch.Tensor) -> None:
    """A gradient reaching a rows view (a loss on ``q_proj.weight`` itself: a penalty, a regulariser) would stay in
    the view's ``.grad``, which no optimizer holds: refused as the backward reaches it. Hooked once, where the view
    requires grad (a view follows the fused parameter's flag: hooked when that turns on)."""
    if not _TENSOR_REQUIRES_GRAD.__get__(view) or view.__dict__.get("_fusedqkv_grad_refused"):
        return
    _, start, stop, _, (name, _) = view.__dict__["_fusedqkv_rows"]

    def refuse(grad):
        raise UnsupportedModuleError(
            f"fusedqkv: a gradient reached rows {start}:{stop} of the fused q/k/v projection's {name} through a "
            f"q/k/v_proj.{name}, a view of those rows that no optimizer holds: it would be lost. Compute with the "
            f"fused parameter's rows instead (qkv_proj.{name}[{start}:{stop}]), or call the projection module, "
            f"which does")

    view.register_hook(refuse)
    view.__dict__["_fusedqkv_grad_refused"] = True


def _rows_ptr(src: torch.Tensor, start: int) -> int:
    """The address of row ``start`` of ``src``."""
    return src.data_ptr() + start * src.stride(0) * src.element_size()


class RowsView(nn.Parameter):
    """A :class:`ProjectionRows`' ``weight``/``bias``: an ``nn.Parameter`` over rows ``[start, stop)`` of
    the fused parameter. Assigning its ``.data`` (PEFT's safe merge does) writes those rows instead of
    giving the view other storage, so the fused parameter is always what the view shows and the fused
    forward never has to look for a replaced view (nothing to check per call: traceable by
    ``torch.compile``)."""

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    # q/k/v train as one parameter: a rows view frozen (or unfrozen) alone would be set back to the fused
    # parameter's flag at its next access, and its rows would train (or stay frozen) regardless
    @property
    def requires_grad(self):
        return _TENSOR_REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value):
        _check_rows_requires_grad(self, value)
        _TENSOR_REQUIRES_GRAD.__set__(self, value)
        if "_fusedqkv_rows" in self.__dict__:
            _refuse_rows_grad(self)

    def requires_grad_(self, requires_grad=True):
        _check_rows_requires_grad(self, requires_grad)
        out = _TENSOR_REQUIRES_GRAD_(self, requires_grad)
        if "_fusedqkv_rows" in self.__dict__:
            _refuse_rows_grad(self)
        return out

    @data.setter
    def data(self, value):
        rows = _shows_fused_rows(self)
        if rows is None:  # a plain view, no longer registered as the rows
            _, _, _, registry, key = self.__dict__.get("_fusedqkv_rows", (None, 0, 0, {}, None))
            if registry.get(key, (None, None))[1] is self:
                del registry[key]
            _TENSOR_DATA.__set__(self, value)
            return
        fused, start, stop = rows
        here = _TENSOR_DATA.__get__(self)
        if tuple(value.shape) != tuple(here.shape):
            raise UnsupportedModuleError(
                f"fusedqkv: rows {start}:{stop} of the fused projection were given a .data of shape {tuple(value.shape)}; expected "
                f"{tuple(here.shape)} (the view's .data is written into the fused parameter's rows)")
        if value.data_ptr() != here.data_ptr():  # (``view.data += d`` hands back the rows themselves)
            with torch.no_grad():
                here.copy_(value)
            # a write through .data leaves the version counter as it was: a frozen weight's kept FP8 casts go
            from ..ops.fp8 import forget_frozen_weight_casts

            forget_frozen_weight_casts(fused)


class ProjectionRows(_RefusesHooks, nn.Linear):
    """Rows ``[start, stop)`` of a :class:`FusedQKVProjection`, as the ``nn.Linear`` HF had there.

    ``weight``/``bias`` are :class:`RowsView` parameters over the fused parameters' rows, kept in the fused
    projection's register (never registered here: the fused parameter is the one that trains and is saved). In-place changes through
    them (PEFT's merge) change the fused weight, and so does an assigned ``.data`` (PEFT's safe merge)."""

    def __init__(self, fused: FusedQKVProjection, start: int, stop: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = fused.in_features, stop - start
        # not a child: the fused projection is the attention's own child
        object.__setattr__(self, "fused", fused)
        object.__setattr__(self, "rows", (start, stop))

    def __setattr__(self, name, value):
        _refuse_forward(self, name)
        if name in ("weight", "bias"):
            raise RowsAssignmentError(
                f"fusedqkv: {type(self).__name__}.{name} cannot be replaced: it is rows {self.rows[0]}:{self.rows[1]} of "
                f"the fused q/k/v projection's {name}, which the fused block reads itself, so a new tensor here would "
                f"not reach it. To change the values, write them into the fused parameter (or this {name}'s .data); "
                f"{TORCHAO_QUANTIZED}")
        super().__setattr__(name, value)

    def _view(self, name: str):
        src = getattr(self.fused, name)
        if src is None:
            return None
        start, stop = self.rows
        # the fused projection's register of its rows views: one made before the parameter moved is made again
        registry = self.fused.__dict__["_rows_views"]
        entry = registry.get((name, start))
        if entry is not None:
            owner, view = entry
            if owner is src and view.data_ptr() == _rows_ptr(src, start):
                if _TENSOR_REQUIRES_GRAD.__get__(view) != src.requires_grad:  # follows the fused parameter's
                    _TENSOR_REQUIRES_GRAD.__set__(view, src.requires_grad)
                    _refuse_rows_grad(view)
                return view
        view = RowsView(src.data[start:stop], requires_grad=src.requires_grad)
        view.__dict__["_fusedqkv_rows"] = (src, start, stop, registry, (name, start))
        _refuse_rows_grad(view)
        registry[(name, start)] = (src, view)
        return view

    def forward(self, x):
        # called directly (user code, T5Gemma 2's cross-attention keys): rows of the fused parameters themselves, so
        # the gradient reaches them (nn.Linear's forward would read the rows views, leaves whose .grad no optimizer
        # holds)
        start, stop = self.rows
        fused = self.fused
        return F.linear(x, fused.weight[start:stop], None if fused.bias is None else fused.bias[start:stop])

    @property
    def weight(self):
        return self._view("weight")

    @property
    def bias(self):
        return self._view("bias")

    def requires_grad_(self, requires_grad: bool = True):
        # no parameters of its own: nn.Module's would do nothing, and these rows would train (or stay frozen) on
        for name in ("weight", "bias"):
            view = self._view(name)
            if view is not None:
                view.requires_grad_(requires_grad)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows {self.rows[0]}:{self.rows[1]} of the fused projection")


# the kinds of module hook and the instance attributes that hold them
_HOOK_DICTS = (("forward hook", "_forward_hooks"), ("forward pre-hook", "_forward_pre_hooks"),
               ("backward hook", "_backward_hooks"), ("backward pre-hook", "_backward_pre_hooks"))


def _hooks(m: nn.Module) -> list:
    """The kinds of module hook ``m`` carries (the fused block never calls it: none would run), and
    ``"replaced forward"`` where ``forward`` was set on the instance.

    The hook dicts are read through the instance ``__dict__``: so ``torch.compile`` guards on them from
    torch 2.12 on (read as ``m._forward_hooks``, an empty hook dict is not guarded unless
    ``torch._dynamo.config.skip_nnmodule_hook_guards`` is off, and a hook added after compiling would be
    bypassed by the compiled graph; on torch 2.11 not either way: :func:`_announce_unguarded_hooks`). A
    ``forward`` set on the instance: :func:`_forward_set` (the fused modules refuse it as it is set,
    :func:`_refuse_forward`)."""
    d = m.__dict__
    out = []
    for kind, attr in _HOOK_DICTS:  # (plain loops: what session 30 traced on torch 2.11 and 2.13)
        if len(d[attr]):
            out.append(kind)
    if _forward_set(m, d):
        out.append("replaced forward")
    return out


def _forward_set(m: nn.Module, d: dict) -> bool:
    """``forward`` is in the instance ``__dict__`` ``d`` of module ``m``. Under ``torch.compile``, read as
    the attribute ``m.forward``: Dynamo guards on what that attribute resolves to (it does not guard
    on a key test of the instance dict, and torch 2.11 cannot list its keys), so a forward set after
    compiling makes the next call retrace and refuse it."""
    if not torch.compiler.is_compiling():
        return "forward" in d
    f = m.forward
    return not (type(f) is types.MethodType and f.__func__ is type(m).forward)


def _refuse_forward(m: nn.Module, name: str) -> None:
    if name == "forward":
        raise UnsupportedModuleError(
            f"fusedqkv: {type(m).__name__}.forward cannot be set: the fused block computes this module's rows "
            f"itself and never calls its forward, so the new forward would not run")


def _refuse_parameter(m: nn.Module, name: str) -> None:
    held = ("it holds only the fused weight and bias" if isinstance(m, FusedQKVProjection) else
            f"its weight is rows {m.rows[0]}:{m.rows[1]} of the fused projection's")
    raise UnsupportedModuleError(
        f"fusedqkv: {type(m).__name__} refuses a parameter {name!r}: {held}, which the fused block reads itself, "
        f"so a reparametrisation of the weight (torch.nn.utils.prune, weight_norm) would not reach the block")


def _refuse_hook(m: nn.Module, kind: str) -> None:
    raise UnsupportedModuleError(
        f"fusedqkv: {type(m).__name__} refuses a {kind}: the fused block computes this module's rows itself "
        f"and never calls it, so the hook would not run")


def hook_counts(m: nn.Module) -> tuple:
    """What a kept decision about ``m`` depends on of its hooks (:mod:`.projection_plan`). Read as
    :func:`_hooks` reads them, so that ``torch.compile`` guards on them where it compiles this (a frame
    run after a graph break)."""
    d = m.__dict__  # (_HOOK_DICTS spelled out: this runs for every slot of every fused forward)
    return (len(d["_forward_hooks"]), len(d["_forward_pre_hooks"]), len(d["_backward_hooks"]),
            len(d["_backward_pre_hooks"]), _forward_set(m, d))


def unwrap_lora(m) -> tuple:
    """``(lora, base)``: a PEFT ``lora.Linear`` or, over a bitsandbytes 4-bit layer, PEFT's
    ``lora.bnb.Linear4bit`` (exactly those classes; PEFT is imported wherever one exists) and the
    module under it, or ``(None, m)``."""
    for module, cls in (("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.bnb", "Linear4bit")):
        mod = sys.modules.get(module)
        if mod is not None and type(m) is getattr(mod, cls, None):
            return m, m.base_layer
    return None, m


def _peft_names_hooks(m: nn.Module) -> list:
    """``m``'s forward pre-hooks that are PEFT's mixed-batch hook (``functools.partial(
    _adapter_names_pre_forward_hook, adapter_names=...)``, registered for one call), in order; none where PEFT
    is not imported or no longer has that function (its hooks are then refused as any)."""
    hooks = m.__dict__["_forward_pre_hooks"]
    if not hooks:
        return []
    mod = sys.modules.get("peft.tuners.lora.model")
    fn = getattr(mod, "_adapter_names_pre_forward_hook", None) if mod is not None else None
    return [h for h in hooks.values() if fn is not None and type(h) is functools.partial and h.func is fn]


def peft_adapter_names(m: nn.Module):
    """The ``adapter_names`` that PEFT's mixed-batch inference (``model(..., adapter_names=[...])``,
    ``generate(adapter_names=...)``) gives the PEFT LoRA layer ``m`` now (the last hook registered wins, as in
    PEFT), or None."""
    hooks = _peft_names_hooks(m)
    return hooks[-1].keywords["adapter_names"] if hooks else None


def _describe(m) -> str:
    cls = type(m)
    return f"{cls.__module__}.{cls.__qualname__}"


def projection_slots(attn, projs: tuple, quantized: bool = False, fused_name: str = "qkv_proj") -> list:
    """What computes each fused projection: ``[(name, rows module, LoRA layer or None)]``, after
    checking that the fused projection (``fused_name``: ``qkv_proj``, or ``qkv_fused`` where HF's
    ``qkv_proj`` was already one Linear) and the rows modules are the ones ``apply_to`` put there,
    unhooked, or PEFT LoRA layers over them (raises :class:`UnsupportedModuleError` naming anything
    else). ``quantized``: an attention fused over bitsandbytes 4-bit q/k/v (:mod:`.qlora`): those
    layers are the rows modules, and there is no fused projection."""
    where = type(attn).__name__
    if quantized:
        return _quantized_slots(attn, projs, where)
    fused = attn._modules.get(fused_name)
    if type(fused) is not FusedQKVProjection:
        raise UnsupportedModuleError(
            f"fusedqkv: {where}.{fused_name} is a {_describe(fused)}; the fused block computes only the "
            f"FusedQKVProjection that apply_to put there (wrap {'/'.join(projs)} instead, with a wrapper "
            f"fusedqkv supports: PEFT LoRA)" + (_hint(fused) if fused is not None else ""))
    hooked = _hooks(fused)
    if hooked:
        raise UnsupportedModuleError(f"fusedqkv: {where}.{fused_name} has a {hooked[0]}; "
                                     f"the fused block never calls the module, so it would not run")
    out = []
    start = 0
    for name in projs:
        lora, m = unwrap_lora(attn._modules.get(name))
        stop = start + (m.out_features if isinstance(m, nn.Linear) else 0)
        if lora is None and _is_float8_linear(m) and not _hooks(m):
            _check_float8_rows(where, name, m, fused, start, stop, fused_name)
            out.append((name, m, None))
            start = stop
            continue
        start = stop
        if type(m) is not ProjectionRows or m.fused is not fused:
            what = _describe(lora if lora is not None else m)
            if lora is not None:
                what += f" over a {_describe(m)}"
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{name} is a {what}; the fused block computes {name} as rows of {fused_name}, "
                f"plain or under a PEFT LoRA layer, and cannot compute this module (it would be bypassed)" +
                _hint(lora if lora is not None else m))
        _check_unhooked(where, name, lora, m)
        out.append((name, m, lora))
    if torch.compiler.is_compiling():
        for _, m, lora in out:  # (a loop: torch.compile traces no generator)
            if lora is not None or type(m) is not ProjectionRows:
                _announce_unguarded_hooks(where)
                break
    return out


_ANNOUNCED_UNGUARDED = set()


@assume_constant_result  # run as torch.compile traces, not in the graph
def _announce_unguarded_hooks(where: str) -> bool:
    """Warn once per attention class where ``torch.compile`` would not see a hook added after compiling
    to a module fusedqkv does not own in the projection's place (PEFT's layers, torchao's, bitsandbytes';
    fusedqkv's own modules refuse hooks as they are registered): True where warned or would be."""
    if compile_guards_new_hooks():
        return False
    if where not in _ANNOUNCED_UNGUARDED:
        _ANNOUNCED_UNGUARDED.add(where)
        warnings.warn(
            f"fusedqkv: under torch.compile on torch {torch.__version__}, a hook added after compiling to a module "
            f"in {where}'s q/k/v places (a PEFT, torchao or bitsandbytes layer) is not seen by the compiled graph: "
            f"torch guards no module hook dict that was empty when it compiled "
            f"(torch._dynamo.config.skip_nnmodule_hook_guards, on by default), so the fused block would run past "
            f"the hook instead of refusing it as in eager. Set torch._dynamo.config.skip_nnmodule_hook_guards = "
            f"False before compiling, or use torch >= 2.12, to have such hooks refused", UserWarning, stacklevel=2)
    return True


# the classes of what the fused block reads that are never torchao's: the checks below return at once for
# them, without the class's module name (which torch.compile cannot read of a Parameter's class)
_PLAIN = (torch.Tensor, nn.Parameter, RowsView)


def _torchao_class(cls, package: str) -> bool:
    return cls not in _PLAIN and cls.__module__.startswith(package)


def _torchao_mx_class(cls) -> bool:
    return _torchao_class(cls, "torchao.prototype") and cls.__name__.upper().startswith("MX")


def _is_torchao_mx(m) -> bool:
    """torchao's MX training in a projection's place: an ``MXFP8Linear``, or a registered weight that
    ``MXFP8TrainingOpConfig`` wrapped (``MXFP8TrainingWeightWrapperTensor``)."""
    if _torchao_mx_class(type(m)):
        return True
    params = m.__dict__.get("_parameters") if isinstance(m, nn.Module) else None
    w = params.get("weight") if params is not None else None
    return w is not None and _torchao_mx_class(type(w))


def is_mx_wrapped(t) -> bool:
    """``t`` a parameter that torchao's MX training wrapped (``quantize_`` with an
    ``MXFP8TrainingOpConfig``: an ``MXFP8TrainingWeightWrapperTensor`` holding the plain tensor and
    the config)."""
    cls = type(t)
    return _torchao_class(cls, "torchao.prototype") and cls.__name__.startswith("MXFP8") and hasattr(t, "config")


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


def _check_float8_rows(where: str, name: str, m, fused, start: int, stop: int, fused_name: str) -> None:
    """A torchao ``Float8Linear`` in a rows module's place (``convert_to_float8_training`` after
    ``apply_to``) is computed by the fused block only over the fused rows themselves: its weight and bias
    are the rows module's :class:`RowsView` parameters, still registered as the fused rows (an identity
    test, which ``torch.compile`` traces and guards), and in eager also where their storage is."""
    for attr in ("weight", "bias"):
        src, got = getattr(fused, attr), getattr(m, attr)
        if src is None and got is None:
            continue
        entry = fused.__dict__["_rows_views"].get((attr, start))
        ok = (src is not None and got is not None and entry is not None and entry[0] is src and entry[1] is got
              and tuple(got.shape) == (stop - start, *src.shape[1:]))
        if ok and not torch.compiler.is_compiling():
            ok = got.data_ptr() == _rows_ptr(src, start)
        if not ok:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{name} is a torchao Float8Linear whose {attr} is not rows {start}:{stop} of "
                f"{fused_name}.{attr} (a {type(got).__name__}); the fused block computes only the Float8Linear that "
                f"convert_to_float8_training made of apply_to's rows")


def _is_torchao_tensor(t) -> bool:
    """``t`` one of torchao's tensor subclasses (a training wrapper, a quantized weight)."""
    return t is not None and _torchao_class(type(t), "torchao.")


def _torchao_low_precision(m) -> bool:
    """Module ``m`` computes in torchao's low precision: a ``Float8Linear``, an MX training layer or
    weight, or a weight of another torchao tensor subclass (``quantize_``)."""
    return _is_float8_linear(m) or _is_torchao_mx(m) or _is_torchao_tensor(getattr(m, "_parameters", {}).get("weight"))


def slots_fp8_recipe(attn, slots: list, given, fused_name: str = "qkv_proj"):
    """The FP8 recipe of a fused forward: ``given`` (``apply_to(fp8=...)``), or the torchao
    ``Float8Linear`` layers' in the rows' places (all of them, one recipe), or torchao's MX training
    wrapper on ``qkv_proj``'s weight; a mix raises, as does any other torchao tensor subclass on
    ``qkv_proj``. Where the block stays in 16 bits while another projection of the same attention
    computes in torchao's low precision, a warning says so."""
    recipe = _slots_fp8_recipe(attn, slots, given, fused_name)
    if recipe is None:
        low = [name for name, m in attn._modules.items()
               if name != fused_name and m is not None and _torchao_low_precision(m)]
        if low:
            warnings.warn(
                f"fusedqkv: {type(attn).__name__}.{low[0]} computes in torchao's low precision but the fused q/k/v "
                f"projection ({fused_name}) does not: it runs in {attn._modules[fused_name].weight.dtype}. torchao's "
                f"default quantize_ filter takes nn.Linear layers, and the fused {fused_name} is not one: pass a "
                f"filter_fn that also takes names ending in '{fused_name}' (MXFP8TrainingOpConfig), use "
                f"convert_to_float8_training (it converts the rows modules), or apply_to(model, fp8=...)",
                UserWarning, stacklevel=2)
    return recipe


def _slots_fp8_recipe(attn, slots: list, given, fused_name: str):
    from ..ops.fp8 import recipe_of_torchao_config

    where = type(attn).__name__
    f8 = [(name, m) for name, m, _ in slots if _is_float8_linear(m)]
    fused = attn._modules.get(fused_name)
    w = getattr(fused, "weight", None)
    for attr, t in (("weight", w), ("bias", getattr(fused, "bias", None))):
        if _is_torchao_tensor(t) and not is_mx_wrapped(t):
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{fused_name}.{attr} is torchao's {type(t).__name__}; the fused block computes with a "
                f"plain parameter or torchao's MX training wrapper (MXFP8TrainingOpConfig). For float8 training use "
                f"convert_to_float8_training (Float8Linear in q/k/v_proj's places) or apply_to(model, fp8=...)")
    if w is not None and is_mx_wrapped(w):  # torchao's MX training over qkv_proj (quantize_ after apply_to)
        from ..ops.fp8 import recipe_of_torchao_mx_config

        if f8:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{fused_name}.weight is wrapped by torchao's MX training and {f8[0][0]} is a torchao "
                f"Float8Linear; the fused projection is one GEMM, one recipe")
        try:
            got = recipe_of_torchao_mx_config(w.config, f"{where}.{fused_name}.weight")
        except ValueError as e:
            raise UnsupportedModuleError(f"fusedqkv: {e}") from None
        if given is not None and given != got:
            raise UnsupportedModuleError(f"fusedqkv: {where}: apply_to(fp8={given.key!r}) but {fused_name}.weight is "
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
        # PEFT's mixed-batch inference: its pre-hooks carry adapter_names, which the block computes with
        # (peft.MixedBatchLoRA); any other pre-hook beside them is refused
        if mod is lora and len(_peft_names_hooks(lora)) == len(lora.__dict__["_forward_pre_hooks"]):
            hooked = [k for k in hooked if k != "forward pre-hook"]
        if hooked:
            raise UnsupportedModuleError(
                f"fusedqkv: {where}.{label} has a {hooked[0]} "
                f"({_describe(mod)}); the fused block never calls the module, so it would not run"
                f"{_eva_hint(mod)}")


def _eva_hint(m: nn.Module) -> str:
    """PEFT's EVA initialisation hooks the LoRA layers to read their inputs (``initialize_lora_eva_weights``):
    say how it composes (error path only)."""
    hooks = list(m.__dict__["_forward_hooks"].values())
    if not any(type(h).__module__.startswith("peft.tuners.lora.eva") for h in hooks):
        return ""
    return ("; PEFT's EVA initialisation reads the LoRA layers' inputs through such hooks: run "
            "initialize_lora_eva_weights before apply_to (get_peft_model, EVA, then apply_to: its adapters then "
            "train in the block)")


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
    if torch.compiler.is_compiling():
        _announce_unguarded_hooks(where)
    return out


MODULES_TO_SAVE_HINT = ("; PEFT's modules_to_save (a trainable copy of the module) is not computed in the fused block: "
                        "train q/k/v through qkv_proj.weight or with LoRA (PEFT matches modules_to_save names as "
                        "suffixes: 'v_proj' also takes 'qkv_proj')")


def is_modules_to_save(m) -> bool:
    """PEFT's modules_to_save wrapper (a trainable copy of the module it wraps)."""
    return type(m).__name__ == "ModulesToSaveWrapper" and type(m).__module__.startswith("peft.")


def _hint(m) -> str:
    if is_modules_to_save(m):
        return MODULES_TO_SAVE_HINT
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
