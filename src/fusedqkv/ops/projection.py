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
"""

from __future__ import annotations

import math
import os

import torch

from .launch import _INTERPRET, kernel

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
