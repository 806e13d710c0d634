"""The one owner of fusedqkv's device state: per device, its SM count and capability; per
(device, stream), the buffers calls on that stream share; and the registry of plan caches.

Buffers kept per stream (calls on one stream never overlap on the GPU, so they may share):

* ``tickets``: zeroed int32 counters of the kernels that elect a last program (each such kernel
  leaves them zero again, so they are reused without a memset);
* ``dqkv``: the 091 backward's dQKV workspace where it is small (its host time shows there);
* ``cublaslt``: the workspace of the planned cuBLASLt GEMMs.

**CUDA graphs.** While the current stream is being captured nothing is kept: each call takes its
buffers from the caching allocator (the graph's private pool) and drops them when it returns,
so no fusedqkv allocation outlives a captured call's outputs (``torch.compile(mode=
"reduce-overhead")`` checks exactly that), and a replay never depends on a buffer that a later
``clear()`` or a regrown buffer could free. Tickets taken during capture are zeroed by a
captured memset. Outside a capture, a kept buffer is created by a short-lived thread of our
own: cudagraph trees route every allocation of the warming-up thread (or stream) into the
graph's pool without capturing, and a kept buffer created there would stay live in that pool;
from another thread it comes from the ordinary pool, and ``record_stream`` ties its reuse after
``clear()`` to the work queued on the stream that used it.

``clear()`` drops every kept buffer and every plan (``fusedqkv.clear_caches()``); ``info()``
says what is kept (``fusedqkv.cache_info()``). Plans that cached a view of a kept buffer compare
``generation`` before using it.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Optional

import torch

from . import internals

# the largest 091 dQKV kept per stream between calls (larger ones are allocated per call)
DQKV_KEPT_BYTES = 32 << 20
_TICKETS_MIN = 1024  # tickets are grown in steps of at least this many

generation = 0  # bumped by clear(): cached views of kept buffers are stale after it
_buffers: dict = {}  # (kind, device index, stream) -> tensor
_plan_caches: dict = {}  # name -> PlanCache
_handles: dict = {}  # (library, device index) -> handle


# ------------------------------------------------------------------------------ the device


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@internals.assume_constant_result  # traced (fp8's checks): a constant, not a call into a traced cache
def capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device; (0, 0) for the CPU."""
    return _capability(device_index(device)) if device.type == "cuda" else (0, 0)


def sm90_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (Hopper on): what TMA descriptors,
    programmatic dependent launch and the 16-bit pair arithmetic of the exact stage need.
    Older GPUs take the per-thread loads, fp32 math with a cast (the same roundings) and cuBLAS."""
    return device.type == "cuda" and capability(device) >= (9, 0)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter)."""
    return _sm_count(device_index(device)) if device.type == "cuda" else 4


@functools.cache
def _max_shared(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024


def max_shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on a CUDA device (opt-in maximum; unbounded for the CPU
    interpreter)."""
    return _max_shared(device_index(device)) if device.type == "cuda" else 1 << 40


_CUDA_INDEX: dict = {}  # device -> cuda_index(device), where it does not depend on the current device


def cuda_index(device: torch.device) -> int:
    """``device_index(device)`` for a CUDA device, -1 for any other (remembered per device: a
    torch.device's ``type`` costs a string per call)."""
    i = _CUDA_INDEX.get(device)
    if i is None:
        if device.type != "cuda":
            i = -1
        elif device.index is None:  # the current device, which may change
            return torch.cuda.current_device()
        else:
            i = device.index
        _CUDA_INDEX[device] = i
    return i


def current_stream(device: torch.device) -> int:
    """The raw handle of the current stream (0 for the CPU)."""
    i = cuda_index(device)
    return internals.raw_stream(i) if i >= 0 else 0


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return cuda_index(device) >= 0 and torch.cuda.is_current_stream_capturing()


def call_state(device: torch.device) -> tuple:
    """``(current_stream(device), capturing(device))`` at once: a plan asks once per call (its kept
    buffers and cuBLASLt calls take the answer as ``capture``)."""
    i = cuda_index(device)
    if i < 0:
        return 0, False
    return internals.raw_stream(i), torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------ per-stream buffers


def _outside_graph_pools(device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` run on a thread of our own (see the module's docstring), its work complete, the
    result's reuse tied to the calling thread's current stream."""
    if device.type != "cuda":
        return make()
    box: dict = {}

    def allocate():
        try:
            with torch.cuda.device(device):
                box["t"] = make()
                torch.cuda.current_stream().synchronize()  # the zero fill, before any use elsewhere
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["e"] = e

    thread = threading.Thread(target=allocate, name="fusedqkv-allocate")
    thread.start()
    thread.join()
    if "e" in box:
        raise box["e"]
    t = box["t"]
    t.record_stream(torch.cuda.current_stream(device))
    return t



def tickets(device: torch.device, stream: int, n: int, capture: Optional[bool] = None) -> torch.Tensor:
    """At least ``n`` zeroed int32 tickets for kernels on ``stream`` (kept per stream; fresh per
    call while capturing). ``capture``: whether the stream is being captured, where the caller
    asked already this call (None: asked here)."""
    if capturing(device) if capture is None else capture:
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    key = ("tickets", cuda_index(device), stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        size = max(n, _TICKETS_MIN)
        buf = _buffers[key] = _outside_graph_pools(device, lambda: torch.zeros(size, dtype=torch.int32, device=device))
    return buf


def workspace(kind: str, device: torch.device, stream: int, nbytes: int,
              capture: Optional[bool] = None) -> torch.Tensor:
    """A byte buffer of at least ``nbytes`` for work on ``stream``: the stream's kept buffer of this
    ``kind`` (grown to the largest asked for), or while the stream is being captured a fresh one
    that the caller holds for the call (and does not remember). ``capture``: as :func:`tickets`."""
    if capturing(device) if capture is None else capture:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = (kind, cuda_index(device), stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = _buffers[key] = _outside_graph_pools(device, lambda: torch.empty(nbytes, dtype=torch.uint8, device=device))
    return buf


def handle(library: str, index: int, create: Callable[[], int]) -> int:
    """A library handle (cuBLASLt's) per device, created once."""
    h = _handles.get((library, index))
    if h is None:
        h = _handles[(library, index)] = create()
    return h


# ------------------------------------------------------------------------------ plan caches


def register_plan_cache(name: str, cache) -> None:
    """Plan caches register here, so that ``clear()`` and ``info()`` see every one."""
    _plan_caches[name] = cache


# ------------------------------------------------------------------------------ clear and info


def clear() -> None:
    """Drop every kept buffer and every plan. (Library handles stay: they hold no device memory
    worth giving back, and creating them again costs a synchronising call.)"""
    global generation
    generation += 1
    _buffers.clear()
    for cache in _plan_caches.values():
        cache.clear()


def info() -> dict:
    """What fusedqkv keeps: plans per cache, kept buffers (kind, device, stream, bytes), their
    total, library handles, and the state of the fast launch path."""
    buffers = [dict(kind=kind, device=index, stream=stream, bytes=buf.numel() * buf.element_size())
               for (kind, index, stream), buf in _buffers.items()]
    return dict(
        plans={name: cache.info() for name, cache in _plan_caches.items()},
        buffers=buffers,
        bytes=sum(b["bytes"] for b in buffers),
        handles=sorted(f"{lib}:{index}" for lib, index in _handles),
        fast_path=internals.fast_path_info(),
    )
