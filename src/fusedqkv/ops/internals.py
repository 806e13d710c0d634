"""Every use of Triton's and PyTorch's internals, behind one version gate.

fusedqkv's fast paths lean on things neither library documents: the compiled kernel's launcher
(called directly by :class:`fusedqkv.ops.launch.BoundLaunch`, skipping ``JITFunction.run``),
Triton's host TMA descriptor encoder, the raw current stream, dynamo's C++ ``TensorGuards`` (the
plan caches' repeat check), dynamo's constant-result mark (set without importing dynamo) and the
grad-mode toggle. They live here and nowhere else, used only on the versions they are tested on
(:data:`TRITON_SUPPORTED`, :data:`TORCH_SUPPORTED`: CI checks the raw launch against Triton's own
launch path on every supported Triton, offline). Where one
cannot be used -- a version outside the range, a launcher of unknown structure, a kernel the raw
path does not cover -- fusedqkv takes the public path (the same results, more host time), warns
once with a :class:`FastPathWarning` naming the reason, and records it in :func:`fast_path_info`.
Under ``TRITON_INTERPRET=1`` the raw launch is off by design (reason ``"interpreter"``, no warning).

The raw launch speaks two launcher ABIs, told apart by the structure of Triton's ``CudaLauncher``
(the exact call it makes, checked in its source), not by version alone:

* ``"module"`` (Triton 3.6): a C launcher compiled per kernel, called as ``launch(gridX, gridY,
  gridZ, stream, function, cooperative, pdl, global_scratch, profile_scratch, packed_metadata,
  launch_metadata, enter_hook, exit_hook, *kernel_args)``;
* ``"shared"`` (Triton 3.7 to 3.9): the driver's one launcher, ``launch(gridX, gridY, gridZ,
  stream, function, cooperative, pdl, packed_metadata, launch_metadata, enter_hook, exit_hook,
  global_scratch, profile_scratch, arg_annotations, kernel_signature, kernel_args)``.

In both, ``kernel_args`` holds every parameter in order (constexprs too: the launcher skips them),
each host TMA descriptor expanded by Triton's ``make_tensordesc_arg`` into its encoded map, shape
and strides; the launch metadata and hooks are Triton's (``knobs.runtime.launch_enter_hook`` and
``launch_exit_hook``, read at each launch), or None while no hook is registered.
``tests/test_fast_path_gate.py`` compares the raw call with Triton's own on every supported Triton.

On Triton 3.6 a bound launch goes one step further by default: it calls the driver's
``cuLaunchKernelEx`` through ctypes with a parameter buffer laid out as Triton's generated launcher
lays out its ``params[]`` (:data:`DRIVER_LAUNCH_SUPPORTED`; ``FUSEDQKV_RAW_LAUNCH=triton`` keeps
Triton's launcher, for A/B). The probe checks it byte for byte against Triton's launcher at a
stand-in driver; elsewhere Triton's launcher serves (:func:`fast_path_info` says which).
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import struct
import sys
import warnings
from typing import Callable, Optional, Sequence

import torch

from .config import INTERPRET

TRITON_SUPPORTED = ((3, 6), (3, 9))  # first and last minor version, both included
TORCH_SUPPORTED = ((2, 11), (2, 15))

MODULE_ABI = "module"  # Triton 3.6
SHARED_ABI = "shared"  # Triton 3.7-3.9


class FastPathWarning(RuntimeWarning):
    """A fast path of fusedqkv is off in this process: it runs the public path instead (the same
    results, more host time). The message names the reason; :func:`fast_path_info` lists them."""


class Refused(Exception):
    """A raw launch this Triton or this kernel does not allow (the message says why)."""


# ------------------------------------------------------------------------------ the gate's state

_FALLBACKS: dict = {}  # reason -> None, in the order they happened (each warned once)
_BOUND = [0]  # launches bound to the raw path


def fall_back(reason: str, instead: str = "the public path instead (the same results, more host time per call)",
              supported: str = "") -> None:
    """Record that a fast path is off for ``reason``; the first time, warn (FastPathWarning)."""
    if reason in _FALLBACKS:
        return
    _FALLBACKS[reason] = None
    supported = supported or f"Triton {_range_text(TRITON_SUPPORTED)}, torch {_range_text(TORCH_SUPPORTED)}"
    warnings.warn(f"fusedqkv: a fast path is off: {reason}. fusedqkv takes {instead}. Supported: {supported}; "
                  f"see cache_info()['fast_path']", FastPathWarning, stacklevel=3)


def _range_text(rng) -> str:
    return f"{rng[0][0]}.{rng[0][1]}-{rng[1][0]}.{rng[1][1]}"


def _minor(version: str) -> Optional[tuple]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _in_range(version: str, rng) -> bool:
    v = _minor(version)
    return v is not None and rng[0] <= v <= rng[1]


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def fast_path_info() -> dict:
    """The state of fusedqkv's fast paths in this process: ``active`` (every one in use, so far),
    ``reason`` (the first reason one is off; ``"interpreter"`` under ``TRITON_INTERPRET=1``),
    ``abi`` (the launcher ABI the raw launch speaks, or None), ``launch`` (how bound launches are
    made: ``"ctypes"``, cuLaunchKernelEx with fusedqkv's parameter buffer, or ``"triton"``, Triton's
    C launcher; None while the raw path is off) and ``launch_reason`` (why not ctypes), ``triton``,
    ``torch`` (versions), ``supported`` (the tested ranges), ``bound_launches`` (launches bound to
    the raw path), ``driver_launches`` (of them, through the driver) and ``fallbacks`` (every
    reason recorded, each warned once)."""
    abi, gate_reason = _triton_gate()
    reasons = list(_FALLBACKS)
    reason = gate_reason if gate_reason == "interpreter" else (reasons[0] if reasons else gate_reason)
    launch = None if abi is None else launch_mode(abi)
    return {"active": reason is None, "reason": reason, "abi": abi, "launch": launch,
            "launch_reason": None if abi is None or launch == CTYPES else
            ("FUSEDQKV_RAW_LAUNCH=triton" if LAUNCH_MODE == TRITON else _driver_gate(abi)),
            "triton": triton_version(), "torch": torch.__version__,
            "supported": {"triton": _range_text(TRITON_SUPPORTED), "torch": _range_text(TORCH_SUPPORTED),
                          "driver_launch": _range_text(DRIVER_LAUNCH_SUPPORTED)},
            "bound_launches": _BOUND[0], "driver_launches": _DRIVER_BOUND[0], "fallbacks": reasons}


# ------------------------------------------------------------------------------ torch internals

_TORCH_PROBLEM = (None if _in_range(torch.__version__, TORCH_SUPPORTED) else
                  f"torch {torch.__version__} is outside the supported range {_range_text(TORCH_SUPPORTED)}")


# torch.compile guards a module's hook dicts read through its instance ``__dict__`` from torch 2.12 on; before,
# an empty one is not guarded while ``torch._dynamo.config.skip_nnmodule_hook_guards`` is on (its default), so a
# hook added after compiling goes unseen by the compiled graph (session 33: torch 2.11; 2.12, 2.13, 2.14 guard it)
GUARDS_HOOK_DICT_READS = (_minor(torch.__version__) or (0, 0)) >= (2, 12)


def compile_guards_new_hooks() -> bool:
    """Whether ``torch.compile`` would see a module hook added after it compiled the fused attention:
    from torch 2.12 on, or before with ``torch._dynamo.config.skip_nnmodule_hook_guards`` off."""
    if GUARDS_HOOK_DICT_READS:
        return True
    return not _torch_internal("torch._dynamo.config.skip_nnmodule_hook_guards",
                               lambda: torch._dynamo.config.skip_nnmodule_hook_guards, True)


def _torch_internal(what: str, get: Callable, public):
    """``get()`` (a torch internal), or ``public`` where this torch is not supported or lacks it
    (warned once, recorded)."""
    if _TORCH_PROBLEM is not None:
        fall_back(_TORCH_PROBLEM)
        return public
    try:
        return get()
    except Exception as e:  # noqa: BLE001 - missing or changed: named, not hidden
        fall_back(f"torch {torch.__version__}: {what} is unavailable ({type(e).__name__}: {e})")
        return public


def _public_raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


def _public_set_grad_enabled(mode: bool) -> None:
    torch.set_grad_enabled(mode)


if torch.version.cuda is None and torch.version.hip is None:  # a CPU build: no stream to ask for
    raw_stream = _public_raw_stream
else:
    raw_stream = _torch_internal("torch._C._cuda_getCurrentRawStream",
                                 lambda: torch._C._cuda_getCurrentRawStream, _public_raw_stream)

set_grad_enabled = _torch_internal("torch._C._set_grad_enabled", lambda: torch._C._set_grad_enabled,
                                   _public_set_grad_enabled)

# whether autocast is on for any device type (then the caller asks per device type: torch.is_autocast_enabled);
# where unavailable, True: every call asks per device type, as before
any_autocast_enabled = _torch_internal("torch._C._is_any_autocast_enabled", lambda: torch._C._is_any_autocast_enabled,
                                       lambda: True)


FUNC_TRANSFORMS_REFUSED = (
    "fusedqkv: torch.func transforms (grad, vmap, jacrev, jvp, ...) are not supported by the fused block: its kernels "
    "need tensors with storage and its autograd Functions define no functorch rules. Run the transform over the "
    "unfused model (without apply_to) or the reference block (fusedqkv's ReferenceGQAQKVRoPEQKNorm)")

FORWARD_AD_REFUSED = (
    "fusedqkv: forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported by the fused block: its "
    "autograd Functions define no jvp. Use the unfused model (without apply_to) or the reference block "
    "(fusedqkv's ReferenceGQAQKVRoPEQKNorm)")

_functorch_wrapped = _torch_internal("torch._C._functorch.is_functorch_wrapped_tensor",
                                     lambda: torch._C._functorch.is_functorch_wrapped_tensor, lambda t: False)


def refuse_functorch_wrapped(tensors: Sequence) -> None:
    """Raise :data:`FUNC_TRANSFORMS_REFUSED` where one of ``tensors`` is a torch.func transform's wrapper
    (no storage: the plan's fingerprint and the kernels cannot take it). Called on the plan caches' miss
    path, and by the 091 entry after a failed run (its guards can take a transform's wrappers on the GPU)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and _functorch_wrapped(t):
            raise RuntimeError(FUNC_TRANSFORMS_REFUSED)


def autograd_apply(function_class, refuse_transforms: bool = False) -> Callable:
    """``function_class.apply`` without ``torch.autograd.Function.apply``'s Python layer (a
    setup_context check and a generator over every argument: ~5-10 us a call on a slow host) where
    nothing needs it: no setup_context (ours have none), no functorch transform active; the
    arguments' dead functorch wrappers unwrapped as that layer does. Otherwise, or where this torch
    is not supported, the public ``apply``. With ``refuse_transforms``, a call under an active
    functorch transform raises :data:`FUNC_TRANSFORMS_REFUSED` (where torch's ``apply`` would refuse
    it too, a Function without setup_context, in words that do not name fusedqkv), and one with
    forward-mode AD's dual inputs :data:`FORWARD_AD_REFUSED` (torch's: no jvp)."""
    public = function_class.apply
    if "setup_context" in function_class.__dict__:
        return public
    c_apply = _torch_internal("torch._C._FunctionBase.apply",
                              lambda: torch._C._FunctionBase.__dict__["apply"].__get__(None, function_class), None)
    active = _torch_internal("torch._C._are_functorch_transforms_active",
                             lambda: torch._C._are_functorch_transforms_active, None)
    unwrap = _torch_internal("torch._C._functorch.unwrap_if_dead", lambda: torch._C._functorch.unwrap_if_dead, None)
    if c_apply is None or active is None or unwrap is None:
        return public
    Tensor = torch.Tensor

    def apply(*args):
        if active():
            if refuse_transforms:
                raise RuntimeError(FUNC_TRANSFORMS_REFUSED)
            return public(*args)
        try:
            return c_apply(*[unwrap(a) if isinstance(a, Tensor) else a for a in args])
        except NotImplementedError as e:  # torch's own words name no library: a dual input met no jvp
            if refuse_transforms and "jvp" in str(e):
                raise RuntimeError(FORWARD_AD_REFUSED) from e
            raise

    return apply


def _mark_constant_result(fn: Callable) -> Callable:
    fn._dynamo_marked_constant = True
    return fn


# ``torch.compiler.assume_constant_result`` imports torch._dynamo (~2 s of ``import fusedqkv``'s 2.3 on a 2-core
# EPYC) only to set this mark, which dynamo reads as it traces (torch._dynamo.decorators); the test suite checks
# that torch's decorator sets no other
assume_constant_result = _torch_internal("torch._dynamo's constant-result mark", lambda: _mark_constant_result,
                                         torch.compiler.assume_constant_result)


def _tensor_guards_class():
    from torch._C._dynamo.guards import TensorGuards

    probe = torch.empty(2, 3)  # the constructor and check this module calls, tried once
    g = TensorGuards(probe, dynamic_dims_sizes=[list(probe.shape)], dynamic_dims_strides=[list(probe.stride())])
    if not (g.check(probe) and not g.check(torch.empty(3, 2))):
        raise TypeError("TensorGuards.check does not tell a changed shape")
    return TensorGuards


TensorGuards = _torch_internal("dynamo's TensorGuards (torch._C._dynamo.guards)", _tensor_guards_class, None)


def tensor_guards(tensors: Sequence[torch.Tensor]):
    """dynamo's C++ guards of ``tensors`` (shapes, strides, dtypes, devices...: ``.check(*tensors)``),
    or None where they are unavailable (recorded at import) or do not take these tensors (a kind
    they do not guard: the caller's Python key serves)."""
    if TensorGuards is None:
        return None
    try:
        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001 - a tensor kind the guards do not take
        return None


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether ``t`` surely has elements sharing memory: ``torch._debug_has_internal_overlap(t) == 1``
    (MemOverlap::Yes: a non-empty tensor with a dimension of size > 1 and stride 0), without the
    private function."""
    return t.numel() > 0 and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def raise_compile_limits(at_least: int = 64) -> None:
    """torch.compile's recompile limits (``torch._dynamo.config``, named per torch version) to at
    least ``at_least``: a benchmark compiles one function for many shapes."""
    cfg = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), at_least))


# ------------------------------------------------------------------------------ Triton internals

# the launcher calls each ABI's CudaLauncher.__call__ makes, token by token
_MODULE_CALL = ("gridX", "gridY", "gridZ", "stream", "function", "self.launch_cooperative_grid", "self.launch_pdl",
                "global_scratch", "profile_scratch", "*args")
_SHARED_CALL = ("gridX", "gridY", "gridZ", "stream", "function", "self.launch_cooperative_grid", "self.launch_pdl",
                "kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook", "global_scratch",
                "profile_scratch", "self.arg_annotations", "self.kernel_signature", r"(?:kernel_)?args")
_MODULE_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
_SHARED_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                  "launch_enter_hook", "launch_exit_hook", "args")
# 3.6's per-kernel C launcher parses these leading arguments: grid, stream, function, cooperative,
# pdl, the two scratch buffers, packed metadata, launch metadata and the two hooks
_MODULE_BASE_FORMAT = "iiiKKppOOOOOO"


def _call_pattern(tokens) -> re.Pattern:
    parts = [t if t.startswith("(?:") else re.escape(t) for t in tokens]
    return re.compile(r"self\.launch\(\s*" + r"\s*,\s*".join(parts) + r"\s*,?\s*\)")


def _launcher_abi(nv) -> str:
    """The ABI of the CUDA driver module ``nv``'s ``CudaLauncher``, from its structure."""
    cls = getattr(nv, "CudaLauncher", None)
    if cls is None:
        raise Refused("triton.backends.nvidia.driver has no CudaLauncher")
    try:
        params = tuple(inspect.signature(cls.__call__).parameters)
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError, ValueError) as e:
        raise Refused(f"CudaLauncher.__call__ cannot be inspected ({e})") from e
    if params == _MODULE_PARAMS and _call_pattern(_MODULE_CALL).search(source):
        if getattr(nv, "_BASE_ARGS_FORMAT", None) != _MODULE_BASE_FORMAT:
            raise Refused("the per-kernel launcher's leading arguments changed "
                          f"({getattr(nv, '_BASE_ARGS_FORMAT', None)!r}, expected {_MODULE_BASE_FORMAT!r})")
        return MODULE_ABI
    if params == _SHARED_PARAMS and _call_pattern(_SHARED_CALL).search(source):
        return SHARED_ABI
    raise Refused("Triton's CudaLauncher calls its launcher in a way fusedqkv does not know")


_GATE: list = []  # [(abi, reason)] once decided


def _triton_gate() -> tuple:
    """(abi, None) where raw launches may be bound, else (None, reason)."""
    if not _GATE:
        _GATE.append(_decide_gate())
    return _GATE[0]


def _decide_gate() -> tuple:
    if INTERPRET:
        return None, "interpreter"
    version = triton_version()
    if version is None:
        return None, "Triton cannot be imported"
    if not _in_range(version, TRITON_SUPPORTED):
        return None, f"Triton {version} is outside the supported range {_range_text(TRITON_SUPPORTED)}"
    try:
        from triton.backends.nvidia import driver as nv

        return _launcher_abi(nv), None
    except Refused as e:
        return None, f"Triton {version}: {e}"
    except Exception as e:  # noqa: BLE001 - the CUDA backend does not even import: named, not hidden
        return None, f"Triton {version}'s CUDA backend cannot be inspected ({type(e).__name__}: {e})"


def raw_launch_gate() -> Optional[str]:
    """The launcher ABI raw launches speak here, or None (the reason recorded and warned once,
    except under the interpreter)."""
    abi, reason = _triton_gate()
    if abi is None and reason != "interpreter":
        fall_back(reason)
    return abi


# ------------------------------------------------------------------------------ Gluon

# Triton's Gluon dialect (``triton.experimental.gluon``) is experimental: its API changes between
# minor versions. The Hopper forward GEMM (kernels/qkv_rope_norm_gemm_sm90.py) is written against and
# measured on these versions only.
GLUON_SUPPORTED = ((3, 6), (3, 6))


def gluon_gate(instead: Optional[str] = None) -> Optional[str]:
    """None where the Gluon kernels may run, else the reason. With ``instead`` (what runs in their
    place), a reason other than the interpreter is recorded and warned once: callers pass it only
    where a plan would have taken them."""
    reason = _gluon_reason()
    if reason is not None and instead is not None and reason != "interpreter":
        fall_back(reason, instead=instead, supported=f"Triton {_range_text(GLUON_SUPPORTED)} for Gluon")
    return reason


def _gluon_reason() -> Optional[str]:
    if INTERPRET:
        return "interpreter"  # Gluon kernels have no interpreter
    version = triton_version()
    if version is None:
        return "Triton cannot be imported"
    if not _in_range(version, GLUON_SUPPORTED):
        return f"the Gluon forward GEMM is tested on Triton {_range_text(GLUON_SUPPORTED)}, not {version}"
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except Exception as e:  # noqa: BLE001 - named, not hidden
        return f"Triton {version}'s Gluon cannot be imported ({type(e).__name__}: {e})"
    return None


def parameter_names(fn) -> list:
    """A ``@triton.jit`` function's parameter names, in order."""
    return list(fn.arg_names)


class _Address:
    """Stands in for a tensor where Triton's descriptor encoder wants one: its address."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


DESCRIPTOR_MEMO = 256  # encoded maps a slot remembers, by address (then it starts over): a few per layer of a model


class DescriptorSlot:
    """A host TMA descriptor argument of a raw launch: position ``pos`` of the expanded argument
    list, over entry ``index`` of the call's tensor table. Holds a copy of the building call's
    ``TensorDescriptor`` (every field Triton's encoder reads) whose base is an address, so an
    encode is Triton's own ``make_tensordesc_arg`` at a new address. Everything but the address is
    the plan's, so the encoded map of an address is remembered (``memo``): a model's layers hand
    the same launch a new address per layer, the same ones every step (the caching allocator),
    and each encode costs a driver call and ~10 Python operations."""

    __slots__ = ("pos", "index", "meta", "host", "address", "encoder", "ptr", "encoded", "memo", "sink")

    def __init__(self, pos: int, index: int, descriptor, meta, encoder: Callable):
        self.pos, self.index, self.meta, self.encoder = pos, index, meta, encoder
        self.address = _Address(descriptor.base.data_ptr())
        self.host = copy.copy(descriptor)  # a dataclass: no validation, no reference to the tensor kept
        self.host.base = self.address
        self.ptr, self.encoded = None, None
        self.memo: dict = {}
        self.sink: Optional[Callable] = None  # told of each newly pointed-to map (the driver launch's params[])

    def expand(self, ptr: int) -> list:
        """The expanded argument (encoded map, shape, strides) at address ``ptr``, encoded now; the
        slot then points there."""
        self.address.ptr = ptr
        expanded = self.encoder(self.host, self.meta)
        if len(self.memo) >= DESCRIPTOR_MEMO:
            self.memo.clear()
        self.encoded = self.memo[ptr] = expanded[0]
        self.ptr = ptr
        if self.sink is not None:
            self.sink(self.encoded)
        return expanded

    def encode(self, ptr: int) -> None:
        """Point the slot at address ``ptr``: its remembered map, or one encoded now."""
        encoded = self.memo.get(ptr)
        if encoded is None:
            self.expand(ptr)
        else:
            self.encoded, self.ptr = encoded, ptr
            if self.sink is not None:
                self.sink(encoded)


# the generated enqueues' test for Triton's launch hooks (``rt``: its runtime knobs, ``Chain``: its hook
# chain class), read at each call as Triton's launch path reads them: true while none is registered
_NO_HOOKS = ("    en = rt.launch_enter_hook\n"
             "    ex = rt.launch_exit_hook\n"
             "    if (en is None or en.__class__ is Chain and not en.calls) and "
             "(ex is None or ex.__class__ is Chain and not ex.calls):\n")


def make_enqueue(launcher, grid, head, template, ptr_slots, desc_slots, pack: Optional[type] = None, hooks=None):
    """``enqueue(ptrs, stream)``: ``launcher(*grid, stream, *head, *args)`` -- or with ``pack``
    (list or tuple) ``launcher(*grid, stream, *head, pack(args))`` -- where ``args`` is
    ``template`` with the ``(position, table index)`` pointer slots filled from ``ptrs`` and the
    descriptor slots' encoded maps (:meth:`DescriptorSlot.encode` has run). One generated
    function: no per-call copy or loop over ~90 arguments.

    ``hooks``: ``(position, runtime knobs, hook chain class, launch_metadata)``: entries
    ``position`` to ``position + 2`` of ``head`` are the launch metadata and Triton's launch
    enter and exit hooks, read from the knobs at each call as Triton's launch path does;
    while both chains are empty (or None) the launcher gets None for all three, as it calls no
    hook then and reads the metadata only in one (the check costs ~0.1 us, the metadata ~1 us)."""
    ns = {"launcher": launcher}
    items = []
    by_pos = dict(ptr_slots)
    descs = {d.pos: d for d in desc_slots}
    for pos, value in enumerate(template):
        if pos in by_pos:
            items.append(f"p[{by_pos[pos]}]")
        elif pos in descs:
            name = f"d{pos}"
            ns[name] = descs[pos]
            items.append(f"{name}.encoded")
        else:
            name = f"c{pos}"
            ns[name] = value
            items.append(name)
    for k, value in enumerate(grid):
        ns[f"g{k}"] = value
    ns["grid"] = tuple(grid)
    for k, value in enumerate(head):
        ns[f"h{k}"] = value
    args = ", ".join(items)
    if pack is list:
        args = f"[{args}]"
    elif pack is tuple:
        args = f"({args},)" if items else "()"
    elif pack is not None:
        raise TypeError(f"pack: list, tuple or None, got {pack!r}")

    def call(head_names):
        return "launcher(" + ", ".join(["g0", "g1", "g2", "stream", *head_names] + ([args] if args else [])) + ")"

    names = [f"h{k}" for k in range(len(head))]
    if hooks is None:
        body = f"    {call(names)}\n"
    else:
        at, ns["rt"], ns["Chain"], ns["metadata"] = hooks
        quiet, loud = list(names), list(names)
        quiet[at: at + 3] = ["None", "None", "None"]
        loud[at: at + 3] = ["metadata(grid, stream)", "en", "ex"]
        body = (_NO_HOOKS + f"        {call(quiet)}\n"
                "    else:\n"
                f"        {call(loud)}\n")
    src = "def enqueue(p, stream):\n" + body
    exec(compile(src, "<fusedqkv raw launch>", "exec"), ns)  # noqa: S102 - our own template
    return ns["enqueue"]


def _descriptor_wrapper(run, n_desc: int):
    """(launcher, per-descriptor metadata, encoder(desc, meta) -> expanded) from the wrapper
    Triton puts around the launcher of a kernel with host descriptors."""
    closure = inspect.getclosurevars(run.launch)
    nonlocals = closure.nonlocals
    if "launcher" not in nonlocals or "tensordesc_meta" not in nonlocals:
        raise Refused("Triton's descriptor wrapper has an unknown structure")
    launcher, metas = nonlocals["launcher"], nonlocals["tensordesc_meta"]
    make = nonlocals.get("make_tensordesc_arg") or closure.globals.get("make_tensordesc_arg")
    if make is None:
        raise Refused("Triton's descriptor wrapper has no make_tensordesc_arg")
    n_params = len(inspect.signature(make).parameters)
    if n_params == 2:  # 3.6, 3.7: (arg, metadata)
        encoder = make
    elif n_params == 3:  # 3.8, 3.9: (arg, metadata, the launcher's leading arguments), the last unused on CUDA

        def encoder(desc, meta, _make=make):
            return _make(desc, meta, None)
    else:
        raise Refused(f"make_tensordesc_arg takes {n_params} arguments, expected 2 or 3")
    if not metas or len(metas) != n_desc or any(m is None for m in metas):
        raise Refused("a descriptor argument is not lowered to a TMA descriptor")
    return launcher, list(metas), encoder


def bind(compiled, grid, values: Sequence, ptr_slots: Sequence, desc_slots: Sequence):
    """The raw launch of ``compiled`` (a kernel the JIT has just launched):
    ``(enqueue, descriptor slots)`` (:func:`make_enqueue`), or None where this Triton or this
    kernel does not allow it (the reason recorded and warned once).

    ``values``: every kernel parameter's value in order (constexprs too); ``ptr_slots``:
    ``(parameter position, table index)`` of the tensor arguments; ``desc_slots``: ``(parameter
    position, table index, the building call's TensorDescriptor)`` of the host descriptors."""
    abi = raw_launch_gate()
    if abi is None:
        return None
    name = getattr(compiled, "name", None) or "a kernel"
    try:
        bound = _bind(abi, compiled, tuple(grid), values, ptr_slots, desc_slots)
    except Refused as e:
        fall_back(f"{name}: {e}")
        return None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, AssertionError) as e:
        fall_back(f"{name}: Triton {triton_version()}'s launcher does not have the structure fusedqkv binds to "
                   f"({type(e).__name__}: {e})")
        return None
    _BOUND[0] += 1
    return bound


def _bind(abi, compiled, grid, values, ptr_slots, desc_slots):
    from triton.backends.nvidia import driver as nv

    if compiled is None:
        raise Refused("the JIT returned no compiled kernel")
    run = compiled.run
    if type(run) is not nv.CudaLauncher:
        raise Refused(f"its launcher is a {type(run).__name__}, not Triton's CudaLauncher")
    if run.global_scratch_size or run.profile_scratch_size:
        raise Refused("it needs scratch memory")
    if getattr(run, "gsan_enabled", False):
        raise Refused("GSan instrumentation adds launch arguments")
    if compiled.function is None:
        raise Refused("it has no loaded function")
    if desc_slots:
        launcher, metas, encoder = _descriptor_wrapper(run, len(desc_slots))
    else:
        launcher, metas, encoder = run.launch, [], None
        if inspect.isfunction(launcher) and getattr(launcher, "__module__", "").startswith("triton"):
            raise Refused("Triton wraps its launcher in an unknown way")
    ptr_at = dict(ptr_slots)
    desc_at = {pos: (index, d) for pos, index, d in desc_slots}
    template, raw_ptrs, descs = [], [], []
    for pos, value in enumerate(values):
        if pos in ptr_at:
            raw_ptrs.append((len(template), ptr_at[pos]))
            template.append(None)
        elif pos in desc_at:
            index, d = desc_at[pos]
            slot = DescriptorSlot(len(template), index, d, metas[len(descs)], encoder)
            expanded = slot.expand(d.base.data_ptr())  # also the first encoding, at the building call's address
            shape, strides = list(d.shape), list(d.strides)
            if len(expanded) != 1 + len(shape) + len(strides) or list(expanded[1:]) != shape + strides:
                raise Refused("make_tensordesc_arg expands a descriptor in an unknown way")
            descs.append(slot)
            template.append(None)
            template.extend(expanded[1:])
        else:
            template.append(value)
    src = getattr(compiled, "src", None)
    if getattr(getattr(src, "fn", None), "launch_metadata", None) is not None:
        raise Refused("it has a launch_metadata function (its hooks would want the call's arguments)")
    from triton import knobs
    from triton.knobs import HookChain

    hooks_of = (knobs.runtime, HookChain, compiled.launch_metadata)
    if abi == MODULE_ABI:
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                None, None, None)
        hooks = (6, *hooks_of)
        enqueue = make_enqueue(launcher, grid, head, template, raw_ptrs, descs, None, hooks)
        if launch_mode(abi) == CTYPES:
            driver = _driver_bind(compiled, run, grid, template, raw_ptrs, descs, enqueue, hooks_of)
            if driver is not None:
                return driver, descs
        return enqueue, descs
    else:
        if len(compiled.packed_metadata) != 3:  # parsed as (num_warps, num_ctas, shared memory)
            raise Refused("the packed kernel metadata changed")
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata, None, None,
                None, None, None, run.arg_annotations, run.kernel_signature)
        pack = list if descs else tuple  # as Triton's descriptor wrapper / CudaLauncher pass them
        hooks = (4, *hooks_of)
    return make_enqueue(launcher, grid, head, template, raw_ptrs, descs, pack, hooks), descs


# ------------------------------------------------------------------------------ the driver launch (Triton 3.6)

# The bound launch's second step: where Triton 3.6's per-kernel C launcher would parse ~90 Python
# objects per call, fusedqkv calls cuLaunchKernelEx through ctypes with a parameter buffer of its
# own, laid out as that launcher lays out ``void *params[]`` (checked byte for byte against it,
# offline, by tests/_fast_path_probe.py). FUSEDQKV_RAW_LAUNCH picks the mode: "ctypes" (the
# default where the layout is proven) or "triton" (Triton's C launcher, kept for A/B).

CTYPES, TRITON = "ctypes", "triton"
DRIVER_LAUNCH_SUPPORTED = ((3, 6), (3, 6))  # Tritons whose launcher's params[] layout the probe checks


def _launch_mode_from_env() -> Optional[str]:
    raw = os.environ.get("FUSEDQKV_RAW_LAUNCH", "")
    if raw == "":
        return None  # ctypes where proven, Triton's launcher elsewhere
    if raw not in (CTYPES, TRITON):
        raise ValueError(f"FUSEDQKV_RAW_LAUNCH={raw!r}: expected 'ctypes' (bound launches call the CUDA driver "
                         "directly where the gate allows) or 'triton' (through Triton's C launcher)")
    return raw


LAUNCH_MODE = _launch_mode_from_env()
_DRIVER_GATE: dict = {}  # abi -> None (allowed) or the reason
_DRIVER_BOUND = [0]  # launches bound to the driver launch

# Each signature type: the C type Triton 3.6's launcher declares for it (ty_to_cpp, or
# FLOAT_STORAGE_TYPE for floats: checked against Triton's tables at bind) and how its bytes are made.
_SCALARS = {"i1": ("int8_t", "b"), "i8": ("int8_t", "b"), "i16": ("int16_t", "h"), "i32": ("int32_t", "i"),
            "i64": ("int64_t", "q"), "u1": ("uint8_t", "B"), "u8": ("uint8_t", "B"), "u16": ("uint16_t", "H"),
            "u32": ("uint32_t", "I"), "u64": ("uint64_t", "Q"), "fp16": ("uint16_t", "e"),
            "bf16": ("uint16_t", "bf16"), "fp32": ("uint32_t", "f"), "f32": ("uint32_t", "f"),
            "fp64": ("uint64_t", "d")}
# The generated launcher's source, token by token: what the layout below mirrors
_LAUNCHER_TOKENS = (
    'params.append("&global_scratch")', 'params.append("&profile_scratch")',
    'params = [f"&arg{i}" for i, ty in signature.items() if ty != "constexpr"]',
    'if (gridX*gridY*gridZ > 0)', 'config.gridDimX = gridX * num_ctas;', 'config.gridDimY = gridY;',
    'config.gridDimZ = gridZ;', 'config.blockDimX = 32 * num_warps;', 'config.blockDimY = 1;',
    'config.blockDimZ = 1;', 'config.sharedMemBytes = shared_memory;', 'config.hStream = stream;',
    '.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, .value = 1',
    '.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE, .value = 1', 'clusterAttr.value.clusterDim.x = num_ctas;',
    'clusterSchedulingAttr.value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;',
    'cuLaunchKernelExHandle(&config, function, params, 0)', 'internal_args_list.append(f"*tma_ptr{i}")',
    'internal_args_list.append(f"_arg{i}_storage")', 'output.append("nvTmaDesc")')
# CUDA's enums and structs (cuda.h): CUlaunchConfig is 7 uint32 (grid, block, shared memory), the
# stream at 32, attrs at 40, numAttrs at 48 (56 bytes); CUlaunchAttribute is the id, 4 bytes of
# padding, a 64-byte value union (72 bytes)
_ATTR_COOPERATIVE, _ATTR_CLUSTER_DIM, _ATTR_CLUSTER_POLICY, _ATTR_PDL = 2, 4, 5, 6
_CLUSTER_POLICY_SPREAD = 1
_CONFIG_BYTES, _ATTR_BYTES, _MAX_ATTRS = 56, 72, 4
_CUDA_ERROR_INVALID_CONTEXT = 201
# Triton 3.6's PyCUtensorMap (driver.c): PyObject_HEAD, then the 128-byte CUtensorMap aligned to
# 128: the map is the object's last 128 bytes, at its address (CPython's id) + 128
_MAP_BYTES = _MAP_OFFSET = 128


def _driver_gate(abi) -> Optional[str]:
    """None where the driver launch's layout is proven for this Triton, else the reason."""
    if abi not in _DRIVER_GATE:
        _DRIVER_GATE[abi] = _decide_driver_gate(abi)
    return _DRIVER_GATE[abi]


def _decide_driver_gate(abi) -> Optional[str]:
    version = triton_version()
    if abi != MODULE_ABI or not _in_range(version or "", DRIVER_LAUNCH_SUPPORTED):
        return (f"the driver launch's parameter layout is proven on Triton {_range_text(DRIVER_LAUNCH_SUPPORTED)}, "
                f"not {version}")
    if sys.implementation.name != "cpython":
        return (f"the driver launch reads host TMA maps at their object's address (CPython), "
                f"not {sys.implementation.name}")
    try:
        from triton.backends.nvidia import driver as nv

        source = inspect.getsource(nv.make_launcher)
    except Exception as e:  # noqa: BLE001 - named, not hidden
        return f"Triton {version}'s launcher source cannot be read ({type(e).__name__}: {e})"
    missing = [t for t in _LAUNCHER_TOKENS if t not in source]
    if missing:
        return f"Triton {version}'s generated launcher changed (no {missing[0]!r})"
    return None


def launch_mode(abi) -> str:
    """How bound launches are made under ``abi``: ``"ctypes"`` (cuLaunchKernelEx with fusedqkv's
    parameter buffer) or ``"triton"`` (Triton's C launcher). ``FUSEDQKV_RAW_LAUNCH=ctypes`` where
    the layout is not proven falls back, warned once."""
    if LAUNCH_MODE == TRITON:
        return TRITON
    reason = _driver_gate(abi)
    if reason is None:
        return CTYPES
    if LAUNCH_MODE == CTYPES:
        fall_back(reason, instead="Triton's C launcher (FUSEDQKV_RAW_LAUNCH=ctypes asked for the driver launch; "
                  "more host time per call)", supported=f"Triton {_range_text(DRIVER_LAUNCH_SUPPORTED)} for it")
    return TRITON


class _Cuda:
    """libcuda's entry points the driver launch calls, through ctypes (argument types set once)."""

    def __init__(self):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")  # releases the GIL per call, as Triton's launcher does
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        self.launch = lib.cuLaunchKernelEx  # the plain symbol, as Triton's launcher dlsyms it
        self.launch.argtypes, self.launch.restype = [vp, vp, vp, vp], i32
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes, self.error_name.restype = [i32, ctypes.POINTER(ctypes.c_char_p)], i32
        self.ctx_get = lib.cuCtxGetCurrent
        self.ctx_get.argtypes, self.ctx_get.restype = [ctypes.POINTER(vp)], i32
        self.ctx_set = lib.cuCtxSetCurrent
        self.ctx_set.argtypes, self.ctx_set.restype = [vp], i32
        self.device_get = lib.cuDeviceGet
        self.device_get.argtypes, self.device_get.restype = [ctypes.POINTER(i32), i32], i32
        self.primary_retain = lib.cuDevicePrimaryCtxRetain
        self.primary_retain.argtypes, self.primary_retain.restype = [ctypes.POINTER(vp), i32], i32

    def name(self, err: int) -> str:
        import ctypes

        out = ctypes.c_char_p()
        if self.error_name(err, ctypes.byref(out)) != 0 or out.value is None:
            return f"CUresult {err}"
        return out.value.decode()

    def ensure_context(self) -> bool:
        """Make the current device's primary context current where no context is (what Triton's
        launcher does before every launch): whether one was made current."""
        import ctypes

        ctx = ctypes.c_void_p()
        if self.ctx_get(ctypes.byref(ctx)) != 0 or ctx.value:
            return False
        dev = ctypes.c_int()
        if self.device_get(ctypes.byref(dev), torch.cuda.current_device()) != 0:
            return False
        if self.primary_retain(ctypes.byref(ctx), dev.value) != 0:
            return False
        return self.ctx_set(ctx) == 0


_CUDA: list = []


def _cuda() -> _Cuda:
    if not _CUDA:
        _CUDA.append(_Cuda())
    return _CUDA[0]


def _scalar_bytes(ty: str, value) -> bytes:
    code = _SCALARS[ty][1]
    if code == "bf16":  # Triton's pack_bf16: the fp32's high half, truncated
        return struct.pack("<f", value)[2:]
    return struct.pack("<" + code, value)


def _expanded_types(signature) -> list:
    """Triton 3.6's launcher signature: each host descriptor as its map, shape (i32) and strides (i64)."""
    out = []
    for sig in signature:
        if isinstance(sig, tuple):
            raise Refused("a tuple argument")
        if sig.startswith("tensordesc"):
            m = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", sig)
            if m is None:
                raise Refused(f"a descriptor type {sig!r} of unknown form")
            ndim = m.group(2).count(",") + 1
            out += ["nvTmaDesc"] + ["i32"] * ndim + ["i64"] * ndim
        else:
            out.append(sig)
    return out


def _driver_bind(compiled, run, grid, template, raw_ptrs, descs, triton_enqueue, hooks_of):
    """``enqueue(ptrs, stream)`` launching ``compiled`` through cuLaunchKernelEx, or None where this
    kernel does not allow it (warned once; Triton's launcher then serves)."""
    name = getattr(compiled, "name", None) or "a kernel"
    try:
        enqueue = _driver_enqueue(compiled, run, grid, template, raw_ptrs, descs, triton_enqueue, hooks_of)
    except Refused as e:
        fall_back(f"{name}: the driver launch: {e}", instead="Triton's C launcher for it (more host time per call)")
        return None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        fall_back(f"{name}: the driver launch: Triton {triton_version()}'s compiled kernel does not have the "
                  f"structure fusedqkv lays out ({type(e).__name__}: {e})",
                  instead="Triton's C launcher for it (more host time per call)")
        return None
    _DRIVER_BOUND[0] += 1
    return enqueue


def _driver_enqueue(compiled, run, grid, template, raw_ptrs, descs, triton_enqueue, hooks_of):
    import ctypes

    from triton.backends.nvidia import driver as nv

    try:
        cuda = _cuda()
    except (OSError, AttributeError) as e:
        raise Refused(f"libcuda.so.1 cannot be used through ctypes ({e})") from e
    types = _expanded_types(compiled.src.signature.values())
    if len(types) != len(template):
        raise Refused(f"{len(types)} launcher arguments in the signature, {len(template)} in the template")
    num_warps, num_ctas, shared = compiled.packed_metadata  # as the launcher parses it ("iii")
    if num_ctas == 16:
        raise Refused("16-CTA clusters (Triton sets a function attribute per launch)")
    ptr_at = {pos: j for j, (pos, _) in enumerate(raw_ptrs)}
    desc_at = {d.pos: d for d in descs}
    # params[]: (kind, payload) per non-constexpr argument, then the two scratch pointers (NULL)
    params, scalars = [], []
    for pos, (ty, value) in enumerate(zip(types, template)):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if pos not in ptr_at:
                raise Refused(f"pointer argument {pos} is not a tensor slot")
            params.append(("ptr", ptr_at[pos]))
        elif ty == "nvTmaDesc":
            if pos not in desc_at:
                raise Refused(f"descriptor argument {pos} is not a descriptor slot")
            params.append(("desc", desc_at[pos]))
        elif ty in _SCALARS:
            c_type = nv.FLOAT_STORAGE_TYPE.get(ty) or nv.ty_to_cpp(ty)
            if c_type != _SCALARS[ty][0]:
                raise Refused(f"Triton declares {ty} as {c_type}, fusedqkv's layout as {_SCALARS[ty][0]}")
            try:
                packed = _scalar_bytes(ty, value)
            except (struct.error, TypeError, OverflowError) as e:
                raise Refused(f"argument {pos} ({ty}) = {value!r} does not pack ({e})") from e
            params.append(("scalar", len(scalars)))
            scalars.append(packed)
        else:
            raise Refused(f"argument {pos} has type {ty!r}, which the driver launch does not lay out")
    params += [("zero", None), ("zero", None)]  # global and profile scratch: refused above, so NULL
    # one storage block: config (stream, attrs, numAttrs then the pointer slots: one pack_into per
    # call), scalars, 8 zero bytes, attributes, params[]
    k = len(raw_ptrs)
    off_ptrs = _CONFIG_BYTES
    off_scalars = off_ptrs + 8 * k
    off_zero = off_scalars + 8 * len(scalars)
    off_attrs = off_zero + 8
    off_params = off_attrs + _ATTR_BYTES * _MAX_ATTRS
    size = off_params + 8 * len(params)
    buf = (ctypes.c_uint64 * (size // 8))()
    base = ctypes.addressof(buf)
    gx, gy, gz = grid
    struct.pack_into("<7I", buf, 0, gx * num_ctas, gy, gz, 32 * num_warps, 1, 1, shared)
    attrs = []  # in the order Triton's launcher adds them
    if run.launch_pdl:
        attrs.append((_ATTR_PDL, struct.pack("<i", 1)))
    if run.launch_cooperative_grid:
        attrs.append((_ATTR_COOPERATIVE, struct.pack("<i", 1)))
    if num_ctas != 1:
        attrs.append((_ATTR_CLUSTER_DIM, struct.pack("<3I", num_ctas, 1, 1)))
        attrs.append((_ATTR_CLUSTER_POLICY, struct.pack("<i", _CLUSTER_POLICY_SPREAD)))
    for i, (attr_id, value) in enumerate(attrs):
        struct.pack_into("<I", buf, off_attrs + _ATTR_BYTES * i, attr_id)
        struct.pack_into(f"<{len(value)}s", buf, off_attrs + _ATTR_BYTES * i + 8, value)
    for i, packed in enumerate(scalars):
        struct.pack_into(f"<{len(packed)}s", buf, off_scalars + 8 * i, packed)
    sinks = []
    map_type = getattr(nv, "PyCUtensorMap", None)
    for i, (kind, what) in enumerate(params):
        at = off_params + 8 * i
        if kind == "ptr":
            struct.pack_into("<Q", buf, at, base + off_ptrs + 8 * what)
        elif kind == "scalar":
            struct.pack_into("<Q", buf, at, base + off_scalars + 8 * what)
        elif kind == "zero":
            struct.pack_into("<Q", buf, at, base + off_zero)
        else:  # a descriptor: its map's address, repointed whenever the slot encodes
            if map_type is None or getattr(map_type, "__basicsize__", None) != 2 * _MAP_BYTES:
                raise Refused("Triton's PyCUtensorMap is not the 256-byte object whose last 128 bytes are the map")
            if type(what.encoded) is not map_type:
                raise Refused(f"a host descriptor is encoded as {type(what.encoded).__name__}, not PyCUtensorMap")
            sinks.append((what, _map_pointer(buf, at, map_type)))
    # the per-call writes: the stream, the attributes (constant) and every pointer slot
    ns = {"pack": struct.Struct("<QQII" + "Q" * k).pack_into, "buf": buf, "launch": cuda.launch,
          "cfg": ctypes.c_void_p(base), "fn": ctypes.c_void_p(compiled.function),
          "prm": ctypes.c_void_p(base + off_params), "attrs": base + off_attrs, "n_attrs": len(attrs),
          "slow": triton_enqueue, "failed": _launch_failed(cuda, compiled.name)}
    ns["rt"], ns["Chain"] = hooks_of[0], hooks_of[1]
    slots = "".join(f", p[{index}]" for _, index in raw_ptrs)
    if gx * gy * gz > 0:
        quiet = ("        pack(buf, 32, stream, attrs, n_attrs, 0" + slots + ")\n"
                 "        err = launch(cfg, fn, prm, None)\n"
                 "        if err:\n"
                 "            failed(err, cfg, fn, prm)\n")
    else:  # Triton's launcher launches nothing for an empty grid
        quiet = "        pass\n"
    src = ("def enqueue(p, stream):\n" + _NO_HOOKS + quiet +
           "    else:  # a hook is registered: Triton's launcher calls it, with its metadata\n"
           "        slow(p, stream)\n")
    exec(compile(src, "<fusedqkv driver launch>", "exec"), ns)  # noqa: S102 - our own template
    ns["enqueue"].storage = buf  # the parameter buffer lives as long as the launch
    ns["enqueue"].triton = triton_enqueue  # the same launch through Triton's launcher (benchmarks' A/B)
    for slot, point in sinks:
        point(slot.encoded)
        slot.sink = point
    return ns["enqueue"]


def _map_pointer(buf, at: int, map_type):
    """``point(encoded)``: params[] entry ``at`` of ``buf`` to the CUtensorMap inside Triton 3.6's
    ``PyCUtensorMap`` ``encoded`` (kept alive by the descriptor slot while it is current)."""
    pack, offset = struct.Struct("<Q").pack_into, _MAP_OFFSET

    def point(encoded):
        if type(encoded) is not map_type:
            raise RuntimeError(f"fusedqkv: a host descriptor encoded as {type(encoded).__name__}, not PyCUtensorMap")
        address = id(encoded) + offset
        if address % _MAP_BYTES:
            raise RuntimeError("fusedqkv: a PyCUtensorMap's map is not 128-byte aligned")
        pack(buf, at, address)

    return point


def _launch_failed(cuda: _Cuda, name: str):
    def failed(err, cfg, fn, prm):
        # no current context in this thread: make one current as Triton's launcher would, once
        if err == _CUDA_ERROR_INVALID_CONTEXT and cuda.ensure_context():
            err = cuda.launch(cfg, fn, prm, None)
            if not err:
                return
        raise RuntimeError(f"fusedqkv: cuLaunchKernelEx of {name} failed: {cuda.name(err)} ({err})")

    return failed


# ------------------------------------------------------------------------------ torch.distributed (TP)


def functional_collectives():
    """torch's traceable collectives (``torch.ops._c10d_functional``: ``all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``wait_tensor``), which torch.compile
    traces; the head-parallel block's backward uses them."""
    return torch.ops._c10d_functional


def dtensor_spec(t):
    """A DTensor's spec (mesh, placements, global shape): the private ``_spec``."""
    return t._spec


def dtensor_from_spec(local: torch.Tensor, spec):
    """A DTensor of ``local`` with a copy of ``spec`` and no autograd history: what DTensor's
    ``to_local`` backward builds, without its per-call global-shape computation."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, copy.copy(spec), requires_grad=False)
