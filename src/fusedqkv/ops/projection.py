"""Launchers of the projection-gradient kernels (:mod:`fusedqkv.kernels.projection_grads`).

At few tokens what decides the official time (first kernel start to last kernel end) is how
soon the host queues each launch after the stage -- ``torch.mm`` costs the host ~15 us, a
Triton launch through :class:`FastLaunch` a few -- and the products are bound by memory: dX
streams the weight in, dW streams its result out. So:

* to 128 tokens, where dX's tiles spread evenly over the SMs, the *PDL chain*
  (``chain_launches``): two persistent TMA kernels queued right behind the stage as
  programmatic dependent launches, dX and dW side by side on the GPU;
* otherwise to 2560 tokens, the *hybrid* (``hybrid_dw_launch``): dW as the chain's kernel right
  behind the stage (as fast as cuBLAS's there), the cuBLAS dX queued by the host while it runs;
* above, both products on cuBLAS (``torch.mm``).

(benchmarks/NOTES.md, sessions 4 and 6.)
"""

from __future__ import annotations

import math
import os

import torch

from .launch import _INTERPRET, kernel, sm90_or_newer
from .rope_qk_norm import _next_pow2


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can address: unit column stride, 16-byte aligned base and row stride."""
    es = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0
            and t.stride(0) >= t.shape[1])


def tma_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, trans_a: bool, config: tuple, sms: int,
               pdl: bool = False, trigger: bool = False, wait_at_end: bool = False, finish=None):
    """The enqueue (a callable; all host work done now) of c = a . b (``trans_a``: c = a^T . b)
    with ``tma_matmul_kernel``. ``config`` = (tile rows, cols, K step, warps, pipeline stages,
    persistent programs per SM). Operands ``_tma_ready``. ``pdl``/``trigger``/``wait_at_end``:
    as the kernel's ``PDL``/``TRIGGER``/``WAIT_AT_END``. ``finish``: a
    ``rope_qk_norm.NormWeightFinish`` the kernel runs as well (``FINISH``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    br, bc, bk, num_warps, num_stages, per_sm = config
    R, C = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    n_tiles = -(-R // br) * -(-C // bc)
    nprog = max(1, min(per_sm * sms, n_tiles))

    def desc(t, blk):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), blk)

    pdl = pdl and not _INTERPRET
    if finish is not None:
        fin = (finish.part, finish.n_rows, finish.gwq, finish.gwq.stride(0), finish.gwk, finish.gwk.stride(0))
        fin_d = finish.d
    else:  # placeholders the kernel never reads
        fin, fin_d = (c, 0, c, 1, c, 1), 1
    return kernel("projection_grads", "tma_matmul_kernel").prepared((nprog,))(
        desc(a, [bk, br] if trans_a else [br, bk]), desc(b, [bk, bc]), desc(c, [br, bc]), R, C, K, *fin,
        BR=br, BC=bc, BK=bk, TRANS_A=trans_a, NPROG=nprog, PDL=pdl, TRIGGER=trigger and pdl,
        WAIT_AT_END=wait_at_end, FINISH=finish is not None, FIN_D=fin_d, FIN_D_P2=_next_pow2(fin_d),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )


# ---------------------------------------------------------------------------------------------
# dX and dW as two persistent TMA launches chained behind the stage (few tokens)
# ---------------------------------------------------------------------------------------------
# Largest token count whose products run as the PDL chain stage -> dX -> dW (0: never). Above
# 128 tokens the hybrid (below) is faster since its dW got cuBLAS-fast (256 tokens: 67.1 vs 68.7
# us without host gaps; session 6 in NOTES). FUSEDQKV_CHAIN_MAX_TOKENS overrides.
CHAIN_MAX_TOKENS = int(os.environ.get("FUSEDQKV_CHAIN_MAX_TOKENS", "128"))
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
# (one warpgroup per 128 x 128 tile, 32-token K steps four deep: 59.0 vs 62.7 us for the pair at 256
# tokens; session 6 in NOTES)
CHAIN_DW_ABOVE_128 = (128, 128, 32, 4, 4, 2)
# Under TRITON_INTERPRET=1 the chain runs only when asked (its GEMMs are slow to emulate;
# the tests turn it on at small sizes)
CHAIN_IN_INTERPRETER = False


def _chain_configs(M: int) -> tuple[tuple, tuple]:
    """The dX and dW configurations of the chain at M tokens."""
    return (CHAIN_DX, CHAIN_DW) if M <= 128 else (CHAIN_DX_ABOVE_128, CHAIN_DW_ABOVE_128)


def chain_balance(M: int, HIDDEN: int, sms: int) -> float:
    """How evenly dX's tiles spread over the SMs: 1.0 when no SM gets more than one, or every SM
    as many."""
    br, bc = _chain_configs(M)[0][:2]
    per_sm = -(-M // br) * -(-HIDDEN // bc) / sms
    return 1.0 if per_sm <= 1 else per_sm / math.ceil(per_sm)


def _triton_products_allowed(M: int, max_tokens: int, dtype: torch.dtype, device: torch.device,
                             operands) -> bool:
    return (0 < M <= max_tokens and dtype in (torch.bfloat16, torch.float16)
            and ((device.type == "cuda" and sm90_or_newer(device)) or (_INTERPRET and CHAIN_IN_INTERPRETER))
            and all(_tma_ready(t) for t in operands))


def chain_eligible(M: int, dtype: torch.dtype, device: torch.device, sms: int, dqkv: torch.Tensor, w: torch.Tensor,
                   x2d: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor) -> bool:
    """Few tokens, dX tiles spread evenly, a 16-bit dtype, a CUDA device (or the interpreter
    when asked), operands TMA can address."""
    return (_triton_products_allowed(M, CHAIN_MAX_TOKENS, dtype, device, (dqkv, w, x2d, dx, dw))
            and chain_balance(M, dx.shape[1], sms) >= CHAIN_MIN_BALANCE)


def chain_launches(dqkv: torch.Tensor, w: torch.Tensor, x2d: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor,
                   sms: int, finish=None):
    """The two products as enqueue callables, to be queued right behind the stage that writes
    ``dqkv``: dX = dqkv . w waits for the stage (programmatic dependent launch: its programs
    start while the stage drains) and at once lets dW = dqkv^T . x2d launch, which then runs
    beside it -- dX streams the weight in, dW streams its result out -- and waits for dX only
    at its end, so the stream's next work still follows both. ``finish``: the stage's
    norm-weight finish, run by dW (which starts after the stage completed)."""
    cx, cw = _chain_configs(dqkv.shape[0])
    return (tma_matmul(dqkv, w, dx, trans_a=False, config=cx, sms=sms, pdl=True, trigger=True),
            tma_matmul(dqkv, x2d, dw, trans_a=True, config=cw, sms=sms, pdl=True, wait_at_end=True, finish=finish))


# The stage's norm-weight finish runs inside the Triton dW launch (chain and hybrid) rather than
# at the stage's end, which then comes 3-4 us sooner (benchmarks/NOTES.md, v10b).
# FUSEDQKV_NORM_FINISH_IN_DW=0 keeps it in the stage.
NORM_FINISH_IN_DW = os.environ.get("FUSEDQKV_NORM_FINISH_IN_DW", "1") != "0"

# From here to HYBRID_MAX_TOKENS tokens (where the chain does not apply), dW runs as the chain's
# Triton kernel right behind the stage and cuBLAS does dX: the host's torch.mm time is spent
# while dW runs instead of between the stage and the first product, cuBLAS's dW (a memset, then
# its kernel ~3 us later) is replaced by one as fast, and the stage leaves its norm-weight
# finish to dW (0: never). Measured on the H200 without host gaps (session 6 in NOTES): 131
# tokens 56.5 vs 67.9 us (the previous dW tile), 586 108.3 vs 122.1, 1571 242.1 vs 248.0
# (cuBLAS both), 2164 319.2 vs 324.1; but 4096 588.4 vs 579.7 (Triton's dW 274 vs cuBLAS 260;
# dW alone, the Triton tile falls behind cuBLAS's by more than the memset and finish it saves
# from ~3k tokens).
# FUSEDQKV_HYBRID_MAX_TOKENS overrides.
HYBRID_MAX_TOKENS = int(os.environ.get("FUSEDQKV_HYBRID_MAX_TOKENS", "2560"))
# one warpgroup per 128 x 128 tile, 32-token K steps five deep, two programs per SM: as fast as
# cuBLAS's dW from 128 to 2048 tokens on the H200 (512 tokens: 43.3 vs 45.1 us; the 8-warp,
# 64-token-step tile took 55.1); session 6 in NOTES
HYBRID_DW = (128, 128, 32, 4, 5, 2)


def hybrid_eligible(M: int, dtype: torch.dtype, device: torch.device, dqkv: torch.Tensor, x2d: torch.Tensor,
                    dw: torch.Tensor) -> bool:
    return _triton_products_allowed(M, HYBRID_MAX_TOKENS, dtype, device, (dqkv, x2d, dw))


def hybrid_dw_launch(dqkv: torch.Tensor, x2d: torch.Tensor, dw: torch.Tensor, sms: int, finish=None):
    """dW = dqkv^T . x2d as an enqueue callable: a programmatic dependent of the stage queued just
    before it (waits for it on the GPU); it also runs the stage's norm-weight ``finish``."""
    return tma_matmul(dqkv, x2d, dw, trans_a=True, config=HYBRID_DW, sms=sms, pdl=True, finish=finish)
