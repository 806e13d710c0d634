"""Does fusedqkv's raw launch call Triton's launcher exactly as Triton's own launch path does?
(used by test_fast_path_gate, once per supported Triton)

Run as a script in a process where the Triton under test is importable and TRITON_INTERPRET=0
(FUSEDQKV_RAW_LAUNCH as the process's mode; FUSEDQKV_PROBE_MUTATION: a layout mistake made on
purpose, which the probe must report; FUSEDQKV_PROBE_RUNS: several such checks in turn, by name --
"default", "triton" and the mutations -- each from the state the process imported).
No GPU: the active Triton driver is Triton's own ``CudaDriver`` with its device-facing parts
replaced -- the device is an sm_90 target (kernels compile offline, ptxas included), loading a
binary returns a token for the function, the TMA descriptor encoder returns a token made of its
arguments, and the launcher (Triton 3.6: the per-kernel C module Triton would compile; 3.7 on:
the driver's ``launch``) records its arguments. Everything between -- ``JITFunction.run``,
``CompiledKernel``, ``CudaLauncher``, the descriptor wrapper, ``make_tensordesc_arg`` -- is the
Triton under test.

For two kernels (one with two host TMA descriptors, a pointer, plain, divisible-by-16,
equal-to-1 and 64-bit integers, a bool, a float and constexprs; one with a pointer only; on Triton
3.6 also the Gluon forward GEMM: five Gluon descriptors, warp specialization) a ``BoundLaunch`` launches
once through the JIT (Triton's call recorded), then raw with the same tensors' addresses, then
raw again after one tensor of each moved, next to a JIT launch with the moved tensors. Each raw
call must equal Triton's call, argument for argument (a tensor counted as its address: the
launcher reads an int or ``data_ptr()`` alike), and the gate must report the raw path active.
On Triton 3.6, whose launcher is C generated per kernel, the check goes one level down: Triton's
own driver.c (its PyCUtensorMap and encoder) and each kernel's generated launcher are compiled
against a stand-in libcuda (_fake_libcuda.c) whose cuLaunchKernelEx records the launch config,
its attributes and every kernel parameter's bytes, sized as the kernel's PTX declares them. Each
launch -- Triton's, ours through its launcher (FUSEDQKV_RAW_LAUNCH=triton) or ours through ctypes
(the default) -- must reach the driver with the same bytes.
Prints one JSON line per check: {"run", "ok", "problems", "info"}.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

STREAM = 0x5EED
BIG = 2**33 + 5  # an i64 scalar
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
def desc_kernel(x_desc, y_ptr, n, one, stride_y, scale, w_desc, big, on, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    x = x_desc.load([pid * BLOCK, 0]).to(tl.float32)
    w = w_desc.load([0, 0]).to(tl.float32)
    acc = x * scale + w
    if FLAG:
        acc = acc * one
    if on:
        acc = acc + (big % 3)
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


MUTATIONS = {  # a layout mistake each (FUSEDQKV_PROBE_MUTATION), for the gate test to see caught
    "fp32-as-fp64": lambda internals: internals._SCALARS.__setitem__("fp32", ("uint32_t", "d")),
    "map-offset": lambda internals: setattr(internals, "_MAP_OFFSET", 0),
    "pdl-attribute": lambda internals: setattr(internals, "_ATTR_PDL", 7),
}


class FakeCuda:
    """Triton 3.6's driver.c and generated launchers, compiled against _fake_libcuda.c."""

    def __init__(self):
        from triton.backends.nvidia import driver as nv

        self.dir = tempfile.mkdtemp(prefix="fusedqkv-fake-libcuda-")
        atexit.register(shutil.rmtree, self.dir, True)  # the loaded libraries stay mapped until then
        lib = os.path.join(self.dir, "libcuda.so.1")
        src = Path(__file__).with_name("_fake_libcuda.c")
        subprocess.check_call(["gcc", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", f"-I{nv.include_dirs[0]}",
                               "-o", lib, str(src)])
        self.lib = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)  # dlopen("libcuda.so.1") finds it by its soname
        self.lib.fake_record.restype = ctypes.c_size_t
        self.lib.fake_launches.restype = ctypes.c_long
        self.sizes: list = []

    def compile(self, src, name, library_dirs=None, include_dirs=None, libraries=None, ccflags=None):
        """compile_module_from_src without Triton's cache (a module linked to the fake must not land there)."""
        from triton.runtime.build import _build, _load_module_from_path

        tmp = tempfile.mkdtemp(dir=self.dir)
        path = os.path.join(tmp, name + ".c")
        Path(path).write_text(src)
        so = _build(name, path, tmp, [self.dir], include_dirs or [], libraries or [], ccflags or [])
        return _load_module_from_path(name, so)

    def forget(self) -> None:
        """Record no parameters (before a new kernel's first launch: their sizes are unknown)."""
        self.sizes = []
        self.lib.fake_expect_params(-1, None)

    def expect(self, compiled) -> None:
        """Record each launch's parameters with the sizes ``compiled``'s PTX entry declares."""
        entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", compiled.asm["ptx"], re.S)
        sizes = []
        for decl in entry.group(1).split(","):
            bits = re.search(r"\.[usbf](\d+)\b", decl)
            count = re.search(r"\[(\d+)\]", decl)
            sizes.append(int(bits.group(1)) // 8 * (int(count.group(1)) if count else 1))
        self.sizes = sizes
        self.lib.fake_expect_params(len(sizes), (ctypes.c_size_t * len(sizes))(*sizes))

    def launches(self) -> int:
        return self.lib.fake_launches()

    def last(self) -> dict:
        """The last launch as the driver read it."""
        raw = ctypes.create_string_buffer(1 << 16)
        n = self.lib.fake_record(raw, len(raw))
        b = raw.raw[:n]
        grid_block = struct.unpack_from("<7I", b, 0)
        stream, fn, extra = struct.unpack_from("<3Q", b, 28)
        (n_attrs,) = struct.unpack_from("<I", b, 52)
        at, attrs = 56, []
        for _ in range(n_attrs):
            attrs.append((struct.unpack_from("<I", b, at)[0], b[at + 4: at + 68].hex()))
            at += 68
        (n_params,) = struct.unpack_from("<i", b, at)
        at += 4
        params = []
        for size in self.sizes[:max(n_params, 0)]:
            params.append(b[at: at + size].hex())
            at += size
        return {"grid": grid_block[:3], "block": grid_block[3:6], "shared": grid_block[6], "stream": stream,
                "function": fn, "extra": extra, "attrs": attrs, "params": params}

    def install(self, drv) -> None:
        from triton.backends.nvidia import driver as nv

        utils = self.compile(Path(nv.dirname, "driver.c").read_text(), "cuda_utils", include_dirs=nv.include_dirs)
        nv.PyCUtensorMap = utils.PyCUtensorMap  # what the generated launchers type-check a map against
        drv.utils.fill_tma_descriptor = utils.fill_tma_descriptor  # Triton's encoder (to the fake's map)
        nv.compile_module_from_src = self.compile


def _driver_differences(expected: dict, got: dict) -> list:
    out = [f"{k}: ours {got[k]!r}, Triton's {expected[k]!r}" for k in expected
           if k != "params" and got[k] != expected[k]]
    e, g = expected["params"], got["params"]
    if not e:
        out.append("no parameters recorded")
    out += [f"parameter {i} ({len(ei) // 2} bytes): ours {gi}, Triton's {ei}" for i, (ei, gi) in enumerate(zip(e, g))
            if ei != gi]
    return out


def gluon_forward(fake, one_launch, last_launch, differences, lora=False) -> list:
    """fusedqkv's Gluon forward GEMM (five Gluon host descriptors, two None ones, pointers, strides, a
    float, a warp-specialized kernel under maxnreg) as its plan binds it: the raw launch as Triton's;
    ``lora``: its LoRA kernel (seven descriptors, the rank sum an integer)."""
    from fusedqkv.ops.qkv_rope_norm_gemm import FusedGemmForward

    b, s, hq, hkv, d, k = 1, 128, 2, 1, 128, 256
    m, n = b * s, (hq + 2 * hkv) * d
    bf = torch.bfloat16
    named = dict(x=torch.randn(m, k, dtype=bf), w=torch.randn(n, k, dtype=bf), qkv=torch.empty(m, n, dtype=bf),
                 q=torch.empty(m, hq * d, dtype=bf), k=torch.empty(m, hkv * d, dtype=bf),
                 q_norm_weight=torch.ones(d, dtype=bf), k_norm_weight=torch.ones(d, dtype=bf),
                 rstd_q=torch.empty(b, hq, s), rstd_k=torch.empty(b, hkv, s), cos=torch.randn(b, s, d, dtype=bf),
                 sin=torch.randn(b, s, d, dtype=bf))
    if lora:
        named.update(u=torch.randn(m, 48, dtype=bf), b=torch.randn(n, 48, dtype=bf))
    fwd = FusedGemmForward(m, n, k, s, hq, hkv, d, 1e-6, False, True, bf, "cpu", sms=132, lora=lora)
    what = "the Gluon forward" + (" with LoRA" if lora else "")
    table, launch = fwd.bound_launch(named)
    tensors = table.tensors(named)
    fake.forget()  # compiled first, for its PTX's parameter sizes
    fake.expect(launch.fn[launch.grid](*[launch._resolve(a, tensors) for a in launch.args], **launch.constexprs))
    problems = []
    one_launch(f"{what}, the JIT", lambda: launch.launch(tensors, None, STREAM))
    triton_call = last_launch()
    if not launch.bound:
        return [f"{what}: not bound to the raw launch"]
    ptrs = table.addresses({name: t.data_ptr() for name, t in named.items()})
    launch.encode(ptrs)
    one_launch(f"{what}, raw", lambda: launch.launch(None, ptrs, STREAM))
    problems += [f"{what}: {p}" for p in differences(triton_call, last_launch())]
    return problems


RUNS = ("default", "triton", *MUTATIONS)  # FUSEDQKV_PROBE_RUNS: what one process may check in turn


def _runs() -> list:
    """(name, launch mode, mutation) of each check this process makes: FUSEDQKV_PROBE_RUNS (comma-separated
    names of RUNS), else the one that FUSEDQKV_RAW_LAUNCH and FUSEDQKV_PROBE_MUTATION describe."""
    names = [n for n in os.environ.get("FUSEDQKV_PROBE_RUNS", "").split(",") if n]
    if not names:
        mutation = os.environ.get("FUSEDQKV_PROBE_MUTATION") or None
        return [(mutation or "default", os.environ.get("FUSEDQKV_RAW_LAUNCH") or None, mutation)]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"FUSEDQKV_PROBE_RUNS: unknown {unknown}; expected names of {RUNS}")
    return [(n, "triton" if n == "triton" else None, n if n in MUTATIONS else None) for n in names]


def main() -> int:
    """Each run (``_runs``) checked in turn from the same state -- internals' layout tables and launch mode
    as imported, no launch bound, no fallback, no warning -- each printing its JSON line."""
    from fusedqkv.ops import internals
    from triton.backends.nvidia import driver as nv

    caught = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, *a, **k: caught.append(str(message))
    rec = Recorder()
    install_driver(rec)
    fake = None
    if hasattr(nv, "make_launcher"):  # 3.6: the per-kernel C launcher, compiled for real
        fake = FakeCuda()
        fake.install(triton.runtime.driver.active)
    failed = 0
    for name, mode, mutation in _runs():
        saved = (dict(internals._SCALARS), internals._MAP_OFFSET, internals._ATTR_PDL, internals.LAUNCH_MODE)
        internals._BOUND[0] = internals._DRIVER_BOUND[0] = 0
        internals._FALLBACKS.clear()
        caught.clear()
        rec.launches.clear()
        rec.encodes.clear()
        if fake is not None:
            fake.forget()  # as a fresh process: no parameters recorded until a kernel's sizes are known
        internals.LAUNCH_MODE = mode
        try:
            if mutation:
                MUTATIONS[mutation](internals)
            problems, info = _check(internals, rec, fake, caught, mode, mutation)
        finally:
            internals._SCALARS.clear()
            internals._SCALARS.update(saved[0])
            internals._MAP_OFFSET, internals._ATTR_PDL, internals.LAUNCH_MODE = saved[1:]
        print(json.dumps({"run": name, "ok": not problems, "problems": problems, "info": info}), flush=True)
        failed += bool(problems)
    return 0 if not failed else 1


def _check(internals, rec, fake, caught, mode, mutation) -> tuple:
    """(problems, the gate's info) of one run."""
    from fusedqkv.ops.launch import BoundLaunch, Desc, Table, _tensor_descriptor

    problems: list = []

    def last_launch():
        if fake is not None:
            return fake.last()
        assert rec.launches, "nothing was launched"
        return rec.launches.pop()

    def differences(expected, got, hooks_registered=False):
        if fake is not None:
            return _driver_differences(expected, got)
        return _differences(expected, got, hooks_registered)

    def one_launch(what, fn):
        """``fn()`` must reach the driver (3.6: the fake) exactly once."""
        before = fake.launches() if fake is not None else len(rec.launches)
        fn()
        after = fake.launches() if fake is not None else len(rec.launches)
        if after != before + 1:
            problems.append(f"{what}: {after - before} launches, expected 1")

    # a kernel with host TMA descriptors
    x, w = torch.randn(48, 16).half(), torch.randn(16, 16).half()
    y = torch.zeros(48, 16, dtype=torch.float16)
    table = Table()
    px, py, pw = table.add("x", x), table.add("y", y), table.add("w", w)
    consts = dict(BLOCK=16, FLAG=True, num_warps=4, launch_pdl=True)  # PDL on, cooperative grid off

    def jit_desc(xt, yt):
        return desc_kernel[(3,)](_tensor_descriptor(xt, [16, 16]), yt, 37, 1, 32, 0.5, _tensor_descriptor(w, [16, 16]),
                                 BIG, True, **consts)

    if fake is not None:  # compiled first, for its PTX's parameter sizes
        fake.expect(jit_desc(x, y))
    launch = BoundLaunch(desc_kernel, (3,), [Desc(px, [16, 16]), py, 37, 1, 32, 0.5, Desc(pw, [16, 16]), BIG, True],
                         consts)
    one_launch("desc_kernel, the JIT", lambda: launch.launch([x, y, w], None, STREAM))  # compiles, launches, binds
    triton_call = last_launch()
    if not launch.bound:
        problems.append("desc_kernel: not bound to the raw launch")
    else:
        one_launch("desc_kernel, raw", lambda: launch.launch([x, y, w], [x.data_ptr(), y.data_ptr(), w.data_ptr()],
                                                              STREAM))
        problems += [f"desc_kernel: {p}" for p in differences(triton_call, last_launch())]
        # one descriptor's tensor and the pointer move: Triton's launch with them, then ours
        x2, y2 = x.clone(), y.clone()
        one_launch("desc_kernel, the JIT, moved tensors", lambda: jit_desc(x2, y2))
        triton_call = last_launch()
        n_encodes = len(rec.encodes)
        ptrs = [x2.data_ptr(), y2.data_ptr(), w.data_ptr()]
        launch.encode(ptrs)
        one_launch("desc_kernel, raw, moved tensors", lambda: launch.launch(None, ptrs, STREAM))
        problems += [f"desc_kernel, moved tensors: {p}" for p in differences(triton_call, last_launch())]
        if fake is None and len(rec.encodes) != n_encodes + 1:
            problems.append(f"desc_kernel: {len(rec.encodes) - n_encodes} descriptors encoded again, expected 1 "
                            "(only the moved tensor's)")
        # back to the first addresses: the remembered maps, repointed
        ptrs0 = [x.data_ptr(), y.data_ptr(), w.data_ptr()]
        launch.encode(ptrs0)
        one_launch("desc_kernel, raw, first tensors again", lambda: launch.launch(None, ptrs0, STREAM))
        if fake is not None:
            got = last_launch()
            one_launch("desc_kernel, the JIT, first tensors again", lambda: jit_desc(x, y))
            problems += [f"desc_kernel, first tensors again: {p}" for p in differences(last_launch(), got)]
        else:
            last_launch()
        # a launch hook registered (a profiler): Triton's metadata and hook chains, passed as Triton passes them
        calls = []
        hook = lambda metadata: calls.append(metadata)  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            one_launch("desc_kernel, the JIT, a hook registered", lambda: jit_desc(x2, y2))
            triton_call = last_launch()
            one_launch("desc_kernel, raw, a hook registered", lambda: launch.launch(None, ptrs, STREAM))
            problems += [f"desc_kernel, a launch hook registered: {p}"
                         for p in differences(triton_call, last_launch(), hooks_registered=True)]
            if fake is not None and len(calls) != 2:
                problems.append(f"desc_kernel: the launch hook was called {len(calls)} times, expected 2")
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)

    # a kernel with a pointer only (3.6: on a cooperative grid of 2-CTA clusters)
    buf = torch.zeros(100, dtype=torch.int32)
    plain_consts = dict(BLOCK=64, num_ctas=2, launch_cooperative_grid=True) if fake is not None else dict(BLOCK=64)
    if fake is not None:
        fake.forget()
        fake.expect(plain_kernel[(2,)](buf, 100, **plain_consts))
    plain = BoundLaunch(plain_kernel, (2,), [Table().add("buf", buf), 100], plain_consts)
    one_launch("plain_kernel, the JIT", lambda: plain.launch([buf], None, STREAM))
    triton_call = last_launch()
    if not plain.bound:
        problems.append("plain_kernel: not bound to the raw launch")
    else:
        one_launch("plain_kernel, raw", lambda: plain.launch([buf], [buf.data_ptr()], STREAM))
        problems += [f"plain_kernel: {p}" for p in differences(triton_call, last_launch())]

    bound = 2
    # the Gluon forward GEMM (tested on 3.6 only; not under a mutation: the kernels above show it, and its
    # compiles are the probe's largest)
    if fake is not None and internals.gluon_gate() is None and not mutation:
        bound += 2
        problems += gluon_forward(fake, one_launch, last_launch, differences)
        problems += gluon_forward(fake, one_launch, last_launch, differences, lora=True)

    info = internals.fast_path_info()
    expected_abi = internals.MODULE_ABI if triton.__version__.startswith("3.6.") else internals.SHARED_ABI
    driver = fake is not None and (mode or "ctypes") == "ctypes"
    if not info["active"]:
        problems.append(f"the fast path is inactive: {info['reason']}")
    if info["abi"] != expected_abi:
        problems.append(f"launcher ABI {info['abi']!r}, expected {expected_abi!r} for Triton {triton.__version__}")
    if info["bound_launches"] != bound:
        problems.append(f"{info['bound_launches']} launches bound, expected {bound}")
    if (info["launch"], info["driver_launches"]) != (("ctypes", bound) if driver else ("triton", 0)):
        problems.append(f"launch mode {info['launch']!r} with {info['driver_launches']} driver launches, expected "
                        f"{f'ctypes with {bound}' if driver else 'triton with 0'}")
    problems += [f"warning: {m}" for m in caught if "fast path" in m]
    return problems, info


if __name__ == "__main__":
    sys.exit(main())
