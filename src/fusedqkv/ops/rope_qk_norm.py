"""Launcher for the RoPE + QK-norm backward stage, with CPU/GPU dispatch (the forward's
launcher is :mod:`fusedqkv.ops.gqa_forward`).

The backward stage takes the gradients of q/k/v (``[batch, heads, seq, head_dim]``)
and writes dQKV token-major ``[tokens, (Hq + 2*Hkv) * D]`` -- what the projection
GEMMs read -- plus grad_cos/grad_sin and the two norm-weight gradients.

Two backends with one semantics:
* ``"triton"``: the kernels in :mod:`fusedqkv.kernels.rope_qk_norm` (CUDA, or the
  CPU under ``TRITON_INTERPRET=1``, which the tests use);
* ``"torch"``: vectorised PyTorch, the CPU path. In ``exact`` mode it performs each
  operation in the activation dtype, exactly as an eager reference does, so its
  roundings are the reference's; otherwise it computes in fp32 and rounds once.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from .launch import _INTERPRET, FastLaunch, kernel, sm90_or_newer


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _launch_config(M: int, hq: int, hkv: int, d: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(tokens per block, heads per step, num_warps, pipeline stages of the head loop, heads
    per group or 0) for the backward stage; tiles are [heads per step x tokens per block rows,
    D/2] of ~4 elements per thread, one head per step (two or more heads per step cost a
    cross-warp sum per token: slower on every workload measured).

    Many tokens (3+ blocks of 8 per SM): a program takes every query and key head of an
    8-token block, and grad_cos/sin need no partials. Fewer: programs take one group of 16
    heads of 8 tokens, or from 1k tokens down 8 heads of 4 tokens ("grouped"), so that there
    are enough of them; the last group of a block to finish sums the groups' partials.
    Measured on the H200: benchmarks/NOTES.md, v9c.
    """
    sms = sm_count(device)
    if -(-M // 8) >= 3 * sms:
        return 8, 1, _warps_for(8, d, 4), PREFETCH, 0
    if M > 1024:
        return 8, 1, _warps_for(8, d, 4), PREFETCH, 16
    return 4, 1, _warps_for(4, d, 4), PREFETCH, 8


# Register cap of the stage kernel with 4 warps: four programs per SM. The 16-bit math took
# a 4-token x 2-head tile to 151 registers (3 per SM) and 2048 tokens from 36.5 to 51.8 us;
# capped, ptxas fits it in 128 without spills (sm_90, offline). (The 2-warp tile spills under
# the cap and runs uncapped, six programs per SM.)
MAX_REGISTERS = 128
# ... and for the head groups of 8-token blocks (1k-3k tokens): 96 (no spills, sm_90 offline)
# lets five programs share an SM instead of four, which pays there (2048 tokens 33.6/32.2 ->
# 30.1/30.6 us) but not for every head of a block (8192 tokens 94 -> 102 us): v10c.
MAX_REGISTERS_GROUPED_8 = 96


def _warps_for(block_t: int, d: int, per_thread: int = 2) -> int:
    # the per-element working set of the exact-mode math is ~20-30 fp32 registers, so more
    # than ~4 tile elements per thread spill on sm_90
    return max(1, min(16, block_t * _next_pow2(d // 2) // (32 * per_thread)))


def pick_backend(device: torch.device, backend: Optional[str]) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend: expected 'triton', 'torch' or None, got {backend!r}")
    return backend


def _rstd3(r: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """rstd as [B, H, S] (drops a trailing keepdim axis of size 1)."""
    return r[..., 0] if r is not None and r.dim() == 4 else r


# --------------------------------------------------------------------------- backward


def rope_qk_norm_backward(
    grad_q, grad_k, grad_v, saved_q, saved_k, rstd_q, rstd_k, q_norm_weight, k_norm_weight, cos, sin,
    *, dqkv, grad_cos=None, grad_sin=None, grad_q_norm_weight, grad_k_norm_weight,
    exact: bool, norm_after_rope: bool = True, saved_rotated: bool = True, backend: Optional[str] = None,
    scratch: Optional[torch.Tensor] = None, eps: Optional[float] = None, deferred: bool = False,
    finish_outside: bool = False,
):
    """Backward of RoPE + per-head RMSNorm for q and k, plus the V copy, into ``dqkv``.

    Arguments are already validated. ``saved_q``/``saved_k`` are the rotated pre-norm
    tensors (``saved_rotated=True``, SOL-ExecBench 091) or the raw projection outputs.
    ``grad_cos``/``grad_sin`` may be None to skip them. Outputs are written in place.

    ``rstd_q``/``rstd_k`` may be None: the stage then recomputes rstd = 1/sqrt(mean(n^2) + eps)
    from the saved tensor (``eps`` required), as the forward did.

    ``scratch``: optionally a tensor the caller will overwrite only after this stage (the
    dX GEMM's output): its memory holds the fp32 partials when it is large enough, so the
    stage allocates nothing extra.

    Returns a callable that completes the norm-weight gradients: on the GPU a second,
    small launch that reduces the per-program partials, which the caller may queue
    behind other work (the projection GEMMs) so its launch latency is hidden.

    ``deferred``: launch nothing yet; return ``(launch, finish)``, ``launch`` a callable that
    queues the stage with all its host work already done (the torch backend computes
    at once and returns no-ops).

    ``finish_outside``: the stage's kernel leaves the norm-weight gradients' last reduction
    (a chain of dependent L2 round trips at its end, 3-4 us at few tokens) to ``finish``, a
    :class:`NormWeightFinish` that a later kernel of the caller's may run (the Triton dW
    product does, on a program with a tile less) or that launches it when called.
    """
    grad_cos_sin = grad_cos is not None
    if (rstd_q is None) != (rstd_k is None) or (rstd_q is None and eps is None):
        raise ValueError("rstd_q/rstd_k: give both, or neither together with eps (then rstd is recomputed)")
    if pick_backend(grad_q.device, backend) == "torch":
        _backward_torch(grad_q, grad_k, grad_v, saved_q, saved_k, _rstd3(rstd_q), _rstd3(rstd_k),
                        q_norm_weight, k_norm_weight, cos, sin, dqkv, grad_cos, grad_sin,
                        grad_q_norm_weight, grad_k_norm_weight, exact, norm_after_rope, saved_rotated, eps)
        return (_done, _done) if deferred else _done
    launch, finish = _backward_triton(grad_q, grad_k, grad_v, saved_q, saved_k, rstd_q, rstd_k,
                                      q_norm_weight, k_norm_weight, cos, sin, dqkv, grad_cos, grad_sin,
                                      grad_q_norm_weight, grad_k_norm_weight, exact, norm_after_rope, saved_rotated,
                                      grad_cos_sin, scratch, eps, finish_outside)
    if deferred:
        return launch, finish
    launch()
    return finish


def _done():
    return None


def _kernel(name: str) -> FastLaunch:
    return kernel("rope_qk_norm", name)


# pipeline stages of the stage kernel's head loop (heads whose tiles are in flight, plus
# the one computed); the stage is bound by memory latency (benchmarks/NOTES.md, v7)
PREFETCH = 3

# Feed the stage's q/k tiles through TMA (host descriptors, one thread per tile copy) where
# the tensors allow it (benchmarks/NOTES.md, v10); else per-thread loads.
STAGE_TMA = os.environ.get("FUSEDQKV_STAGE_TMA", "1") != "0"


def _tma_4d(t: torch.Tensor, half: int) -> bool:
    """A [B, H, S, D] tensor a TMA descriptor can address in [1, 1, rows, D/2] boxes."""
    es = t.element_size()
    if not (_INTERPRET or (t.is_cuda and sm90_or_newer(t.device))):
        return False
    return (t.stride(3) == 1 and t.data_ptr() % 16 == 0 and half & (half - 1) == 0 and half * es >= 16
            and all((st * es) % 16 == 0 for st in t.stride()[:3]))


def _stage_descriptors(block_t: int, half: int, *tensors):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_t, half]) for t in tensors]


# Finish the norm-weight gradients inside the main kernel (True: the last programs to finish
# reduce the per-program partials, in two levels) or in a second launch after the GEMMs.
FUSED_FINISH = True
# programs per first-level reduction of the fused finish (the second level sums the super
# rows, _SUPER at a time)
_SUPER = 32

_tickets: dict = {}


def ticket_buffer(device: torch.device, n: int, slot: str = "stage") -> torch.Tensor:
    """At least ``n`` zeroed int32 tickets per (device, stream, slot). Every kernel that takes
    tickets leaves them zero again, so the buffer is reused without a memset, and kernels
    on one stream (which never overlap) may share a slot."""
    # the raw stream handle: no Stream object built on the hot path
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0, slot)
    buf = _tickets.get(key)
    if buf is None or buf.numel() < n:
        buf = _tickets[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _partials(scratch, shapes, device):
    """fp32 partial buffers of the given shapes: carved out of ``scratch`` when it is big
    enough, else one new allocation."""
    numels = [math.prod(shape) for shape in shapes]
    sizes = [-(-n // 4) * 4 for n in numels]  # keep each buffer 16-byte aligned
    total = sum(sizes)
    if (scratch is not None and scratch.is_contiguous() and scratch.data_ptr() % 16 == 0
            and scratch.numel() * scratch.element_size() >= 4 * total):
        flat = scratch.view(-1).view(torch.uint8)[: 4 * total].view(torch.float32)
    else:
        flat = torch.empty(total, device=device, dtype=torch.float32)
    out, off = [], 0
    for shape, numel, size in zip(shapes, numels, sizes):
        out.append(flat[off: off + numel].view(shape))
        off += size
    return out


def stage_tensor_args(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, w_part, w_sup, tick,
                      cs_part=None, w_grp=None):
    """The stage kernels' tensor arguments, each followed by its strides, in parameter order
    (``rope_qk_norm_bwd_kernel`` and the single-launch kernel share them). ``rq`` None
    (rstd recomputed): a placeholder with zero strides that the kernel never reads."""
    if rq is None:
        rq = rk = w_part
        rq_strides = rk_strides = (0, 0, 0)
    else:
        rq_strides, rk_strides = rq.stride()[:3], rk.stride()[:3]
    return (
        gq, *gq.stride(), gk, *gk.stride(), gv, *gv.stride(),
        xq, *xq.stride(), xk, *xk.stride(),
        rq, *rq_strides, rk, *rk_strides,
        wq, wq.stride(0), wk, wk.stride(0),
        cos, *cos.stride(), sin, *sin.stride(),
        dqkv, dqkv.stride(0),
        gcos, *gcos.stride(), gsin, *gsin.stride(),
        gwq, gwq.stride(0), gwk, gwk.stride(0), w_part, w_sup, tick,
        w_part if cs_part is None else cs_part, w_part if w_grp is None else w_grp,
    )


class NormWeightFinish:
    """The last step of the norm-weight gradients: fp32 rows ``part`` [n_rows, 2 (query, key), D],
    one per stage program, summed in a fixed order into ``gwq``/``gwk``. Called, it launches
    ``rope_qk_norm_bwd_finish_kernel``; a Triton kernel of the caller's may instead run
    ``_finish_norm_weight`` on these fields (after the stage has completed)."""

    def __init__(self, part: torch.Tensor, n_rows: int, gwq: torch.Tensor, gwk: torch.Tensor, d: int):
        self.part, self.n_rows, self.gwq, self.gwk, self.d = part, n_rows, gwq, gwk, d

    def __call__(self):
        _kernel("rope_qk_norm_bwd_finish_kernel")[(1,)](
            self.part, self.n_rows, self.gwq, self.gwq.stride(0), self.gwk, self.gwk.stride(0), D=self.d,
            D_P2=_next_pow2(self.d), BLOCK_R=32, num_warps=4,
        )


def _backward_triton(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                     exact, norm_after_rope, saved_rotated, grad_cos_sin, scratch=None, eps=None,
                     finish_outside=False):
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    M = B * S
    if M == 0:
        gwq.zero_()
        gwk.zero_()
        return _done, _done
    block_t, hb, num_warps, prefetch, gsize = _launch_config(M, HQ, HKV, D, gq.device)
    grouped = gsize > 0
    nqg, nkg = (-(-HQ // gsize), -(-HKV // gsize)) if grouped else (1, 1)
    # (the 4-token tiles of few tokens measured no faster through TMA: v10)
    tma = STAGE_TMA and block_t >= 8 and hb == 1 and all(_tma_4d(t, D // 2) for t in (gq, xq, gk, xk))
    # TMA: blocks of one sequence each (a box never spans two)
    n_prog = B * -(-S // block_t) if tma else -(-M // block_t)
    n_sup = -(-n_prog // _SUPER)
    fused = FUSED_FINISH and not finish_outside
    # every allocation before the first launch. The fused finish consumes the partials inside
    # the kernel, so the dX output (written by the GEMM after it) can hold them; the separate
    # finish kernel runs after the GEMMs and needs memory of its own. (The grouped mode's
    # grad_cos/sin partials and group rows are always consumed inside the kernel.)
    shapes = [(n_prog, 2, D), (n_sup, 2, D)]
    if grouped:
        shapes += [(nqg + nkg, 2, M, D) if grad_cos_sin else (1,), (n_prog, nqg + nkg, D)]
    parts = _partials(scratch if fused else None, shapes, gq.device)
    w_part, w_sup = parts[:2]
    cs_part, w_grp = parts[2:] if grouped else (None, None)
    n_tick = (n_prog if grouped else 0) + (n_sup + 1 if fused else 0)
    tick = ticket_buffer(gq.device, n_tick) if n_tick else w_part
    if not grad_cos_sin:
        gcos = gsin = cos  # never written: the kernels are compiled without those stores
    recompute = rq is None
    # EXACT mode reproduces separately rounded eager ops: no mul+add contraction into FMA
    fp_fusion = not exact
    launch = _kernel("rope_qk_norm_bwd_kernel").prepared((n_prog, nqg + nkg + 1 if grouped else 2))(
        *stage_tensor_args(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                           w_part, w_sup, tick, cs_part, w_grp),
        M, S, HQ, HKV, float(eps) if recompute else 0.0,
        *(_stage_descriptors(block_t, D // 2, gq, xq, gk, xk) if tma else (gq, gq, gq, gq)),
        D=D, HALF=D // 2, HALF_P2=_next_pow2(D // 2), D_P2=_next_pow2(D), BLOCK_T=block_t, HB=hb,
        EXACT=exact, NORM_AFTER_ROPE=norm_after_rope, SAVED_ROTATED=saved_rotated,
        GRAD_COS_SIN=grad_cos_sin, FUSED_FINISH=fused, SUPER=_SUPER, RECOMPUTE_RSTD=recompute,
        PF=prefetch, GROUPED=grouped, NQG=nqg, NKG=nkg, GSIZE=max(gsize, 1), TMA=tma,
        LP2=sm90_or_newer(gq.device),
        num_warps=num_warps, enable_fp_fusion=fp_fusion,
        **({"maxnreg": MAX_REGISTERS_GROUPED_8 if grouped and block_t == 8 else MAX_REGISTERS}
           if num_warps == 4 and gq.is_cuda else {}),
    )
    if fused:
        return launch, _done
    return launch, NormWeightFinish(w_part, n_prog, gwq, gwk, D)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def _rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _rope_transpose(g, cos, sin, exact):
    """dL/dx of y = x*cos + rotate_half(x)*sin. ``exact``: 091's reference formula
    g*cos + cat(g2, -g1)*sin, equal to the true transpose only when sin's halves agree."""
    h = g.shape[-1] // 2
    if exact:
        return g * cos + torch.cat((g[..., h:], -g[..., :h]), dim=-1) * sin
    return g * cos + torch.cat((g[..., h:] * sin[..., h:], -g[..., :h] * sin[..., :h]), dim=-1)


def _rms_norm_backward_torch(g, x, w, r, out_dtype, eps=None):
    """Same operation order as the eager reference; all fp32, one rounding at the end.
    ``r`` None: recomputed from x (as the forward computes it)."""
    g = g.float()
    x = x.float()
    w = w.float()
    r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) if r is None else r.float().unsqueeze(-1)
    grad_w = (g * (x * r)).sum(dim=(0, 1, 2))
    direct = g * w * r
    grad_rstd = (g * w * x).sum(dim=-1, keepdim=True)
    dx = direct + grad_rstd * (-r.pow(3) * x / x.shape[-1])
    return dx.to(out_dtype), grad_w


def _backward_torch(gq, gk, gv, xq, xk, rq, rk, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk,
                    exact, norm_after_rope, saved_rotated, eps=None):
    B, HQ, S, D = gq.shape
    HKV = gk.shape[1]
    # exact: every op in the activation dtype rounds its result, as the eager reference;
    # otherwise fp32 throughout
    lp = gq.dtype if exact else torch.float32
    c = cos.unsqueeze(1).to(lp)
    s = sin.unsqueeze(1).to(lp)

    def head_set(g, x, r, w):
        g = g.to(lp)
        x = x.to(lp)
        if norm_after_rope:
            o = _rope(x, c, s)
            n, p = (x, o) if saved_rotated else (o, x)
            gn, grad_w = _rms_norm_backward_torch(g, n, w, r, lp, eps)
            dx = _rope_transpose(gn, c, s, exact)
            q = gn
        else:
            gn = _rope_transpose(g, c, s, exact)
            if r is None:
                r = torch.rsqrt(x.float().pow(2).mean(dim=-1) + eps)
            dx, grad_w = _rms_norm_backward_torch(gn, x, w, r, lp)
            p = (x.float() * r.float().unsqueeze(-1) * w.float()).to(lp)
            q = g
        gc = (q * p).sum(dim=1) if gcos is not None else None
        gs = (q * _rotate_half(p)).sum(dim=1) if gcos is not None else None
        return dx, gc, gs, grad_w

    dxq, gcq, gsq, gwq32 = head_set(gq, xq, rq, wq)
    dxk, gck, gsk, gwk32 = head_set(gk, xk, rk, wk)
    view = dqkv.view(B, S, dqkv.shape[1])
    view[..., : HQ * D].view(B, S, HQ, D).copy_(dxq.transpose(1, 2))
    view[..., HQ * D: (HQ + HKV) * D].view(B, S, HKV, D).copy_(dxk.transpose(1, 2))
    view[..., (HQ + HKV) * D:].view(B, S, HKV, D).copy_(gv.transpose(1, 2))
    if gcos is not None:
        gcos.copy_(gcq + gck)
        gsin.copy_(gsq + gsk)
    gwq.copy_(gwq32)
    gwk.copy_(gwk32)
