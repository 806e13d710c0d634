"""The LoRA GEMMs of the fused block, accumulated in place (issue 34): the adapters' update goes
into the projection output and their share of dX into the dX buffer, with no residual tensor of
their own and no sum of two dX parts.

For pairs ``i`` (a projection's adapter: A_i ``[r_i, hidden]``, B_i ``[rows_i, r_i]``, scaling
``s_i``, rows ``[row_i, row_i + rows_i)`` of the fused output), the shared pairs (identity dropout:
their input is x) first, then one per live dropout (input ``xd_i``, PEFT's own mask):

* forward: ``U = [x A_shared^T | xd_i A_i^T ...]`` (one GEMM for the shared pairs, A_shared the
  concatenated A), then per pair ``qkv[:, rows_i] += s_i U_i B_i^T`` in place (beta = 1, on the
  column block of qkv: cuBLAS takes its leading dimension, no copy);
* backward, from dQKV: ``dU_i = s_i dQKV[:, rows_i] B_i`` into the column block of dU;
  ``dB_i = s_i dQKV[:, rows_i]^T U_i``; ``dA_shared = dU_shared^T x`` (split per pair: views);
  ``dA_i = dU_i^T xd_i``; ``dX += dU_shared A_shared`` in place; ``dxd_i = dU_i A_i``.

Where it pays (:meth:`LoRAUpdate.block_pays`), the per-pair products become one each over the
block-diagonal ``Bb [n_tot, R]`` (each pair's ``s_i B_i`` at its rows and U's columns, zeros
elsewhere; built in one launch, :func:`block_b`): ``qkv += U Bb^T`` and ``dU = dQKV Bb``. The
one-launch Hopper forward takes ``(U, Bb)`` as more inner columns (:meth:`LoRAUpdate.gemm_operands`).
dB stays per pair (each a contiguous ``[rows_i, r_i]``: autograd would copy a strided view of one
product into the parameter's layout), except for fp32 adapters on CUDA (autocast's): there one fp32
product ``dQKV^T U`` gives every pair's dB as a diagonal block, which the pair's scaling op copies
out (:data:`WIDE_GRAD_PRODUCTS`), and dA_shared is an fp32 product too.

B is used as the parameter it is (no layout per call), each adapter cast to the block's dtype
once per call (the backward reuses the forward's casts or its ``Bb``). Nothing computed from the
adapters' values is kept between calls: a cache keyed by ``_version`` would go stale under fused optimizers
(``torch._fused_adamw_``, the HF Trainer's default, updates parameters without bumping their
version); only which parameters, in which layout (:class:`LoRALayout`), may be.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import config as _config
from .device import current_stream
from .launch import BoundLaunch, Table, next_pow2

Tensor = torch.Tensor

# The block path's rule (LoRAUpdate.block_pays). A product over the whole block-diagonal B does
# 2 m (n_tot R - sum_i rows_i r_i) flops more than the pairs' own products (the zeros); each launch it
# saves is a small cuBLAS GEMM, ~3-4 us in a CUDA graph at <= 2048 tokens. The block path is taken
# where the waste is at most this many flops per saved launch: ~1.4 us at ~700 TFLOP/s, under half a
# launch (the products are memory-bound at these ranks, so the waste is an upper bound on their cost).
# r=16 on q/k/v (R=48), 6144 rows: 2048 tokens waste 1.6 GFLOP over the forward's and dU's products
# for 3 saved launches (block path); 8192 tokens 6.4 GFLOP (per-pair path).
BLOCK_FLOPS_PER_SAVED_LAUNCH = 1e9
# Up to this U width R the products over the block are memory-bound wherever they run (about R flops
# per byte of qkv/dQKV against a ridge of ~200 on the H200): they move the pairs' bytes, so the zeros cost
# nothing and the block is taken wherever it saves a launch. Measured at R=48, 8192 tokens, where the flop
# rule above kept the pairs: fwd+bwd over the floor 1.056 (block) vs 1.061 (pairs) at 091, 1.183 vs 1.209 at
# the Qwen3-0.6B shape (NOTES, session 23).
BLOCK_MEMORY_BOUND_RANK = 64
# fp32 adapters under autocast (16-bit products): dA and every pair's dB as fp32 products, dB from one product
# over all pairs (its diagonal blocks), not per pair in 16 bits then cast -- fewer ops a layer on a host-bound
# QLoRA step, and one rounding (fp32) instead of two (NOTES, session 24). False: the per-pair path.
WIDE_GRAD_PRODUCTS = True


def _into(out: Tensor, a: Tensor, b: Tensor, alpha: float) -> None:
    """``out = alpha * a @ b`` (out a strided block of a larger matrix)."""
    torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


# the dtypes the builder kernel reads and writes (its product is fp32: a wider B takes the torch ops)
_BUILDER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_M = 64
_BUILDS: dict = {}  # geometry -> [(BoundLaunch, pair indices)]: the builder's launches, no tensors
_MAX_BUILDS = 256


def block_b(pairs: list, cols: list, n_tot: int, rank: int, dtype: torch.dtype, backend: str = "torch") -> Tensor:
    """The block-diagonal ``[n_tot, rank]`` of ``pairs`` ``[(row, rows, A, B, scaling, shared)]``:
    pair i's ``scaling * B`` (``[rows, r]``) at rows ``[row, row + rows)`` and columns ``[cols[i],
    cols[i] + r)``, formed in fp32 and rounded once to ``dtype``, zeros elsewhere -- bitwise what
    ``torch.zeros`` + ``torch.mul(B, scaling, out=view)`` give. ``backend="triton"``: one launch of
    :func:`fusedqkv.kernels.lora_blocks.lora_block_kernel` per four pairs (bound once per
    geometry); ``"torch"``: those torch ops."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    if len(cols) != len(pairs) or not pairs:
        raise ValueError(f"cols: expected one column per pair ({len(pairs)}), got {len(cols)}")
    for i, ((row, rows, _, B, _, _), c) in enumerate(zip(pairs, cols)):
        if B.dim() != 2 or B.shape[0] != rows or not (0 <= row and row + rows <= n_tot and 0 <= c
                                                      and c + B.shape[1] <= rank):
            raise ValueError(f"pairs[{i}]: B {tuple(B.shape)} at row {row}, column {c} does not fit "
                             f"[{rows}, r] inside the [{n_tot}, {rank}] block")
    device = pairs[0][3].device
    if backend == "torch" or dtype not in _BUILDER_DTYPES or any(p[3].dtype not in _BUILDER_DTYPES for p in pairs):
        out = torch.zeros((n_tot, rank), dtype=dtype, device=device)
        for (row, rows, _, B, s, _), c in zip(pairs, cols):
            torch.mul(B.detach(), s, out=out[row:row + rows, c:c + B.shape[1]])
        return out
    bs = [p[3] for p in pairs]
    # everything the launches are specialised on: the addresses' 16-byte alignment among it
    key = (dtype, device, n_tot, rank, tuple((p[0], p[1], c, float(p[4]), b.dtype, b.stride(), b.data_ptr() % 16 == 0)
                                             for p, c, b in zip(pairs, cols, bs)))
    launches = _BUILDS.get(key)
    if launches is None:
        if len(_BUILDS) >= _MAX_BUILDS:
            _BUILDS.clear()
        launches = _BUILDS[key] = _plan_block(pairs, cols, n_tot, rank, dtype, device)
    out = torch.empty((n_tot, rank), dtype=dtype, device=device)
    stream = current_stream(device)
    for launch, idx in launches:
        if launch.bound:
            launch.launch(None, [out.data_ptr(), *(bs[i].data_ptr() for i in idx)], stream)
        else:
            launch.launch([out, *(bs[i] for i in idx)], None, stream)
    return out


def _plan_block(pairs: list, cols: list, n_tot: int, rank: int, dtype: torch.dtype, device) -> list:
    """The builder's bound launches for one geometry: one per four pairs, the first writing the zeros."""
    from ..kernels.lora_blocks import MAX_PAIRS, lora_block_kernel

    like = torch.empty((0,), dtype=dtype, device=device)
    block_r = min(64, next_pow2(rank))
    grid = (-(-n_tot // _BLOCK_M), -(-rank // block_r))
    launches = []
    for first in range(0, len(pairs), MAX_PAIRS):
        idx = list(range(first, min(first + MAX_PAIRS, len(pairs))))
        table = Table()
        out = table.add("block", like)
        args = [out, n_tot, rank, rank]
        for k in range(MAX_PAIRS):
            if k < len(idx):
                row, rows, _, B, s, _ = pairs[idx[k]]
                args += [table.add(f"b{k}", B), *B.stride(), row, rows, cols[idx[k]], B.shape[1], float(s)]
            else:  # placeholders the kernel never reads (N_PAIRS)
                args += [out, 0, 0, 0, 0, 0, 0, 0.0]
        table.release()
        launches.append((BoundLaunch(lora_block_kernel, grid, args,
                                     dict(N_PAIRS=len(idx), WRITE_ZEROS=first == 0, BLOCK_M=_BLOCK_M,
                                          BLOCK_R=block_r, num_warps=4)), idx))
    return launches


class LoRALayout:
    """What a :class:`LoRAUpdate` needs of its adapters beyond one call's inputs: ``pairs``
    ``[(row, rows, A, B, scaling, shared)]`` (A, B the parameters), the shared ones first, and the
    column of each pair's rank in U. Built once per set of adapters where the caller can tell that
    they did not change (:mod:`fusedqkv.integrations.projection_plan`), else per call."""

    def __init__(self, pairs: list, n_tot: int):
        self.pairs, self.n_tot = pairs, n_tot
        self.n_shared = sum(1 for p in pairs if p[5])
        self.ranks = [p[2].shape[0] for p in pairs]
        self.cols = [sum(self.ranks[:i]) for i in range(len(pairs))]
        self.r_shared = sum(self.ranks[:self.n_shared])
        self.area = sum(p[1] * r for p, r in zip(pairs, self.ranks))  # the pairs' share of the block B
        self.device = pairs[0][2].device
        self.weights = [p[2] for p in pairs] + [p[3] for p in pairs]


class LoRAUpdate:
    """One call's adapters: ``pairs`` ``[(row, rows, A, B, scaling, shared)]`` (A, B the
    parameters: ``[r, hidden]``, ``[rows, r]``), the shared ones first; ``xds`` the inputs of the
    live-dropout pairs, in order; ``n_tot`` the fused rows; ``dtype`` the block's (every GEMM's:
    the adapters are cast to it where autocast runs them in it). :meth:`of_layout` builds one
    from a kept :class:`LoRALayout`."""

    def __init__(self, pairs: list, xds: list, n_tot: int, dtype: torch.dtype):
        self._set(LoRALayout(pairs, n_tot), xds, dtype)

    @classmethod
    def of_layout(cls, layout: LoRALayout, xds: list, dtype: torch.dtype) -> "LoRAUpdate":
        update = cls.__new__(cls)
        update._set(layout, xds, dtype)
        return update

    def _set(self, layout: LoRALayout, xds: list, dtype: torch.dtype) -> None:
        self.layout, self.xds, self.dtype = layout, xds, dtype
        self.pairs, self.n_tot, self.n_shared = layout.pairs, layout.n_tot, layout.n_shared
        self.ranks, self.cols, self.r_shared, self.device = layout.ranks, layout.cols, layout.r_shared, layout.device
        # the forward's casts and block B, kept for the backward (one cast of each adapter per call);
        # ``dense_du``: dU in one product over the block
        self.u = self.a_shared = self.bs = self.a_own = self.block = None
        self.dense_du = False

    @property
    def params(self) -> list:
        """The op's differentiable inputs: every A, every B, then the dropout inputs."""
        return self.layout.weights + list(self.xds)

    def _w(self, t: Tensor) -> Tensor:
        t = t.detach()
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def block_pays(self, m: int, products: int, saved_launches: int) -> bool:
        """Whether ``products`` products over the block B (instead of one per pair) at ``m`` tokens
        pay for their zeros by the ``saved_launches``: always up to :data:`BLOCK_MEMORY_BOUND_RANK`
        columns of U, above by :data:`BLOCK_FLOPS_PER_SAVED_LAUNCH`; ``config.lora_block`` "on"/"off"
        decide instead."""
        mode = _config.current().lora_block
        if mode != "auto":
            return mode == "on"
        if saved_launches <= 0:
            return False
        if self.rank <= BLOCK_MEMORY_BOUND_RANK:
            return True
        waste = 2 * m * (self.n_tot * self.rank - self.layout.area) * products
        return waste <= saved_launches * BLOCK_FLOPS_PER_SAVED_LAUNCH

    def _block(self, backend: Optional[str]) -> Tensor:
        if backend is None:
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.block = block_b(self.pairs, self.cols, self.n_tot, self.rank, self.dtype, backend)
        return self.block

    def forward(self, qkv2d: Tensor, x2d: Tensor, backend: Optional[str] = None) -> None:
        """``qkv2d += U B^T`` in place, over the block B (:meth:`block_pays`) or per pair; keeps U
        (and A_shared, the casts of B or the block) for the backward. ``backend``: the block's
        builder (:func:`block_b`; None: Triton on CUDA)."""
        u = self._u(x2d)
        n = len(self.pairs)
        self.block, self.dense_du = None, False
        # launches per pair: its forward and dU products and, where B is not in the block's dtype, its cast;
        # the block path: the builder's launches (one per four pairs) and one of each product
        casts = sum(p[3].dtype != self.dtype for p in self.pairs)
        if self.block_pays(x2d.shape[0], 2, 2 * n + casts - (-(-n // 4)) - 2):
            qkv2d.addmm_(u, self._block(backend).t())
            self.dense_du = True
            return
        self.bs = [self._w(p[3]) for p in self.pairs]
        for (row, rows, _, _, s, _), b, c, r in zip(self.pairs, self.bs, self.cols, self.ranks):
            qkv2d[:, row:row + rows].addmm_(u[:, c:c + r], b.t(), alpha=s)

    @property
    def rank(self) -> int:
        """U's columns: every pair's rank."""
        return self.cols[-1] + self.ranks[-1]

    def gemm_operands(self, x2d: Tensor, backend: Optional[str] = None) -> tuple:
        """``(U, B)`` of the update as one more stretch of the projection's inner dimension,
        ``qkv = [x | U] [W | B]^T``: U ``[tokens, R]`` as :meth:`forward` computes it, B the block
        (:func:`block_b`: ``[n_tot, R]``, each pair's ``s_i B_i`` at its rows and U's columns and
        zeros elsewhere, ``s_i B_i`` formed in fp32 and rounded once to the block's dtype). Keeps U
        and the block for the backward (dU over the block where :meth:`block_pays`, else per pair
        over its views)."""
        u = self._u(x2d)
        n = len(self.pairs)
        self.dense_du = self.block_pays(x2d.shape[0], 1, n - 1)
        return u, self._block(backend)

    def _u(self, x2d: Tensor) -> Tensor:
        m = x2d.shape[0]
        us = []
        if self.n_shared:
            shared = [p[2].detach() for p in self.pairs[:self.n_shared]]
            # concatenated, then cast once (the same values as cast one by one)
            self.a_shared = self._w(shared[0] if len(shared) == 1 else torch.cat(shared))
            us.append(x2d @ self.a_shared.t())
        self.a_own = [self._w(p[2]) for p in self.pairs[self.n_shared:]]
        for a, xd in zip(self.a_own, self.xds):
            us.append(self._w(xd).reshape(m, -1) @ a.t())
        self.u = u = us[0] if len(us) == 1 else torch.cat(us, 1)
        return u

    def _wide_products(self, dqkv2d: Tensor) -> bool:
        """Whether the backward's dA/dB products can give fp32 from 16-bit operands in one op
        (``torch.mm(..., out_dtype=torch.float32)``: CUDA only; :data:`WIDE_GRAD_PRODUCTS`)."""
        return WIDE_GRAD_PRODUCTS and dqkv2d.is_cuda and self.dtype in (torch.bfloat16, torch.float16)

    def backward(self, dqkv2d: Tensor, g_x2d: Optional[Tensor], x2d: Tensor, needs: list) -> list:
        """Gradients of :attr:`params` (None where ``needs`` says not needed); ``g_x2d += dU_shared
        A_shared`` in place when given."""
        u, n, m, block = self.u, len(self.pairs), dqkv2d.shape[0], self.block
        du = torch.empty((m, u.shape[1]), dtype=self.dtype, device=dqkv2d.device)
        if block is not None and self.dense_du:  # the block holds s_i B_i: no alpha
            torch.mm(dqkv2d, block, out=du)
        elif block is not None:
            for (row, rows, *_), c, r in zip(self.pairs, self.cols, self.ranks):
                _into(du[:, c:c + r], dqkv2d[:, row:row + rows], block[row:row + rows, c:c + r], 1.0)
        else:
            bs = self.bs if self.bs is not None else [self._w(p[3]) for p in self.pairs]
            for (row, rows, _, _, s, _), b, c, r in zip(self.pairs, bs, self.cols, self.ranks):
                _into(du[:, c:c + r], dqkv2d[:, row:row + rows], b, s)
        grads: list = [None] * (2 * n + len(self.xds))
        wide = self._wide_products(dqkv2d)
        if self.n_shared and any(needs[:self.n_shared]):
            a_dtypes = {p[2].dtype for p in self.pairs[:self.n_shared]}
            if wide and a_dtypes == {torch.float32}:  # fp32 adapters: the product's fp32 result, no cast
                da = torch.mm(du[:, :self.r_shared].t(), x2d, out_dtype=torch.float32)
            else:
                da = du[:, :self.r_shared].t() @ x2d
                if len(a_dtypes) == 1:  # one cast for all shared A (their rows are views of it)
                    a_dtype = a_dtypes.pop()
                    da = da if da.dtype == a_dtype else da.to(a_dtype)
        db_all = None
        if (wide and sum(needs[n:2 * n]) > 1 and all(p[3].dtype == torch.float32 for p in self.pairs)
                and self.block_pays(m, 1, sum(needs[n:2 * n]) - 1)):
            # every pair's dB from one product (its diagonal blocks), in fp32: then one scaling op a pair
            # instead of a product and a cast
            db_all = torch.mm(dqkv2d.t(), u, out_dtype=torch.float32)
        for i, ((row, rows, A, B, s, shared), c, r) in enumerate(zip(self.pairs, self.cols, self.ranks)):
            if needs[n + i]:
                if db_all is not None:
                    grads[n + i] = torch.mul(db_all[row:row + rows, c:c + r], s)
                else:
                    db = torch.empty((rows, r), dtype=self.dtype, device=dqkv2d.device)
                    _into(db, dqkv2d[:, row:row + rows].t(), u[:, c:c + r], s)
                    grads[n + i] = db if db.dtype == B.dtype else db.to(B.dtype)
            if needs[i]:
                if shared:
                    g = da[c:c + r]
                else:
                    g = du[:, c:c + r].t() @ self._w(self.xds[i - self.n_shared]).reshape(m, -1)
                grads[i] = g if g.dtype == A.dtype else g.to(A.dtype)
        if g_x2d is not None and self.n_shared:
            g_x2d.addmm_(du[:, :self.r_shared], self.a_shared)
        for j, (a, xd) in enumerate(zip(self.a_own, self.xds)):
            if needs[2 * n + j]:
                c, r = self.cols[self.n_shared + j], self.ranks[self.n_shared + j]
                g = (du[:, c:c + r] @ a).view(xd.shape)
                grads[2 * n + j] = g if g.dtype == xd.dtype else g.to(xd.dtype)
        self.u = self.a_shared = self.bs = self.a_own = self.block = None
        return grads
