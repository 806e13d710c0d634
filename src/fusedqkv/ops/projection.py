"""Launchers of the projection-gradient kernels (:mod:`fusedqkv.kernels.projection_grads`).

At few tokens what decides the official time (first kernel start to last kernel end) is how
soon the host queues each launch after the stage -- ``torch.mm`` costs the host ~15 us, a
Triton launch through :class:`FastLaunch` a few -- and the products are bound by memory: dX
streams the weight in, dW streams its result out. So:

* to 256 tokens, where dX's tiles spread evenly over the SMs, the *PDL chain*
  (``chain_launches``): two persistent TMA kernels queued right behind the stage as
  programmatic dependent launches, dX and dW side by side on the GPU;
* otherwise to 600 tokens, the *hybrid* (``hybrid_dw_launch``): dW as the chain's kernel right
  behind the stage, the cuBLAS dX queued by the host while it runs;
* above, both products on cuBLAS (``torch.mm``).

(benchmarks/NOTES.md, session 4.)

``dw_triton``/``dx_triton`` (pointer-based tiles, off by default) are the earlier attempt,
kept because the single launch shares their tile functions.
"""

from __future__ import annotations

import math
import os

import torch

from .launch import _INTERPRET, FastLaunch, kernel

# Largest token count whose dW runs in Triton (0: never). FUSEDQKV_TRITON_DW_MAX_TOKENS overrides.
DW_MAX_TOKENS = int(os.environ.get("FUSEDQKV_TRITON_DW_MAX_TOKENS", "0"))
# dW tiles: [DW_BJ rows of dW, DW_BN columns], DW_BK tokens per step
DW_BJ, DW_BN, DW_BK, DW_WARPS, DW_STAGES = 128, 128, 64, 8, 3
# Largest token count whose dX also runs in Triton (0: never). FUSEDQKV_TRITON_DX_MAX_TOKENS overrides.
DX_MAX_TOKENS = int(os.environ.get("FUSEDQKV_TRITON_DX_MAX_TOKENS", "0"))
# dX tiles [DX_BM tokens, DX_BN columns], DX_BK of NQKV per step, split along NQKV into about
# DX_PROGRAMS_PER_SM programs per SM (at most DX_MAX_SPLIT splits)
DX_BM, DX_BN, DX_BK, DX_WARPS, DX_STAGES, DX_PROGRAMS_PER_SM, DX_MAX_SPLIT = 64, 128, 64, 4, 4, 2, 16

def _kernel(name: str) -> FastLaunch:
    return kernel("projection_grads", name)

def dw_triton_eligible(M: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Few tokens, a 16-bit activation dtype (the tensor-core operands), a CUDA device (or the
    interpreter)."""
    return (0 < M <= DW_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)
            and (device.type == "cuda" or _INTERPRET))

def dx_triton_eligible(M: int, dtype: torch.dtype, device: torch.device) -> bool:
    return (0 < M <= DX_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)
            and (device.type == "cuda" or _INTERPRET))

def dx_plan(M: int, NQKV: int, HIDDEN: int, sms: int) -> tuple[int, int]:
    """(splits, NQKV columns per split) of the Triton dX: enough programs for every SM."""
    tiles = -(-M // DX_BM) * -(-HIDDEN // DX_BN)
    split = max(1, min(DX_MAX_SPLIT, -(-DX_PROGRAMS_PER_SM * sms // tiles)))
    k_per_split = -(-NQKV // (split * DX_BK)) * DX_BK
    return -(-NQKV // k_per_split), k_per_split

def dx_triton(dqkv: torch.Tensor, w: torch.Tensor, dx: torch.Tensor, xpart: torch.Tensor, tick: torch.Tensor,
              split: int, k_per_split: int, deferred: bool = False):
    """dx = dqkv . w (``dqkv`` [M, NQKV] with unit column stride, ``w`` [NQKV, HIDDEN], ``dx``
    [M, HIDDEN], any strides), split along NQKV as ``dx_plan`` says: ``xpart`` holds the
    fp32 partials [split, M, HIDDEN], ``tick`` one zeroed int32 ticket per output tile (left
    zero again). The splits are summed in a fixed order (deterministic). ``deferred``: return
    the enqueue as a callable instead."""
    M, NQKV = dqkv.shape
    HIDDEN = w.shape[1]
    tiles = -(-M // DX_BM) * -(-HIDDEN // DX_BN)
    launch = _kernel("dx_kernel").prepared((tiles * split,))(
        dqkv, dqkv.stride(0), w, w.stride(0), w.stride(1), dx, dx.stride(0), dx.stride(1), xpart, tick,
        M, NQKV, HIDDEN, k_per_split, BM=DX_BM, BN=DX_BN, BK=DX_BK, SPLIT=split, STAGES=DX_STAGES,
        num_warps=DX_WARPS,
    )
    return launch if deferred else launch()

def dw_triton(dqkv: torch.Tensor, x2d: torch.Tensor, dw: torch.Tensor, deferred: bool = False):
    """dw = dqkv^T . x2d (``dqkv`` [M, NQKV] with unit column stride, ``x2d`` [M, HIDDEN],
    ``dw`` [NQKV, HIDDEN], any strides), fp32 accumulation, one rounding. ``deferred``:
    return the enqueue as a callable instead."""
    M, NQKV = dqkv.shape
    HIDDEN = x2d.shape[1]
    n_tiles = -(-NQKV // DW_BJ) * -(-HIDDEN // DW_BN)
    launch = _kernel("dw_kernel").prepared((n_tiles,))(
        dqkv, dqkv.stride(0), x2d, x2d.stride(0), x2d.stride(1), dw, dw.stride(0), dw.stride(1), M, NQKV, HIDDEN,
        BJ=DW_BJ, BN=DW_BN, BK=DW_BK, STAGES=DW_STAGES, num_warps=DW_WARPS,
    )
    return launch if deferred else launch()

def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can address: unit column stride, 16-byte aligned base and row stride."""
    es = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0
            and t.stride(0) >= t.shape[1])

def tma_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, trans_a: bool, block: tuple[int, int, int],
               num_warps: int, num_stages: int, programs: int, pdl: bool = False, trigger: bool = False,
               wait_at_end: bool = False, deferred: bool = False):
    """c = a . b (``trans_a``: c = a^T . b) with ``tma_matmul_kernel``: ``block`` = (rows, cols,
    K step) of a tile, ``programs`` persistent programs. Operands ``_tma_ready``. ``deferred``:
    return the enqueue as a callable."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    br, bc, bk = block
    R, C = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    n_tiles = -(-R // br) * -(-C // bc)
    nprog = max(1, min(programs, n_tiles))

    def desc(t, blk):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), blk)

    pdl = pdl and not _INTERPRET
    launch = kernel("projection_grads", "tma_matmul_kernel").prepared((nprog,))(
        desc(a, [bk, br] if trans_a else [br, bk]), desc(b, [bk, bc]), desc(c, [br, bc]), R, C, K,
        BR=br, BC=bc, BK=bk, TRANS_A=trans_a, NPROG=nprog, PDL=pdl, TRIGGER=trigger and pdl,
        WAIT_AT_END=wait_at_end, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    return launch if deferred else launch()

# ---------------------------------------------------------------------------------------------
# dX and dW as two persistent TMA launches chained behind the stage (few tokens)
# ---------------------------------------------------------------------------------------------
# Largest token count whose products run as the PDL chain stage -> dX -> dW (0: never).
# FUSEDQKV_CHAIN_MAX_TOKENS overrides.
CHAIN_MAX_TOKENS = int(os.environ.get("FUSEDQKV_CHAIN_MAX_TOKENS", "256"))
# ... and only where dX's tiles spread evenly over the SMs (tiles / SMs over its ceiling):
# at 131 tokens three rows of tiles put two tiles on some SMs and one on others, and dX takes
# twice as long (benchmarks/NOTES.md)
CHAIN_MIN_BALANCE = 0.85
# (tile rows, cols, K step, warps, pipeline stages, programs per SM) of dX and dW -- from the
# H200 sweeps (benchmarks/NOTES.md, "PDL chain"); to 128 tokens, and above (two rows of dX
# tiles no longer cover the tokens: every tile gets a program of its own)
CHAIN_DX = (64, 64, 64, 4, 6, 1)
CHAIN_DW = (128, 128, 64, 8, 2, 1)
CHAIN_DX_ABOVE_128 = (64, 64, 64, 4, 6, 2)
CHAIN_DW_ABOVE_128 = (128, 128, 64, 8, 2, 2)
# Under TRITON_INTERPRET=1 the chain runs only when asked (its GEMMs are slow to emulate;
# the tests turn it on at small sizes)
CHAIN_IN_INTERPRETER = False

def _chain_dx_config(M: int) -> tuple:
    return CHAIN_DX if M <= 128 else CHAIN_DX_ABOVE_128


def chain_balance(M: int, HIDDEN: int, sms: int) -> float:
    """How evenly dX's tiles spread over the SMs: 1.0 when no SM gets more than one, or every SM
    as many."""
    br, bc = _chain_dx_config(M)[:2]
    per_sm = -(-M // br) * -(-HIDDEN // bc) / sms
    return 1.0 if per_sm <= 1 else per_sm / math.ceil(per_sm)


def chain_eligible(M: int, dtype: torch.dtype, device: torch.device, sms: int, dqkv: torch.Tensor, w: torch.Tensor,
                   x2d: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor) -> bool:
    """Few tokens, dX tiles spread evenly, a 16-bit dtype, a CUDA device (or the interpreter
    when asked), operands TMA can address."""
    return (0 < M <= CHAIN_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)
            and (device.type == "cuda" or (_INTERPRET and CHAIN_IN_INTERPRETER))
            and all(_tma_ready(t) for t in (dqkv, w, x2d, dx, dw))
            and chain_balance(M, dx.shape[1], sms) >= CHAIN_MIN_BALANCE)


def chain_launches(dqkv: torch.Tensor, w: torch.Tensor, x2d: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor,
                   sms: int):
    """The two products as enqueue callables, to be queued right behind the stage that writes
    ``dqkv``: dX = dqkv . w waits for the stage (programmatic dependent launch: its programs
    start while the stage drains) and at once lets dW = dqkv^T . x2d launch, which then runs
    beside it -- dX streams the weight in, dW streams its result out -- and waits for dX only
    at its end, so the stream's next work still follows both."""
    cx, cw = _chain_dx_config(dqkv.shape[0]), CHAIN_DW if dqkv.shape[0] <= 128 else CHAIN_DW_ABOVE_128
    launch_dx = tma_matmul(dqkv, w, dx, trans_a=False, block=cx[:3], num_warps=cx[3], num_stages=cx[4],
                           programs=cx[5] * sms, pdl=True, trigger=True, deferred=True)
    launch_dw = tma_matmul(dqkv, x2d, dw, trans_a=True, block=cw[:3], num_warps=cw[3], num_stages=cw[4],
                           programs=cw[5] * sms, pdl=True, wait_at_end=True, deferred=True)
    return launch_dx, launch_dw


# From here to HYBRID_MAX_TOKENS tokens (where the chain does not apply), dW runs as the chain's
# Triton kernel right behind the stage and cuBLAS does dX: the host's torch.mm time is spent
# while dW runs instead of between the stage and the first product (0: never). Measured at
# 131-586 tokens (benchmarks/NOTES.md, "hybrid"): 2-6 us slower than cuBLAS when the host is
# quick, 17-25 us faster when it is not.
# FUSEDQKV_HYBRID_MAX_TOKENS overrides.
HYBRID_MAX_TOKENS = int(os.environ.get("FUSEDQKV_HYBRID_MAX_TOKENS", "600"))
HYBRID_DW = (128, 128, 64, 8, 2, 2)


def hybrid_eligible(M: int, dtype: torch.dtype, device: torch.device, dqkv: torch.Tensor, x2d: torch.Tensor,
                    dw: torch.Tensor) -> bool:
    return (0 < M <= HYBRID_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)
            and (device.type == "cuda" or (_INTERPRET and CHAIN_IN_INTERPRETER))
            and all(_tma_ready(t) for t in (dqkv, x2d, dw)))


def hybrid_dw_launch(dqkv: torch.Tensor, x2d: torch.Tensor, dw: torch.Tensor, sms: int):
    """dW = dqkv^T . x2d as an enqueue callable: a programmatic dependent of the stage queued just
    before it (waits for it on the GPU)."""
    c = HYBRID_DW
    return tma_matmul(dqkv, x2d, dw, trans_a=True, block=c[:3], num_warps=c[3], num_stages=c[4],
                      programs=c[5] * sms, pdl=True, deferred=True)
