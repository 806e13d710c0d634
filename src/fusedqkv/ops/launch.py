"""Bound launches: a Triton kernel with every argument fixed but its tensors' addresses.

``JITFunction.run`` binds and specialises every argument on every call (~80 here: every
stride is passed) and Triton's launcher asks the driver about each pointer and encodes
each host TMA descriptor again: tens of us of host time per launch, which the 091 timer
pays as idle GPU time between our launches and a training loop pays whenever the GPU is
not busier than the host. A plan (:mod:`fusedqkv.ops.backward_091` and the training plans) builds each launch once per
input signature as a :class:`BoundLaunch`: the argument list is a template whose tensor
arguments are *slots* (:class:`Ptr`, :class:`Desc`) into the call's table of tensors. Its
first call goes through the JIT (compiling, or finding the cached binary); later calls fill
the slots with the addresses of the call's tensors and call the compiled kernel's launcher
directly -- or, on Triton 3.6, the CUDA driver's ``cuLaunchKernelEx`` through ctypes with a
parameter buffer kept per launch (``FUSEDQKV_RAW_LAUNCH``, :mod:`fusedqkv.ops.internals`): a
call writes only the stream and the addresses. Descriptors are encoded again only when their
tensor's address changes.

Under ``TRITON_INTERPRET=1`` every call goes through the JIT with the call's tensors (the
same slots and templates, so the CPU tests exercise them).
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch

from . import internals
from .config import INTERPRET


class Ptr:
    """A tensor argument: the entry ``name`` (position ``index``) of the call's tensor table.
    ``like`` is the tensor of the call that built the plan (its strides, dtype and shape are the
    plan's)."""

    __slots__ = ("name", "index", "like")

    def __init__(self, name: str, index: int, like: torch.Tensor):
        self.name, self.index, self.like = name, index, like


class Desc:
    """A host TMA descriptor of entry ``index`` of the call's tensor table (a :class:`Ptr`'s),
    over its whole shape, in boxes of ``block``; ``layout``: a Gluon kernel's shared layout (the
    descriptor is then Gluon's), None for a Triton kernel's."""

    __slots__ = ("index", "shape", "strides", "block", "layout")

    def __init__(self, ptr: Ptr, block: Sequence[int], layout=None):
        self.index, self.block, self.layout = ptr.index, list(block), layout
        self.shape, self.strides = list(ptr.like.shape), list(ptr.like.stride())


def carve(base: torch.Tensor, byte_offset: int, shape: Sequence[int], dtype=torch.float32) -> torch.Tensor:
    """``shape`` elements of ``dtype`` at ``byte_offset`` bytes into contiguous ``base``: a view."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return base.view(-1).view(torch.uint8)[byte_offset: byte_offset + n].view(dtype).view(tuple(shape))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class Table:
    """The tensor table of a planned call, by name: entries the call supplies (``add``), then
    entries derived from them (``derive``: fp32 views at a fixed byte offset into a contiguous
    entry, e.g. partials carved from an output's memory). Launch arguments refer to entries by
    :class:`Ptr`/:class:`Desc` slots; a call hands its tensors (``tensors``) or their addresses
    (``addresses``) as a mapping from entry names, so no caller depends on positions."""

    def __init__(self):
        self.slots: dict = {}  # name -> Ptr, supplied entries in order, then derived ones
        self.supplied: list = []  # names of the supplied entries, in table order
        self.derived: list = []  # (base name, byte offset, shape)
        self._get = None

    def add(self, name: str, t: torch.Tensor) -> Ptr:
        if self.derived:
            raise RuntimeError("Table: supplied entries come before derived ones")
        if name in self.slots:
            raise KeyError(f"Table: entry {name!r} added twice")
        self.slots[name] = Ptr(name, len(self.supplied), t)
        self.supplied.append(name)
        self._get = None
        return self.slots[name]

    def derive(self, name: str, base: Ptr, byte_offset: int, shape) -> Ptr:
        index = len(self.supplied) + len(self.derived)
        self.slots[name] = Ptr(name, index, carve(base.like, byte_offset, shape))
        self.derived.append((base.name, byte_offset, tuple(shape)))
        return self.slots[name]

    def release(self) -> None:
        """Forget the building call's tensors (a plan must not keep a call's memory alive)."""
        for p in self.slots.values():
            p.like = None

    def _getter(self):
        if self._get is None:  # one C-level lookup of every supplied name
            names = self.supplied
            self._get = operator.itemgetter(*names) if len(names) > 1 else (lambda m, n=names[0]: (m[n],))
        return self._get

    def tensors(self, named: dict) -> list:
        """The full table of a call from its tensors by name (derived entries as views): the JIT path."""
        out = list(self._getter()(named))
        for base, off, shape in self.derived:
            out.append(carve(named[base], off, shape))
        return out

    def addresses(self, named: dict) -> list:
        """The full table's addresses from the supplied entries' addresses by name."""
        out = list(self._getter()(named))
        for base, off, _ in self.derived:
            out.append(named[base] + off)
        return out

    def gather(self, order: Sequence[str]):
        """``gather(addresses)``: the full table's addresses from a list of addresses in ``order``
        (names; every supplied entry among them, others ignored), as one generated function --
        the run paths' per-call form of :meth:`addresses`, with no dict built per call."""
        pos = {name: i for i, name in enumerate(order)}
        missing = [name for name in self.supplied if name not in pos]
        if missing:
            raise KeyError(f"Table.gather: entries {missing} are not in the call's order")
        items = [f"a[{pos[name]}]" for name in self.supplied]
        items += [f"a[{pos[base]}] + {off}" for base, off, _ in self.derived]
        ns: dict = {}
        exec(compile(f"def gather(a):\n    return [{', '.join(items)}]\n", "<fusedqkv gather>", "exec"), ns)  # noqa: S102
        return ns["gather"]


def _tensor_descriptor(t: torch.Tensor, block, layout=None):
    if layout is not None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

        return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


class BoundLaunch:
    """``BoundLaunch(kernel, grid, args, constexprs)``: ``args`` are the kernel's runtime
    arguments in parameter order, tensors given as :class:`Ptr`/:class:`Desc` slots;
    ``constexprs`` every constexpr parameter and the compile options (``num_warps``...).

    ``launch(tensors, ptrs, stream)`` queues the kernel for a call whose tensor table is
    ``tensors`` (``ptrs`` their addresses, the same length, or None before the first launch
    and under the interpreter). After the first launch :attr:`bound` tells whether later ones
    take the raw path (:mod:`fusedqkv.ops.internals` binds it, or says why not)."""

    def __init__(self, fn, grid: Sequence[int], args: Sequence, constexprs: dict):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.constexprs = dict(constexprs)
        self._raw = None  # the generated enqueue, once compiled and bound
        self._descs: list = []  # its descriptor slots (internals.DescriptorSlot)
        self.raw_disabled = INTERPRET  # or once binding was refused (internals.fast_path_info says why)

    @property
    def bound(self) -> bool:
        """Whether launches given ``ptrs`` call the compiled kernel's launcher (or the driver) directly."""
        return self._raw is not None

    @property
    def via_driver(self) -> bool:
        """Whether those launches call cuLaunchKernelEx with the launch's own parameter buffer."""
        return getattr(self._raw, "triton", None) is not None

    def _resolve(self, a, tensors):
        if isinstance(a, Ptr):
            return tensors[a.index]
        if isinstance(a, Desc):
            return _tensor_descriptor(tensors[a.index], a.block, a.layout)
        return a

    def encode(self, ptrs: Sequence[int]) -> None:
        """Encode the descriptors whose tensor moved: a plan does this for all its launches
        before the first one is queued (the official timer counts host time between launches;
        the evaluator gives every iteration fresh addresses)."""
        for d in self._descs:
            p = ptrs[d.index]
            if p != d.ptr:
                d.encode(p)

    def launch(self, tensors: Sequence[torch.Tensor], ptrs: Optional[Sequence[int]], stream: int) -> None:
        raw = self._raw
        if raw is not None and ptrs is not None:
            if self._descs:
                self.encode(ptrs)
            raw(ptrs, stream)
            return
        resolved = [self._resolve(a, tensors) for a in self.args]
        compiled = self.fn[self.grid](*resolved, **self.constexprs)
        if raw is None and not self.raw_disabled:
            self._bind_raw(compiled, resolved)

    def _bind_raw(self, compiled, resolved: Sequence) -> None:
        """Bind later launches to the compiled kernel's launcher (``resolved``: this call's
        arguments as the JIT took them); where :func:`internals.bind` refuses, every launch
        goes through the JIT (it has warned, naming the reason)."""
        params = internals.parameter_names(self.fn)
        missing = [n for n in params[len(self.args):] if n not in self.constexprs]
        if missing:  # a parameter left to its default: the template would not know its value
            self.raw_disabled = True
            internals.fall_back(f"{getattr(compiled, 'name', None) or 'a kernel'}: parameters {missing} are not "
                                "given (left to their defaults)")
            return
        values = self.args + [self.constexprs[n] for n in params[len(self.args):]]
        ptr_slots = [(pos, a.index) for pos, a in enumerate(self.args) if isinstance(a, Ptr)]
        desc_slots = [(pos, a.index, resolved[pos]) for pos, a in enumerate(self.args) if isinstance(a, Desc)]
        bound = internals.bind(compiled, self.grid, values, ptr_slots, desc_slots)
        if bound is None:
            self.raw_disabled = True
            return
        self._raw, self._descs = bound


class TensorLaunches:
    """Bound launches of kernels that their callers launch with tensors directly, where no plan
    holds the launch (the FP8 casts of :mod:`fusedqkv.ops.fp8`, called from the training plans and
    the eager paths alike): ``launches(fn, grid, tensors, scalars, constexprs)`` queues
    ``fn[grid](*tensors, *scalars, **constexprs)`` (a kernel whose tensor parameters come first) on
    the current stream. Each launch signature -- kernel, grid, the scalars, the constexprs, each
    tensor's dtype, and whether every address is 16-byte aligned (what Triton specialises a pointer
    on; else each tensor's alignment) -- gets one :class:`BoundLaunch` at its first call (through
    the JIT); later calls pass the tensors' addresses to its raw launch. The token count is part of
    a signature: at ``capacity`` signatures the oldest is dropped."""

    def __init__(self, name: str, capacity: int = 256):
        from . import device

        self._stream = device.current_stream
        self.capacity = capacity
        self.launches: dict = {}
        self.builds = 0
        device.register_plan_cache(name, self)

    def clear(self) -> None:
        self.launches.clear()

    def info(self) -> dict:
        return dict(plans=len(self.launches), builds=self.builds,
                    bound=sum(1 for b in list(self.launches.values()) if b.bound))

    def __call__(self, fn, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        ptrs = [t.data_ptr() for t in tensors]
        acc = 0
        for p in ptrs:
            acc |= p
        aligned = True if not acc & 15 else tuple(not p & 15 for p in ptrs)
        # id(fn): a JITFunction hashes through its cache_key (~1 us); the entry's BoundLaunch keeps fn alive
        key = (id(fn), grid, scalars, tuple(constexprs.items()), aligned, *[t.dtype for t in tensors])
        bl = self.launches.get(key)
        stream = self._stream(tensors[0].device)
        if bl is not None and bl.bound:
            bl.launch(tensors, ptrs, stream)
            return
        if bl is None:
            table = Table()
            slots = [table.add(f"t{i}", t) for i, t in enumerate(tensors)]
            bl = BoundLaunch(fn, grid, slots + list(scalars), constexprs)
            table.release()  # (the slots keep no tensor of this call alive)
            if len(self.launches) >= self.capacity:
                self.launches.pop(next(iter(self.launches)), None)
            self.launches[key] = bl
            self.builds += 1
        bl.launch(tensors, None, stream)
