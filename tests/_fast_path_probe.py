"""Does fusedqkv's raw launch call Triton's launcher exactly as Triton's own launch path does?
(used by test_fast_path_gate, once per supported Triton)

Run as a script in a process where the Triton under test is importable and TRITON_INTERPRET=0.
No GPU: the active Triton driver is Triton's own ``CudaDriver`` with its device-facing parts
replaced -- the device is an sm_90 target (kernels compile offline, ptxas included), loading a
binary returns a token for the function, the TMA descriptor encoder returns a token made of its
arguments, and the launcher (Triton 3.6: the per-kernel C module Triton would compile; 3.7 on:
the driver's ``launch``) records its arguments. Everything between -- ``JITFunction.run``,
``CompiledKernel``, ``CudaLauncher``, the descriptor wrapper, ``make_tensordesc_arg`` -- is the
Triton under test.

For two kernels (one with two host TMA descriptors, a pointer, plain, divisible-by-16 and
equal-to-1 integers, a float and constexprs; one with a pointer only) a ``BoundLaunch`` launches
once through the JIT (Triton's call recorded), then raw with the same tensors' addresses, then
raw again after one tensor of each moved, next to a JIT launch with the moved tensors. Each raw
call must equal Triton's call, argument for argument (a tensor counted as its address: the
launcher reads an int or ``data_ptr()`` alike), and the gate must report the raw path active.
Prints one JSON line: {"ok", "problems", "info"}.
"""

from __future__ import annotations

import json
import sys
import types
import warnings

import torch
import triton
import triton.language as tl

STREAM = 0x5EED
FUNCTION = 0xF00D


class Recorder:
    def __init__(self):
        self.launches: list = []
        self.encodes: list = []

    def launch(self, *args):
        self.launches.append(args)

    def encode(self, *args):
        self.encodes.append(args)
        return ("tensor-map", *(_freeze(a) for a in args))


def _freeze(a):
    return tuple(_freeze(x) for x in a) if isinstance(a, (list, tuple)) else a


class FakeKernelArg:  # the C launcher's PyKernelArg (3.7 on), compared by value
    def __init__(self, nested_tuple=None, type=None):
        self.nested_tuple, self.type = nested_tuple, type

    def __eq__(self, other):
        return isinstance(other, FakeKernelArg) and (self.nested_tuple, self.type) == (other.nested_tuple, other.type)

    def __repr__(self):
        return f"KernelArg({self.type}, {self.nested_tuple})"


def install_driver(rec: Recorder) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nv

    utils = types.SimpleNamespace(
        launch=rec.launch,
        build_signature_metadata=lambda sig: ("signature", tuple(sig)),
        fill_tma_descriptor=rec.encode,
        fill_tma_descriptor_tiled=rec.encode,
        get_device_properties=lambda device: {"max_shared_mem": 232448, "multiprocessor_count": 132,
                                              "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000,
                                              "mem_clock_rate": 2619000, "mem_bus_width": 6144},
        load_binary=lambda name, kernel, shared, device: (0xB10C, FUNCTION, 32, 0, 1024),
        unload_module=lambda module: None,
        get_current_device=lambda: 0,
        set_current_device=lambda device: None,
        get_current_stream=lambda device: STREAM,
        get_device_capability=lambda device=0: (9, 0),
    )
    # 3.6: the per-kernel launcher module Triton compiles from C; 3.7 on: the argument annotations
    nv.compile_module_from_src = lambda *a, **k: types.SimpleNamespace(launch=rec.launch)
    nv.library_dirs = lambda: []
    nv.PyKernelArg, nv.ARG_CONSTEXPR, nv.ARG_KERNEL, nv.ARG_TUPLE = FakeKernelArg, "constexpr", "kernel", "tuple"

    drv = object.__new__(nv.CudaDriver)  # Triton's driver class, without loading CUDA
    drv.utils = utils
    drv.launcher_cls = nv.CudaLauncher
    drv.get_current_device = lambda: 0
    drv.set_current_device = lambda device: None
    drv.get_current_stream = lambda device=None: STREAM
    drv.get_device_capability = lambda device=0: (9, 0)
    drv.get_current_target = lambda: GPUTarget("cuda", 90, 32)
    drv.get_active_torch_device = lambda: torch.device("cpu")
    triton.runtime.driver.set_active(drv)


@triton.jit
def desc_kernel(x_desc, y_ptr, n, one, stride_y, scale, w_desc, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    x = x_desc.load([pid * BLOCK, 0]).to(tl.float32)
    w = w_desc.load([0, 0]).to(tl.float32)
    acc = x * scale + w
    if FLAG:
        acc = acc * one
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, 16)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(tl.float16), mask=rows[:, None] < n)


@triton.jit
def plain_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], tl.int32) + 7, mask=offs < n)


def _normal(a):
    """A launcher argument as the launcher reads it: a tensor is its address (an int or an object
    with ``data_ptr()`` alike); Triton's launch metadata by content, hook chains by identity."""
    from triton.compiler.compiler import LazyDict
    from triton.knobs import HookChain

    if isinstance(a, torch.Tensor):
        return ("int", a.data_ptr())
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_normal(x) for x in a))
    if isinstance(a, LazyDict):
        return ("LazyDict", sorted(a.data.items()), a.extras)
    if isinstance(a, HookChain):
        return ("HookChain", id(a))
    return (type(a).__name__, a)


def _without_empty_hooks(call):
    """Triton's call with its empty launch-hook chains, and the metadata only a hook reads, as
    None: the launcher calls a hook only when it is not None, and an empty chain calls nothing.
    (The raw launch passes None for the three while no hook is registered: see make_enqueue.)"""
    from triton.compiler.compiler import LazyDict
    from triton.knobs import HookChain

    if any(isinstance(a, HookChain) and a.calls for a in call):
        return call
    return tuple(None if isinstance(a, (HookChain, LazyDict)) else a for a in call)


def _differences(expected, got, hooks_registered: bool = False) -> list:
    e, g = _normal(expected if hooks_registered else _without_empty_hooks(expected)), _normal(got)
    if e == g:
        return []
    if len(e) != len(g):
        return [f"{len(g) - 1} launcher arguments, Triton passes {len(e) - 1}: ours {g}, Triton's {e}"]
    return [f"argument {i - 1}: ours {gi!r}, Triton's {ei!r}" for i, (ei, gi) in enumerate(zip(e, g)) if ei != gi]


def main() -> int:
    from fusedqkv.ops import internals
    from fusedqkv.ops.launch import BoundLaunch, Desc, Table, _tensor_descriptor

    problems: list = []
    caught = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, *a, **k: caught.append(str(message))
    rec = Recorder()
    install_driver(rec)

    def last_launch():
        assert rec.launches, "nothing was launched"
        return rec.launches.pop()

    # a kernel with host TMA descriptors
    x, w = torch.randn(48, 16).half(), torch.randn(16, 16).half()
    y = torch.zeros(48, 16, dtype=torch.float16)
    table = Table()
    px, py, pw = table.add("x", x), table.add("y", y), table.add("w", w)
    consts = dict(BLOCK=16, FLAG=True, num_warps=4, launch_pdl=True)  # PDL on, cooperative grid off
    launch = BoundLaunch(desc_kernel, (3,), [Desc(px, [16, 16]), py, 37, 1, 16, 0.5, Desc(pw, [16, 16])], consts)
    launch.launch([x, y, w], None, STREAM)  # the JIT: compiles (offline), launches, binds
    triton_call = last_launch()
    if not launch.bound:
        problems.append("desc_kernel: not bound to the raw launch")
    else:
        launch.launch([x, y, w], [x.data_ptr(), y.data_ptr(), w.data_ptr()], STREAM)
        problems += [f"desc_kernel: {p}" for p in _differences(triton_call, last_launch())]
        # one descriptor's tensor and the pointer move: Triton's launch with them, then ours
        x2, y2 = x.clone(), y.clone()
        desc_kernel[(3,)](_tensor_descriptor(x2, [16, 16]), y2, 37, 1, 16, 0.5, _tensor_descriptor(w, [16, 16]),
                          **consts)
        triton_call = last_launch()
        n_encodes = len(rec.encodes)
        ptrs = [x2.data_ptr(), y2.data_ptr(), w.data_ptr()]
        launch.encode(ptrs)
        launch.launch(None, ptrs, STREAM)
        problems += [f"desc_kernel, moved tensors: {p}" for p in _differences(triton_call, last_launch())]
        if len(rec.encodes) != n_encodes + 1:
            problems.append(f"desc_kernel: {len(rec.encodes) - n_encodes} descriptors encoded again, expected 1 "
                            "(only the moved tensor's)")
        # a launch hook registered (a profiler): Triton's metadata and hook chains, passed as Triton passes them
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            desc_kernel[(3,)](_tensor_descriptor(x2, [16, 16]), y2, 37, 1, 16, 0.5, _tensor_descriptor(w, [16, 16]),
                              **consts)
            triton_call = last_launch()
            launch.launch(None, ptrs, STREAM)
            problems += [f"desc_kernel, a launch hook registered: {p}"
                         for p in _differences(triton_call, last_launch(), hooks_registered=True)]
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)

    # a kernel with a pointer only
    buf = torch.zeros(100, dtype=torch.int32)
    plain = BoundLaunch(plain_kernel, (2,), [Table().add("buf", buf), 100], dict(BLOCK=64))
    plain.launch([buf], None, STREAM)
    triton_call = last_launch()
    if not plain.bound:
        problems.append("plain_kernel: not bound to the raw launch")
    else:
        plain.launch([buf], [buf.data_ptr()], STREAM)
        problems += [f"plain_kernel: {p}" for p in _differences(triton_call, last_launch())]

    info = internals.fast_path_info()
    expected_abi = internals.MODULE_ABI if triton.__version__.startswith("3.6.") else internals.SHARED_ABI
    if not info["active"]:
        problems.append(f"the fast path is inactive: {info['reason']}")
    if info["abi"] != expected_abi:
        problems.append(f"launcher ABI {info['abi']!r}, expected {expected_abi!r} for Triton {triton.__version__}")
    if info["bound_launches"] != 2:
        problems.append(f"{info['bound_launches']} launches bound, expected 2")
    problems += [f"warning: {m}" for m in caught if "fast path" in m]
    print(json.dumps({"ok": not problems, "problems": problems, "info": info}), flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
