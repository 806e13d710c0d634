"""Low-overhead launches of Triton kernels.

``JITFunction.run`` binds and specialises every argument on every call; for kernels
that take every stride explicitly (~80 arguments here) that costs ~100 us of host
time on the H200 box (measured: benchmarks/NOTES.md). The 091 timer spans first kernel
start to last kernel end, so host time between our launches becomes idle GPU time.

``FastLaunch`` keys a cache on exactly what Triton specialises on -- each tensor's
dtype and 16-byte alignment, each integer's ``== 1`` / ``% 16 == 0`` / 32-bit range,
the constexprs and the compile options -- compiles through the normal path the first
time, and afterwards calls the compiled kernel's launcher directly.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def sm90_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (Hopper on): what TMA descriptors,
    programmatic dependent launch and the 16-bit pair arithmetic of the exact stage need.
    Older GPUs take the per-thread loads, fp32 math with a cast (the same roundings) and cuBLAS."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def _is_desc(a) -> bool:
    """A host TMA descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``)."""
    return not isinstance(a, torch.Tensor) and hasattr(a, "block_shape") and hasattr(a, "base")


def _spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if _is_desc(a):  # Triton specialises on a host TMA descriptor's dtype and block
        return ("tensordesc", a.base.dtype, tuple(a.block_shape), a.padding)
    if isinstance(a, bool):
        return ("u1", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, -(2 ** 31) <= a < 2 ** 31)
    if isinstance(a, float):
        return ("fp32",)
    return (type(a).__name__, a)


class FastLaunch:
    """``FastLaunch(kernel)[grid](*runtime_args, **constexprs_and_options)``.

    Runtime arguments are positional, in the kernel's parameter order; every constexpr
    parameter is passed by keyword, with the compile options (``num_warps`` ...).
    ``FastLaunch(kernel).prepared(grid)(...)`` does the same host work but returns the
    enqueue as a callable.
    """

    def __init__(self, fn):
        self.fn = fn
        self.params = list(fn.arg_names)
        self.cache: dict = {}
        self.enabled = not _INTERPRET

    def __getitem__(self, grid):
        return lambda *args, **kw: self.prepare(grid, args, kw)()

    def prepared(self, grid):
        """``FastLaunch(kernel).prepared(grid)(*args, **kw)`` returns a callable that launches:
        the host work (specialisation key, argument tuple) is done now, the enqueue when it is
        called -- so a caller can do the work of several launches before the first kernel
        starts, and then issue them back to back."""
        return lambda *args, **kw: self.prepare(grid, args, kw)

    def prepare(self, grid, args, kw):
        first = args[0] if args else None
        if _is_desc(first):
            first = first.base
        if not self.enabled or not isinstance(first, torch.Tensor) or not first.is_cuda:
            return lambda: self.fn[grid](*args, **kw)
        device = first.device.index
        key = (device, tuple(map(_spec, args)), tuple(sorted(kw.items())))
        ck = self.cache.get(key)
        if ck is None:
            def first():  # compiles (or finds) and launches
                self.cache[key] = self.fn[grid](*args, **kw)
            return first
        try:
            full = args + tuple(kw[n] for n in self.params[len(args):])
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            stream = torch._C._cuda_getCurrentRawStream(device)
            run, function, meta = ck.run, ck.function, ck.packed_metadata
            if any(_is_desc(a) for a in full):
                return _descriptor_launch(run, function, meta, (grid[0], g1, g2), stream, full)
        except (AttributeError, KeyError, TypeError, ImportError):  # a Triton whose internals differ
            return self._disable(grid, args, kw)

        def launch():
            try:
                run(grid[0], g1, g2, stream, function, meta, None, None, None, *full)
            except TypeError:  # a launcher whose signature differs
                self._disable(grid, args, kw)()
        return launch

    def _disable(self, grid, args, kw):
        self.enabled = False
        self.cache.clear()
        return lambda: self.fn[grid](*args, **kw)


_raw_launchers: dict = {}  # id(CudaLauncher) -> (it, the launcher it wraps, descriptor metadata)


def _descriptor_launch(run, function, meta, grid, stream, full):
    """The enqueue of a kernel taking host TMA descriptors, with every descriptor encoded now:
    Triton's launcher would encode them (``fill_tma_descriptor``, a few us of host time each)
    inside the enqueue, i.e. between our launches."""
    import inspect

    from triton.backends.nvidia.driver import make_tensordesc_arg

    found = _raw_launchers.get(id(run))
    if found is None or found[0] is not run:
        if run.global_scratch_size or run.profile_scratch_size:
            raise TypeError("kernel needs scratch memory")
        closure = inspect.getclosurevars(run.launch).nonlocals  # Triton's tensordesc wrapper
        found = _raw_launchers[id(run)] = (run, closure["launcher"], closure["tensordesc_meta"])
    _, raw, metas = found
    expanded, k = [], 0
    for a in full:
        if _is_desc(a):
            expanded.extend(make_tensordesc_arg(a, metas[k]))
            k += 1
        else:
            expanded.append(a)
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl

    def launch():
        raw(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, meta, None, None, None, *expanded)
    return launch


_kernels: dict = {}


def kernel(module: str, name: str) -> FastLaunch:
    """The FastLaunch of ``fusedqkv.kernels.<module>.<name>``, imported on first use (triton is
    only needed on the Triton backend) and kept, so its specialisation cache lives on."""
    k = _kernels.get((module, name))
    if k is None:
        mod = importlib.import_module(f"fusedqkv.kernels.{module}")
        k = _kernels[(module, name)] = FastLaunch(getattr(mod, name))
    return k
