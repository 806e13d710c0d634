"""cuBLASLt matmuls planned once: ``D = A @ B`` for one shape, layout and dtype, the algorithm
chosen when the plan is built, each call only the three addresses and the stream.

``torch.mm`` spends 10-20 us of host time per call on the H200's host (dispatch, output checks,
cuBLAS's own heuristic query), and in a 091 call or a training step that time shows: between
our kernels (a short stage kernel, then a GEMM that waits for the host) and in every step of a
loop the GPU outruns. A :class:`LtMatmul` asks cuBLASLt's heuristic once, at plan time, and a
call is one ``cublasLtMatmul`` through ctypes.

Row-major operands map onto cuBLAS's column-major convention as the transposed problem:
``D^T = B^T A^T``; a row-major matrix [r, c] with row stride ld is the column-major [c, r] of
leading dimension ld, and a transposed view (unit row stride) is the column-major [r, c] with
op T. The library is the libcublasLt that torch itself loaded.

:func:`lt_matmul` returns None where this does not apply (no CUDA, an fp32 or mixed dtype, a
layout with no unit stride, no library, no algorithm): callers keep ``torch.mm`` there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Optional

import torch

from . import device as _device

_CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_32F = 2, 14, 0
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE = 1
_PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D = 5, 6, 7, 8
_OP_N, _OP_T = 0, 1
_HEURISTIC_RESULT_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo (64) + size_t + int + float + int[4]
_MAX_WORKSPACE = 32 << 20  # cuBLAS's recommendation for Hopper and Blackwell (the heuristic may use less)
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
# alignments an algorithm may assume: the plan's run checks the call's addresses against the
# larger and takes the algorithm chosen for 16 bytes otherwise
ALIGN_HIGH, ALIGN_LOW = 256, 16


class LtError(RuntimeError):
    pass


def _find_library() -> Optional[ctypes.CDLL]:
    """The libcublasLt torch loaded (found in this process's maps), else the loader's."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "libcublasLt.so" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    for name in paths + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class _Lib:
    """The cuBLASLt entry points, typed."""

    def __init__(self, cdll: ctypes.CDLL):
        vp, u64, i64, sz, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int

        def fn(name, *argtypes):
            f = getattr(cdll, name)
            f.argtypes, f.restype = list(argtypes), i32
            return f

        self.create = fn("cublasLtCreate", vp)
        self.desc_create = fn("cublasLtMatmulDescCreate", vp, i32, i32)
        self.desc_set = fn("cublasLtMatmulDescSetAttribute", vp, i32, vp, sz)
        self.desc_destroy = fn("cublasLtMatmulDescDestroy", vp)
        self.layout_create = fn("cublasLtMatrixLayoutCreate", vp, i32, u64, u64, i64)
        self.layout_destroy = fn("cublasLtMatrixLayoutDestroy", vp)
        self.pref_destroy = fn("cublasLtMatmulPreferenceDestroy", vp)
        self.pref_create = fn("cublasLtMatmulPreferenceCreate", vp)
        self.pref_set = fn("cublasLtMatmulPreferenceSetAttribute", vp, i32, vp, sz)
        self.heuristic = fn("cublasLtMatmulAlgoGetHeuristic", vp, vp, vp, vp, vp, vp, vp, i32, vp, vp)
        # every argument an address or a size: the hot path passes plain ints
        self.matmul = fn("cublasLtMatmul", vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp)
        self._lock = threading.Lock()
        self.cdll = cdll

    def handle(self, index: int) -> int:
        """The device's cuBLASLt handle (owned by :mod:`fusedqkv.ops.device`)."""
        def create() -> int:
            with self._lock, torch.cuda.device(index):
                out = ctypes.c_void_p()
                _check(self.create(ctypes.byref(out)), "cublasLtCreate")
                return out.value
        return _device.handle("cublaslt", index, create)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LtError(f"{what} failed with cuBLAS status {status}")


@functools.cache
def library() -> Optional[_Lib]:
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    cdll = _find_library()
    if cdll is None:
        return None
    try:
        return _Lib(cdll)
    except AttributeError:  # a library without the entry points
        return None


def _column_major(shape, strides):
    """(op, rows, cols, ld) of a row-major-semantic [r, c] matrix in cuBLAS's column-major
    convention, as the operand of the transposed problem; None without a unit stride."""
    r, c = shape
    s0, s1 = strides
    if s1 == 1 or c == 1:  # row-major: column-major [c, r], ld = row stride
        return _OP_N, c, r, max(s0, c, 1)
    if s0 == 1 or r == 1:  # a transposed view: column-major [r, c], ld = column stride; op T
        return _OP_T, r, c, max(s1, r, 1)
    return None


def _first_algorithm(lib: "_Lib", handle: int, desc: int, layouts: list, ws_bytes: int, align: Optional[int] = None,
                     what: str = "matmul"):
    """cuBLASLt's first algorithm for ``desc`` over ``layouts`` (its A, B, C = D) under a workspace cap of
    ``ws_bytes`` and, where given, a minimum alignment of ``align`` bytes for every matrix (else the
    library's default): ``(the algorithm's 64 bytes, the workspace bytes it asks for)``."""
    pref = ctypes.c_void_p()
    _check(lib.pref_create(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    try:
        ws = ctypes.c_uint64(ws_bytes)
        _check(lib.pref_set(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "MAX_WORKSPACE_BYTES")
        if align is not None:
            a = ctypes.c_uint32(align)
            for attr in (_PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D):
                _check(lib.pref_set(pref, attr, ctypes.byref(a), 4), "MIN_ALIGNMENT")
        result = (ctypes.c_uint8 * _HEURISTIC_RESULT_BYTES)()
        count = ctypes.c_int(0)
        first, second, d_l = layouts
        _check(lib.heuristic(handle, desc, first, second, d_l, d_l, pref, 1, result, ctypes.byref(count)),
               "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1:
            raise LtError(f"cuBLASLt has no algorithm for this {what}")
    finally:
        lib.pref_destroy(pref)
    raw = bytes(result)
    return (ctypes.c_uint8 * 64).from_buffer_copy(raw[:64]), int.from_bytes(raw[64:72], "little")


class LtMatmul:
    """``d[M, N] = a[M, K] @ b[K, N]`` (row-major semantics, the strides given at plan time) on
    one device, one dtype; call with the three addresses and the raw stream."""

    __slots__ = ("lib", "handle", "desc", "layouts", "algos", "ws_bytes", "scalars", "device", "_keep",
                 "shape")

    def __init__(self, lib: _Lib, device: torch.device, index: int, dtype: torch.dtype, M: int, N: int, K: int,
                 a_strides, b_strides, d_strides):
        self.lib, self.device, self.shape = lib, device, (M, N, K)
        self.desc, self.layouts = None, []
        dt = _DTYPES[dtype]
        a_cm = _column_major((M, K), a_strides)
        b_cm = _column_major((K, N), b_strides)
        d_cm = _column_major((M, N), d_strides)
        if a_cm is None or b_cm is None or d_cm is None or d_cm[0] != _OP_N:
            raise LtError("no column-major view of an operand")
        self.handle = lib.handle(index)
        vp = ctypes.c_void_p
        desc = vp()
        _check(lib.desc_create(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
        self.desc = desc.value
        # the transposed problem: first operand B^T (N x K), second A^T (K x M)
        op_first, op_second = ctypes.c_int32(b_cm[0]), ctypes.c_int32(a_cm[0])
        _check(lib.desc_set(desc, _DESC_TRANSA, ctypes.byref(op_first), 4), "TRANSA")
        _check(lib.desc_set(desc, _DESC_TRANSB, ctypes.byref(op_second), 4), "TRANSB")
        for _, rows, cols, ld in (b_cm, a_cm, d_cm):
            lay = vp()
            _check(lib.layout_create(ctypes.byref(lay), dt, rows, cols, ld), "cublasLtMatrixLayoutCreate")
            self.layouts.append(lay.value)
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.scalars = (ctypes.addressof(alpha), ctypes.addressof(beta))
        algos, ws = [], 0
        for align in (ALIGN_HIGH, ALIGN_LOW):
            buf, nbytes = _first_algorithm(lib, self.handle, self.desc, self.layouts, _MAX_WORKSPACE, align)
            algos.append(buf)
            ws = max(ws, nbytes)
        self.algos = (ctypes.addressof(algos[0]), ctypes.addressof(algos[1]))
        self._keep = (algos, alpha, beta)  # what the addresses point at lives as long as the plan
        self.ws_bytes = ws

    def __del__(self):
        # descriptors are host memory: freed with the plan (plans are evicted from their cache)
        try:
            lib = self.lib
            for lay in self.layouts:
                lib.layout_destroy(lay)
            if self.desc is not None:
                lib.desc_destroy(self.desc)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
            pass

    def __call__(self, a_ptr: int, b_ptr: int, d_ptr: int, stream: int, capture: Optional[bool] = None) -> None:
        """``capture``: whether ``stream`` is being captured, where the caller asked already (None: asked here)."""
        algo = self.algos[0] if not ((a_ptr | b_ptr | d_ptr) & (ALIGN_HIGH - 1)) else self.algos[1]
        b_l, a_l, d_l = self.layouts
        # the stream's workspace (a fresh one, held until the call returns, while capturing)
        ws = _device.workspace("cublaslt", self.device, stream, self.ws_bytes, capture) if self.ws_bytes else None
        alpha, beta = self.scalars
        status = self.lib.matmul(self.handle, self.desc, alpha, b_ptr, b_l, a_ptr, a_l, beta, d_ptr, d_l, d_ptr, d_l,
                                 algo, None if ws is None else ws.data_ptr(), self.ws_bytes, stream)
        if status != 0:
            raise LtError(f"cublasLtMatmul failed with cuBLAS status {status} (shape {self.shape})")


def lt_matmul(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, cfg) -> Optional[LtMatmul]:
    """A planned ``d = a @ b`` for tensors like these (2-D, one CUDA device, bf16 or fp16
    throughout, each with a unit stride), or None where ``torch.mm`` must serve (and when
    ``cfg.cublaslt`` is off)."""
    if a is None or b is None or d is None:
        return None
    if not (a.is_cuda and b.is_cuda and d.is_cuda) or a.dim() != 2 or b.dim() != 2 or d.dim() != 2:
        return None
    if not (a.dtype == b.dtype == d.dtype) or not (a.device == b.device == d.device):
        return None
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or tuple(d.shape) != (M, N):
        return None
    return plan_matmul(a.dtype, a.device, M, N, K, a.stride(), b.stride(), d.stride(), cfg)


def plan_matmul(dtype: torch.dtype, device: torch.device, M: int, N: int, K: int, a_strides, b_strides, d_strides,
                cfg) -> Optional[LtMatmul]:
    """:func:`lt_matmul` from sizes and strides alone (a destination the plan does not hold yet)."""
    if not cfg.cublaslt or device.type != "cuda" or dtype not in _DTYPES or min(M, N, K) == 0:
        return None
    lib = library()
    if lib is None:
        return None
    try:
        return LtMatmul(lib, device, _device.device_index(device), dtype, M, N, K, a_strides, b_strides, d_strides)
    except (LtError, OSError):  # no algorithm, or a library that refuses: torch.mm serves
        return None


# ------------------------------------------------------------------------ FP8: torch._scaled_mm's call, planned

_CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 28, 29
_FP8_DTYPES = {torch.float8_e4m3fn: _CUDA_R_8F_E4M3, torch.float8_e5m2: _CUDA_R_8F_E5M2}
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM = 17, 18, 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32  # (cuBLASLt 12.8+)
_SCALE_SCALAR_32F, _SCALE_OUTER_VEC_32F = 0, 3  # (outer vectors: cuBLASLt 12.9+)
_ALIGN_DEFAULT = 256  # cuBLASLt's default minimum alignment, which torch's scaled GEMM leaves as it is


def _torch_lt_workspace_bytes() -> int:
    # torch's cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE in KiB, default 1 MiB), which its scaled GEMM
    # gives the heuristic: the same cap picks the same algorithm
    try:
        return max(0, int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024"))) * 1024
    except ValueError:
        return 1 << 20


class LtScaledMatmul:
    """``d[M, N] = (a[M, K] * a_scale) @ (b[K, N] * b_scale)`` in bf16 from FP8 operands: the cuBLASLt
    call ``torch._scaled_mm`` makes on sm_90 with cuBLASLt 12.9+, planned once. torch asks the
    heuristic on every call (tens of us of host time each); the plan asks once, with torch's
    descriptors (the transposed problem: cuBLAS's A is ``b``, its B is ``a``, the scales swapped;
    compute and scale type fp32; ``FAST_ACCUM``; per-tensor scalars or outer vectors), preference
    (its workspace cap, default alignment) and one result, so the algorithm and the bits are
    torch's (``tests/test_gpu_fp8.py`` compares them). ``a`` row-major, ``b`` column-major (a
    transposed row-major [N, K]), ``d`` row-major; a call passes the five addresses and the stream.
    Scales: ``a_rows`` -- ``a_scale`` is [M, 1] (else a scalar), ``b_cols`` -- ``b_scale`` [1, N]."""

    __slots__ = ("lib", "handle", "desc", "layouts", "algo", "ws_bytes", "scalars", "device", "_keep", "shape",
                 "_lock")

    def __init__(self, lib: _Lib, device: torch.device, index: int, a_dtype, b_dtype, M: int, N: int, K: int,
                 a_rows: bool, b_cols: bool, fast_accum: bool):
        self.lib, self.device, self.shape = lib, device, (M, N, K)
        self.desc, self.layouts = None, []
        self.handle = lib.handle(index)
        vp = ctypes.c_void_p
        desc = vp()
        _check(lib.desc_create(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
        self.desc = desc.value

        def put(attr, value, name):
            _check(lib.desc_set(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), name)

        put(_DESC_TRANSA, ctypes.c_int32(_OP_T), "TRANSA")
        put(_DESC_TRANSB, ctypes.c_int32(_OP_N), "TRANSB")
        put(_DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0), "FAST_ACCUM")
        put(_DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F if b_cols else _SCALE_SCALAR_32F), "A_SCALE_MODE")
        put(_DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F if a_rows else _SCALE_SCALAR_32F), "B_SCALE_MODE")
        # cuBLAS's A: b as the column-major [K, N] (ld K), op T; its B: a as [K, M] (ld K); C = D: [N, M] (ld N)
        for dt, rows, cols, ld in ((_FP8_DTYPES[b_dtype], K, N, K), (_FP8_DTYPES[a_dtype], K, M, K),
                                   (_CUDA_R_16BF, N, M, N)):
            lay = vp()
            _check(lib.layout_create(ctypes.byref(lay), dt, rows, cols, ld), "cublasLtMatrixLayoutCreate")
            self.layouts.append(lay.value)
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.scalars = (ctypes.addressof(alpha), ctypes.addressof(beta))
        self.ws_bytes = _torch_lt_workspace_bytes()
        # the heuristic refuses outer-vector scale modes without scale pointers (status 7, cuBLASLt 13.1): a
        # stand-in's, as large as either vector, until a call sets the call's
        stand_in = torch.empty(max(M, N, 4), dtype=torch.float32, device=device)
        for attr in (_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER):
            put(attr, ctypes.c_void_p(stand_in.data_ptr()), "SCALE_POINTER")
        algo, _ = _first_algorithm(lib, self.handle, self.desc, self.layouts, self.ws_bytes, what="scaled matmul")
        self.algo = ctypes.addressof(algo)
        self._keep = (algo, alpha, beta)
        self._lock = threading.Lock()  # the scale pointers are the descriptor's: one call at a time

    __del__ = LtMatmul.__del__

    def __call__(self, a_ptr: int, b_ptr: int, d_ptr: int, a_scale_ptr: int, b_scale_ptr: int, stream: int,
                 capture: Optional[bool] = None) -> bool:
        """Queue the product; False (nothing queued) where an address is not aligned as the algorithm
        assumes (the caller takes ``torch._scaled_mm``)."""
        if (a_ptr | b_ptr | d_ptr) & (_ALIGN_DEFAULT - 1):
            return False
        lib = self.lib
        ws = _device.workspace("cublaslt", self.device, stream, self.ws_bytes, capture) if self.ws_bytes else None
        alpha, beta = self.scalars
        A_l, B_l, d_l = self.layouts  # cuBLAS's A (b's layout), B (a's), C = D
        with self._lock:
            sa, sb = ctypes.c_void_p(b_scale_ptr), ctypes.c_void_p(a_scale_ptr)  # (the problem is transposed)
            _check(lib.desc_set(self.desc, _DESC_A_SCALE_POINTER, ctypes.byref(sa), 8), "A_SCALE_POINTER")
            _check(lib.desc_set(self.desc, _DESC_B_SCALE_POINTER, ctypes.byref(sb), 8), "B_SCALE_POINTER")
            status = lib.matmul(self.handle, self.desc, alpha, b_ptr, A_l, a_ptr, B_l, beta, d_ptr, d_l, d_ptr, d_l,
                                self.algo, None if ws is None else ws.data_ptr(), self.ws_bytes, stream)
        if status != 0:
            raise LtError(f"cublasLtMatmul (FP8) failed with cuBLAS status {status} (shape {self.shape})")
        return True


@functools.cache  # (one library object: asked once)
def _lt_version(lib: _Lib) -> int:
    try:
        f = lib.cdll.cublasLtGetVersion
    except AttributeError:
        return 0
    f.argtypes, f.restype = [], ctypes.c_size_t
    return int(f())


def plan_scaled_matmul(device: torch.device, a_dtype, b_dtype, M: int, N: int, K: int, a_rows: bool, b_cols: bool,
                       fast_accum: bool, cfg) -> Optional[LtScaledMatmul]:
    """A planned :class:`LtScaledMatmul`, or None where ``torch._scaled_mm`` serves: ``cfg.cublaslt``
    off, no library, not sm_90 (elsewhere torch's own choice of kernel differs: Ada's rowwise runs
    CUTLASS, Blackwell's its own recipes), cuBLASLt older than 12.9 with a per-row or per-column
    scale (torch then runs CUTLASS too), an empty problem, or no algorithm."""
    if not cfg.cublaslt or device.type != "cuda" or min(M, N, K) == 0:
        return None
    if a_dtype not in _FP8_DTYPES or b_dtype not in _FP8_DTYPES:
        return None
    if _device.capability(device) != (9, 0):
        return None
    lib = library()
    version = 0 if lib is None else _lt_version(lib)
    if version < (120900 if a_rows or b_cols else 120800):
        return None
    try:
        return LtScaledMatmul(lib, device, _device.device_index(device), a_dtype, b_dtype, M, N, K, a_rows, b_cols,
                              fast_accum)
    except (LtError, OSError):
        return None
