"""The block's variant switches (issue 25) and the tensor helpers both stages' launchers and torch
backends share (the forward's and the backward's: neither imports the other's module, so the
exported 091 solution ships no training forward)."""

from __future__ import annotations

import dataclasses

import torch

from .launch import next_pow2 as _next_pow2

ROPE_STYLES = ("neox", "interleaved")
NORM_SCOPES = ("head", "all_heads")


@dataclasses.dataclass(frozen=True)
class Variant:
    """The block's variant switches (issue 25); all off (``PLAIN``) is the plain block: per-head
    weighted RMSNorm, NeoX RoPE over the whole head, no gate, v a view.

    ``rot``: rotary dims per head (even), 0 for all of head_dim (partial rotary otherwise: the
    trailing ``head_dim - rot`` dims pass RoPE unrotated, the norm covers all of them);
    ``interleaved``: RoPE pairs ``(2i, 2i+1)`` instead of ``(i, i + rot/2)``; ``q_gate``: the Q
    rows of the projection are per head ``[q | gate]``; ``norm_weight``: the q/k norms scale by
    a weight; ``all_heads``: the q (k) norm is over all heads of a token; ``v_norm``: v is
    RMS-normed per head without a weight; ``k_eq_v``: v is the raw k projection (Gemma 4's global
    layers): the projection has no V rows, the stages read v from the K columns, and the backward
    adds v's gradient to k's before the GEMMs."""

    rot: int = 0
    interleaved: bool = False
    q_gate: bool = False
    norm_weight: bool = True
    all_heads: bool = False
    v_norm: bool = False
    k_eq_v: bool = False

    def rotary(self, d: int) -> int:
        return self.rot or d

    @property
    def qk_variant(self) -> bool:
        """Whether the query/key heads take the stages' variant path (partial or interleaved RoPE,
        unweighted norms, a gate) rather than the plain one."""
        return bool(self.rot or self.interleaved or not self.norm_weight or self.q_gate)

    def qkv_heads(self, hq: int, hkv: int) -> int:
        """Head-sized column blocks of the projection output: query (and gate), key, value (none with
        ``k_eq_v``)."""
        return (2 * hq if self.q_gate else hq) + (1 if self.k_eq_v else 2) * hkv

    def constexprs(self, d: int) -> dict:
        """The kernels' constexprs of the variant (both stages; ``all_heads`` picks a kernel or a
        branch: see :meth:`head_tiles`)."""
        half = self.rotary(d) // 2
        n_pass = d - 2 * half
        return dict(HALF=half, HALF_P2=_next_pow2(half), PASS=n_pass, PASS_P2=_next_pow2(n_pass),
                    INTERLEAVED=self.interleaved, NORM_WEIGHT=self.norm_weight, Q_GATE=self.q_gate,
                    V_NORM=self.v_norm)

    def head_tiles(self, hq: int, hkv: int) -> dict:
        """HQ_P2/HKV_P2: the head counts padded to a power of two, the tile of a program that holds
        every head of a token (``all_heads``; 0 otherwise, so the other variants compile once for
        all head counts)."""
        if not self.all_heads:
            return dict(HQ_P2=0, HKV_P2=0)
        return dict(HQ_P2=_next_pow2(hq), HKV_P2=_next_pow2(hkv))


PLAIN = Variant()


def all_heads_warps(hq: int, hkv: int, half: int, per_thread: int) -> int:
    """Warps of a program that holds every head of a token (``all_heads``, both stages):
    ``per_thread`` elements of its [heads, pairs] tiles per thread."""
    return max(1, min(16, _next_pow2(max(hq, hkv)) * _next_pow2(half) // (32 * per_thread)))


def rotate(t: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    """The rotation partner of every element of the leading ``rot`` dims (``rotate_half`` within
    them, or ``rotate_pairs``), zero for the dims past them: RoPE is ``x*cos + rotate(x)*sin``
    with cos 1 and sin 0 there. ``rotate`` is antisymmetric: its transpose is ``-rotate``."""
    r = t[..., :rot]
    if interleaved:
        out = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    else:
        h = rot // 2
        out = torch.cat((-r[..., h:], r[..., :h]), dim=-1)
    if rot < t.shape[-1]:
        out = torch.cat((out, torch.zeros_like(t[..., rot:])), dim=-1)
    return out


def pad_rotary(c: torch.Tensor, d: int, fill: float) -> torch.Tensor:
    """cos/sin ``[.., rot]`` widened to ``[.., d]`` with ``fill`` (cos 1, sin 0: the pass-through dims)."""
    rot = c.shape[-1]
    if rot == d:
        return c
    return torch.cat((c, torch.full((*c.shape[:-1], d - rot), fill, dtype=c.dtype, device=c.device)), dim=-1)


def heads_of(qkv: torch.Tensor, hq: int, hkv: int, d: int, q_gate: bool, k_eq_v: bool = False):
    """Views ``[B, H, S, D]`` of the query, key, value (and gate, or None) heads of a projection
    output ``[B, S, n]`` (``k_eq_v``: no value columns, v is k)."""
    B, S, _ = qkv.shape
    nq = 2 * hq if q_gate else hq
    heads = qkv.view(B, S, nq + (1 if k_eq_v else 2) * hkv, d)  # sizes, not -1: zero tokens are valid
    if q_gate:
        xq, gate = heads[:, :, 0:nq:2], heads[:, :, 1:nq:2]
    else:
        xq, gate = heads[:, :, :hq], None
    xk = heads[:, :, nq: nq + hkv]
    xv = xk if k_eq_v else heads[:, :, nq + hkv:]
    t = lambda x: None if x is None else x.transpose(1, 2)  # noqa: E731
    return t(xq), t(xk), t(xv), t(gate)
