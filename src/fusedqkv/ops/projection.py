"""Launchers of the projection-gradient kernels (:mod:`fusedqkv.kernels.projection_grads`).

At few tokens what decides the official time (first kernel start to last kernel end) is how
soon the host queues each launch after the stage -- ``torch.mm`` costs the host ~15 us, a
bound Triton launch (:class:`~fusedqkv.ops.launch.BoundLaunch`) a few -- and the products are bound by memory: dX
streams the weight in, dW streams its result out. So:

* to 128 tokens, where dX's tiles spread evenly over the SMs, the *PDL chain*
  (``chain_launches``): two persistent TMA kernels queued right behind the stage as
  programmatic dependent launches, dX and dW side by side on the GPU;
* otherwise to 2560 tokens, the *hybrid* (``hybrid_dw_launch``): dW as the chain's kernel (as fast
  as cuBLAS's there) and dX on cuBLAS, one after the other: dX first to 1024 tokens, else dW first;
* above, both products on cuBLAS (``torch.mm``).

(benchmarks/NOTES.md, sessions 4, 6 and 29.)
"""

from __future__ import annotations

import math

import torch

from .config import INTERPRET, Config
from .device import capability, current_stream
from .launch import BoundLaunch, Desc, Ptr, Table, next_pow2 as _next_pow2

try:  # Triton is a dependency on Linux only
    from ..kernels.projection_grads import tma_matmul_kernel
except ImportError:  # pragma: no cover
    tma_matmul_kernel = None


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D operand TMA can address: unit column stride, 16-byte aligned base and row stride."""
    es = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0
            and t.stride(0) >= t.shape[1])


def tma_matmul(a: Ptr, b: Ptr, c: Ptr, *, trans_a: bool, config: tuple, sms: int, pdl: bool = False,
               trigger: bool = False, wait_at_end: bool = False, finish=None) -> BoundLaunch:
    """c = a . b (``trans_a``: c = a^T . b) with ``tma_matmul_kernel`` over table slots.
    ``config`` = (tile rows, cols, K step, warps, pipeline stages, persistent programs per SM).
    Operands ``_tma_ready``. ``pdl``/``trigger``/``wait_at_end``: as the kernel's
    ``PDL``/``TRIGGER``/``WAIT_AT_END``. ``finish``: a ``rope_qk_norm.NormWeightFinish`` the
    kernel runs as well (``FINISH``)."""
    br, bc, bk, num_warps, num_stages, per_sm = config
    R, C = c.like.shape
    K = a.like.shape[0] if trans_a else a.like.shape[1]
    n_tiles = -(-R // br) * -(-C // bc)
    nprog = max(1, min(per_sm * sms, n_tiles))
    pdl = pdl and not INTERPRET
    if finish is not None:
        fin = (finish.part, finish.n_rows, finish.gwq, finish.gwq.like.stride(0), finish.gwk,
               finish.gwk.like.stride(0))
        fin_d, fin_rows = finish.d, finish.rows
    else:  # placeholders the kernel never reads
        fin, fin_d, fin_rows = (c, 0, c, 1, c, 1), 1, 1
    return BoundLaunch(
        tma_matmul_kernel, (nprog,),
        (Desc(a, [bk, br] if trans_a else [br, bk]), Desc(b, [bk, bc]), Desc(c, [br, bc]), R, C, K, *fin),
        dict(BR=br, BC=bc, BK=bk, TRANS_A=trans_a, NPROG=nprog, PDL=pdl, TRIGGER=trigger and pdl,
             WAIT_AT_END=wait_at_end, FINISH=finish is not None, FIN_D=fin_d, FIN_D_P2=_next_pow2(fin_d),
             FIN_ROWS=fin_rows,
             num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl),
    )


def tma_matmul_on(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, **kw):
    """:func:`tma_matmul` on these tensors, as a callable that queues it (benchmarks)."""
    table = Table()
    launch = tma_matmul(table.add("a", a), table.add("b", b), table.add("c", c), **kw)
    table.release()
    tensors, ptrs = [a, b, c], [a.data_ptr(), b.data_ptr(), c.data_ptr()]

    def enqueue():
        launch.launch(tensors, ptrs if launch.bound else None, current_stream(a.device))
    return enqueue


def chain_configs(M: int, cfg: Config) -> tuple[tuple, tuple]:
    """The chain's dX and dW configurations at M tokens: to 128 tokens two rows of dX tiles
    cover the tokens; above, every tile gets a program of its own."""
    return (cfg.chain_dx, cfg.chain_dw) if M <= 128 else (cfg.chain_dx_above_128, cfg.chain_dw_above_128)


def chain_balance(M: int, HIDDEN: int, sms: int, cfg: Config) -> float:
    """How evenly dX's tiles spread over the SMs: 1.0 when no SM gets more than one, or every SM
    as many. (At 131 tokens three rows of tiles put two tiles on some SMs and one on others, and
    dX takes twice as long: benchmarks/NOTES.md.)"""
    br, bc = chain_configs(M, cfg)[0][:2]
    per_sm = -(-M // br) * -(-HIDDEN // bc) / sms
    return 1.0 if per_sm <= 1 else per_sm / math.ceil(per_sm)


def products_target(device: torch.device) -> bool:
    """A GPU the Triton products are built for: Hopper (sm_90) and datacenter Blackwell (sm_100,
    sm_103), which have TMA, programmatic dependent launch and ~227 KB of shared memory per block.
    Consumer Blackwell (sm_120: ~99 KB) and everything older keep cuBLAS."""
    return capability(device)[0] in (9, 10)


def triton_products_allowed(M: int, max_tokens: int, dtype: torch.dtype, device: torch.device, operands,
                            cfg: Config) -> bool:
    """Few enough tokens, a 16-bit dtype, a :func:`products_target` GPU (or the interpreter when
    the config asks), operands TMA can address."""
    return (0 < M <= max_tokens and dtype in (torch.bfloat16, torch.float16)
            and ((device.type == "cuda" and products_target(device))
                 or (INTERPRET and cfg.triton_products_in_interpreter))
            and all(_tma_ready(t) for t in operands))


def choose_products(M: int, dtype: torch.dtype, device: torch.device, sms: int, dqkv, w, x2d, dx, dw,
                    cfg: Config) -> str:
    """Where the two products run: ``"chain"`` (both as Triton launches chained behind the stage:
    few tokens, dX tiles spread evenly), ``"hybrid"`` (dW in Triton, dX on cuBLAS) or
    ``"cublas"``. ``x2d`` None: hidden_states has no [tokens, hidden] view (cuBLAS reads a copy)."""
    if x2d is None:
        return "cublas"
    if (dx.dim() == 2 and triton_products_allowed(M, cfg.chain_max_tokens, dtype, device, (dqkv, w, x2d, dx, dw), cfg)
            and chain_balance(M, dx.shape[1], sms, cfg) >= cfg.chain_min_balance):
        return "chain"
    if triton_products_allowed(M, cfg.hybrid_max_tokens, dtype, device, (dqkv, x2d, dw), cfg):
        return "hybrid"
    return "cublas"


def chain_launches(dqkv: Ptr, w: Ptr, x2d: Ptr, dx: Ptr, dw: Ptr, sms: int, cfg: Config, finish=None):
    """The two products as launches to queue right behind the stage that writes ``dqkv``:
    dX = dqkv . w waits for the stage (programmatic dependent launch: its programs start while
    the stage drains) and at once lets dW = dqkv^T . x2d launch, which then runs beside it --
    dX streams the weight in, dW streams its result out -- and waits for dX only at its end, so
    the stream's next work still follows both. ``finish``: the stage's norm-weight finish, run
    by dW (which starts after the stage completed)."""
    cx, cw = chain_configs(dqkv.like.shape[0], cfg)
    return (tma_matmul(dqkv, w, dx, trans_a=False, config=cx, sms=sms, pdl=True, trigger=True),
            tma_matmul(dqkv, x2d, dw, trans_a=True, config=cw, sms=sms, pdl=True, wait_at_end=True, finish=finish))


def hybrid_dx_first(M: int, cfg: Config) -> bool:
    """Whether the hybrid queues its cuBLAS dX before its Triton dW (:func:`hybrid_dw_launch`)."""
    return M <= cfg.hybrid_dx_first_max_tokens


def hybrid_dw_launch(dqkv: Ptr, x2d: Ptr, dw: Ptr, sms: int, cfg: Config, finish=None):
    """dW = dqkv^T . x2d as a programmatic dependent of the kernel queued just before it, which it
    waits for first; it also runs the stage's norm-weight ``finish``. Where :func:`hybrid_dx_first`
    the caller queues it behind the cuBLAS dX (cuBLAS's kernels do not let a dependent start early:
    it starts as dX ends), else right behind the stage with the cuBLAS dX behind it. (Waiting at
    its start, not its end, it relies on nothing about when cuBLAS's kernels let dependents launch.)"""
    return tma_matmul(dqkv, x2d, dw, trans_a=True, config=cfg.hybrid_dw, sms=sms, pdl=True, finish=finish)
