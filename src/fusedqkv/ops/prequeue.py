"""Queue the projection GEMMs before the stage kernel, behind a device-side flag.

At a few hundred tokens the stage kernel runs ~15 us while issuing a cuBLAS GEMM takes the
host ~25 us: issued one after another, the GPU waits for the host between the stage and
each GEMM (and the official timer, first kernel start to last kernel end, counts it).
Here the host issues the two GEMMs first, on a side stream that waits -- on the GPU, with
``cuStreamWaitValue32`` -- until the stage kernel's last program has stored this call's
value into a flag; then it launches the stage on the caller's stream, and makes the
caller's stream wait for the side stream. The GEMMs start the moment their input is
complete, whatever the host is doing.

``cuStreamWaitValue32`` comes from the CUDA driver (ctypes). Where it is missing or
fails, :func:`available` is False and the caller issues the launches in order.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

# FUSEDQKV_PREQUEUE=0 turns it off
ENABLED = os.environ.get("FUSEDQKV_PREQUEUE", "1") != "0"

_CU_STREAM_WAIT_VALUE_EQ = 0x1
_wait_value32 = None
_state: dict = {}


def _driver_fn():
    global _wait_value32
    if _wait_value32 is None:
        _wait_value32 = False
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                    _wait_value32 = fn
                    break
        except OSError:
            pass
    return _wait_value32


def available(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and bool(_driver_fn())


class _DeviceState:
    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.value = 0
        self.inputs_ready = torch.cuda.Event()
        self.side_done = torch.cuda.Event()


def run(device: torch.device, launch_after: Callable[[], None], launch_first: Callable[[tuple], None]) -> None:
    """``launch_after()`` issues GPU work (on the current stream) that must wait for the
    kernel started by ``launch_first(signal)``, which stores ``signal[1]`` into ``signal[0]``
    when its outputs are complete."""
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    st = _state.get(key)
    if st is None:
        st = _state[key] = _DeviceState(device)
    main = torch.cuda.current_stream(device)
    st.value = st.value % 0x7FFFFFFF + 1
    st.inputs_ready.record(main)
    st.side.wait_event(st.inputs_ready)
    rc = _wait_value32(ctypes.c_void_p(st.side.cuda_stream), st.flag.data_ptr(), st.value, _CU_STREAM_WAIT_VALUE_EQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")
    with torch.cuda.stream(st.side):
        launch_after()
    st.side_done.record(st.side)
    try:
        launch_first((st.flag, st.value))
    except BaseException:
        st.flag.fill_(st.value)  # release the side stream before giving up
        main.wait_event(st.side_done)
        raise
    main.wait_event(st.side_done)
