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

B is used as the parameter it is (no layout per call), each adapter cast to the block's dtype
once per call (the backward reuses the forward's casts). Nothing computed from the adapters'
values is kept between calls: a cache keyed by ``_version`` would go stale under fused optimizers
(``torch._fused_adamw_``, the HF Trainer's default, updates parameters without bumping their
version); only which parameters, in which layout (:class:`LoRALayout`), may be.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _into(out: Tensor, a: Tensor, b: Tensor, alpha: float) -> None:
    """``out = alpha * a @ b`` (out a strided block of a larger matrix)."""
    torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


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
        # the forward's casts, kept for the backward (one cast of each adapter per call)
        self.u = self.a_shared = self.bs = self.a_own = None

    @property
    def params(self) -> list:
        """The op's differentiable inputs: every A, every B, then the dropout inputs."""
        return self.layout.weights + list(self.xds)

    def _w(self, t: Tensor) -> Tensor:
        t = t.detach()
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def forward(self, qkv2d: Tensor, x2d: Tensor) -> None:
        """``qkv2d += U B^T`` per pair, in place; keeps U (and A_shared) for the backward."""
        u = self._u(x2d)
        self.bs = [self._w(p[3]) for p in self.pairs]
        for (row, rows, _, _, s, _), b, c, r in zip(self.pairs, self.bs, self.cols, self.ranks):
            qkv2d[:, row:row + rows].addmm_(u[:, c:c + r], b.t(), alpha=s)

    @property
    def rank(self) -> int:
        """U's columns: every pair's rank."""
        return self.cols[-1] + self.ranks[-1]

    def gemm_operands(self, x2d: Tensor) -> tuple:
        """``(U, B)`` of the update as one more stretch of the projection's inner dimension,
        ``qkv = [x | U] [W | B]^T``: U ``[tokens, R]`` as :meth:`forward` computes it, B ``[n_tot,
        R]`` with each pair's ``s_i B_i`` at its rows and U's columns and zeros elsewhere (``s_i B_i``
        formed in fp32, rounded once to the block's dtype). Keeps U for the backward."""
        u = self._u(x2d)
        b = torch.zeros((self.n_tot, u.shape[1]), dtype=self.dtype, device=u.device)
        for (row, rows, _, B, s, _), c, r in zip(self.pairs, self.cols, self.ranks):
            torch.mul(B.detach(), s, out=b[row:row + rows, c:c + r])
        return u, b

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

    def backward(self, dqkv2d: Tensor, g_x2d: Optional[Tensor], x2d: Tensor, needs: list) -> list:
        """Gradients of :attr:`params` (None where ``needs`` says not needed); ``g_x2d += dU_shared
        A_shared`` in place when given."""
        u, n, m = self.u, len(self.pairs), dqkv2d.shape[0]
        bs = self.bs if self.bs is not None else [self._w(p[3]) for p in self.pairs]
        du = torch.empty((m, u.shape[1]), dtype=self.dtype, device=dqkv2d.device)
        for (row, rows, _, _, s, _), b, c, r in zip(self.pairs, bs, self.cols, self.ranks):
            _into(du[:, c:c + r], dqkv2d[:, row:row + rows], b, s)
        grads: list = [None] * (2 * n + len(self.xds))
        if self.n_shared and any(needs[:self.n_shared]):
            da = du[:, :self.r_shared].t() @ x2d
            a_dtypes = {p[2].dtype for p in self.pairs[:self.n_shared]}
            if len(a_dtypes) == 1:  # one cast for all shared A (their rows are views of it)
                a_dtype = a_dtypes.pop()
                da = da if da.dtype == a_dtype else da.to(a_dtype)
        for i, ((row, rows, A, B, s, shared), c, r) in enumerate(zip(self.pairs, self.cols, self.ranks)):
            if needs[n + i]:
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
        self.u = self.a_shared = self.bs = self.a_own = None
        return grads
