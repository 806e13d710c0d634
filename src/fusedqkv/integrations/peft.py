"""PEFT LoRA inside the fused block: the adapters of q_proj/k_proj/v_proj computed by the block
(:func:`lora_operands`): accumulated into the fused projection output before RoPE and the norms,
with their gradients from the block's backward (:mod:`fusedqkv.ops.lora`), or as one residual
of that output where the in-place op does not apply (:func:`lora_residual`).

For the projections ``p`` that carry a PEFT ``lora.Linear`` (over :class:`ProjectionRows`) and
each of its active adapters ``a``, PEFT computes ``base(x) + lora_B(lora_A(dropout(x))) * s``.
Here the base is the block's one GEMM on the fused weight and the adapters are

* ``U = x A^T``: one GEMM over the concatenated A of every (p, a) whose dropout is the identity
  (PEFT's default ``lora_dropout=0``, or eval mode), one per (p, a) with a live dropout (each has
  its own mask in PEFT too), in the adapters' dtype as PEFT casts them;
* ``R = U B^T``: one GEMM against B laid out block-wise over the fused rows (``s`` folded in, the
  LoRA biases of ``lora_bias=True`` added), whose rows outside the targeted projections are 0;

and R goes to :func:`fusedqkv.gqa_qkv_rope_qk_norm` as ``qkv_residual`` (its gradient is dQKV,
from which autograd forms dA, dB and the adapters' share of dX). The in-place op
(``qkv_lora``, :class:`fusedqkv.ops.lora.LoRAUpdate`) computes the same GEMMs without R: ``qkv +=
U B^T`` and ``dX += dU A`` in place, B used as it is (no layout per call). It applies to eager
calls whose adapters compute in the block's dtype (the same dtype, or autocast on), without
``lora_bias`` and without Gemma 4's shared K/V; the rest (fp32 adapters beside bf16 activations:
PEFT rounds their update to bf16 before adding it) take the residual. A frozen base weight gets no dW
GEMM. PEFT's state is followed per call: ``active_adapters``, ``disable_adapters``, ``merged``
(the base weight then holds the update), per-module ranks and scalings (``rank_pattern``,
``alpha_pattern``, ``use_rslora``). DoRA and PEFT's other LoRA variants raise
:class:`UnsupportedModuleError`.

PEFT's mixed-batch inference (``model(..., adapter_names=[...])``, ``generate(adapter_names=...)``: one
adapter per sample, ``"__base__"`` for none) reaches the LoRA layers as forward pre-hooks that the block
reads (:class:`MixedBatchLoRA`): each adapter's update of its samples, as the residual.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.lora import LoRALayout, LoRAUpdate
from .fused_projection import UnsupportedModuleError, _describe, _hooks, peft_adapter_names


def _adapters(name: str, lora) -> list:
    """The (adapter, A, B, scaling, dropout) pairs that a PEFT lora.Linear applies now."""
    if lora.disable_adapters:
        if lora.merged:
            lora.unmerge()  # as PEFT's forward does
        return []
    if lora.merged:
        return []
    out = []
    for a in lora.active_adapters:
        if a not in lora.lora_A:
            continue
        A, B, drop = _plain_adapter(name, lora, a)
        out.append((a, A, B, lora.scaling[a], drop))
    return out


def _plain_adapter(name: str, lora, a: str) -> tuple:
    """Adapter ``a``'s ``(A, B, dropout)`` of a PEFT lora.Linear, checked to be plain LoRA that the block
    computes (raises naming DoRA, another LoRA variant, or a module the block would not run)."""
    variant = getattr(lora, "lora_variant", {}).get(a)
    if lora.use_dora.get(a, False) or variant is not None:
        if lora.use_dora.get(a, False):
            what, why = "DoRA (use_dora=True)", "DoRA rescales the whole weight per column"
        else:
            what, why = type(variant).__name__, "this LoRA variant replaces the adapter's forward"
        raise UnsupportedModuleError(
            f"fusedqkv: {name} adapter {a!r} is {what}; the fused block computes plain LoRA only ({why}, "
            f"which the fused GEMMs do not compute)")
    A, B, drop = lora.lora_A[a], lora.lora_B[a], lora.lora_dropout[a]
    _check_adapter_modules(name, a, A, B, drop)
    return A, B, drop


def _check_adapter_modules(name: str, a: str, A, B, drop) -> None:
    """The block computes with A's and B's weights (it never calls the modules) and calls the
    dropout only where it is live: refuse what would then not run -- another module than PEFT's
    ``nn.Linear``, a hook, a replaced ``forward``."""
    for label, mod in (("lora_A", A), ("lora_B", B)):
        if type(mod) is not nn.Linear:
            raise UnsupportedModuleError(
                f"fusedqkv: {name}.{label}[{a!r}] is a {_describe(mod)}; the fused block computes PEFT's LoRA "
                f"with its A and B weights as plain nn.Linear layers, so this module's forward would not run")
    for label, mod in (("lora_A", A), ("lora_B", B), ("lora_dropout", drop)):
        hooked = _hooks(mod)
        if hooked:
            raise UnsupportedModuleError(
                f"fusedqkv: {name}.{label}[{a!r}] has a {hooked[0]} "
                f"({_describe(mod)}); the fused block computes the adapter from its weights, so it would not run")


def _live(dropout: nn.Module) -> bool:
    if isinstance(dropout, nn.Identity):
        return False
    if isinstance(dropout, nn.Dropout):
        return dropout.training and dropout.p > 0
    return True  # another module: apply it as PEFT would


def _pairs(slots: list, rows: tuple) -> list:
    """``[(row start, rows, adapter, A, B, s, dropout)]`` of every active adapter, in q, k, v order
    (one dtype: raises otherwise)."""
    pairs = []
    start = 0
    for (name, _, lora), n in zip(slots, rows):
        if lora is not None:
            for a, A, B, s, drop in _adapters(name, lora):
                pairs.append((start, n, a, A, B, s, drop))
        start += n
    if pairs:
        dt = pairs[0][3].weight.dtype
        if any(p[3].weight.dtype != dt or p[4].weight.dtype != dt for p in pairs):
            raise UnsupportedModuleError(f"fusedqkv: the q/k/v LoRA adapters have different dtypes "
                                         f"({sorted({str(p[3].weight.dtype) for p in pairs})}); one update needs one")
    return pairs


def _block_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    dev = hidden_states.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden_states.dtype


def lora_operands(hidden_states: torch.Tensor, slots: list, rows: tuple, n_tot: int, inplace: bool = True) -> tuple:
    """``(qkv_residual, qkv_lora)`` for :func:`fusedqkv.gqa_qkv_rope_qk_norm`: ``(None, LoRAUpdate)``
    where the in-place op applies (see the module's docstring), ``(residual, None)`` where not,
    ``(None, None)`` when no adapter applies. ``inplace=False``: the residual always."""
    return LoRAOperands(_pairs(slots, rows), n_tot)(hidden_states, inplace)


class LoRAOperands:
    """:func:`lora_operands` for one set of adapter pairs (:func:`_pairs`' result, read from PEFT's
    state): what follows from the pairs alone (their dtype, ``lora_bias``, which dropouts are live,
    the :class:`~fusedqkv.ops.lora.LoRALayout`) decided once; the call decides the rest (the
    block's dtype, autocast, compiling) and runs the live dropouts. Kept by
    :mod:`fusedqkv.integrations.projection_plan` while PEFT's state stays the same."""

    def __init__(self, pairs: list, n_tot: int):
        self.pairs, self.n_tot = pairs, n_tot
        if not pairs:
            return
        self.adapter_dtype = pairs[0][3].weight.dtype
        self.lora_bias = any(p[4].bias is not None for p in pairs)
        shared = [p for p in pairs if not _live(p[6])]
        self.own = [p for p in pairs if _live(p[6])]
        ops = [(p[0], p[1], p[3].weight, p[4].weight, p[5], i < len(shared))
               for i, p in enumerate(shared + self.own)]
        self.layout = LoRALayout(ops, n_tot)

    def __call__(self, hidden_states: torch.Tensor, inplace: bool = True) -> tuple:
        if not self.pairs:
            return None, None
        dt = _block_dtype(hidden_states)
        compute_dt = dt if torch.is_autocast_enabled(hidden_states.device.type) else self.adapter_dtype
        if not inplace or torch.compiler.is_compiling() or compute_dt != dt or self.lora_bias:
            return _residual(hidden_states, self.pairs, self.n_tot), None
        xds = [p[6](hidden_states) for p in self.own]  # PEFT's masks, in its order (q, k, v; adapters)
        return None, LoRAUpdate.of_layout(self.layout, xds, dt)


def lora_residual(hidden_states: torch.Tensor, slots: list, rows: tuple, n_tot: int) -> Optional[torch.Tensor]:
    """The adapters' ``[batch, seq, n_tot]`` update of the fused projection output, or None when
    no adapter applies. ``slots``: :func:`~fusedqkv.integrations.fused_projection.projection_slots`;
    ``rows``: each projection's row count, in the same order."""
    pairs = _pairs(slots, rows)
    return _residual(hidden_states, pairs, n_tot) if pairs else None


def _residual(hidden_states: torch.Tensor, pairs: list, n_tot: int) -> torch.Tensor:
    dt = pairs[0][3].weight.dtype
    x = hidden_states.to(dt)
    shared = [p for p in pairs if not _live(p[6])]
    own = [p for p in pairs if _live(p[6])]
    order = shared + own
    us = []
    if shared:
        a_cat = torch.cat([p[3].weight for p in shared]) if len(shared) > 1 else shared[0][3].weight
        us.append(x @ a_cat.t())
    us.extend(p[6](x) @ p[3].weight.t() for p in own)
    u = torch.cat(us, -1) if len(us) > 1 else us[0]
    ranks = [p[3].weight.shape[0] for p in order]
    b_rows = torch.zeros((n_tot, sum(ranks)), dtype=dt, device=x.device)
    bias = None
    col = 0
    for (row, n, _, _, B, s, _), r in zip(order, ranks):
        b_rows[row:row + n, col:col + r] = B.weight * s
        if B.bias is not None:  # lora_bias=True
            if bias is None:
                bias = torch.zeros(n_tot, dtype=dt, device=x.device)
            bias[row:row + n] += B.bias * s
        col += r
    r2d = u.reshape(-1, u.shape[-1])
    out = torch.addmm(bias, r2d, b_rows.t()) if bias is not None else r2d @ b_rows.t()
    return out.view(*hidden_states.shape[:-1], n_tot).to(hidden_states.dtype)


class MixedBatchLoRA:
    """The adapters' residual under PEFT's mixed-batch inference: sample ``i`` of the batch gets
    adapter ``adapter_names[i]`` on every targeted projection (``"__base__"``, or an adapter a layer
    lacks: none), whatever the active adapters are, as PEFT's ``_mixed_batch_forward`` computes it
    (``B(A(dropout(x[samples]))) * s``, cast to the activations' dtype). The names and PEFT's state are
    read every call (they change per call); PEFT's own checks are made as it makes them."""

    pairs = ()  # (what ProjectionPlan keeps alive: nothing here)

    def __init__(self, slots: list, rows: tuple, n_tot: int):
        self.layers, self.n_tot = [], n_tot
        start = 0
        for (name, _, lora), n in zip(slots, rows):
            if lora is not None:
                self.layers.append((name, start, n, lora))
            start += n

    @staticmethod
    def of(slots: list, rows: tuple, n_tot: int):
        """A :class:`MixedBatchLoRA` where a LoRA layer in the slots carries PEFT's adapter_names, else None."""
        if any(lora is not None and peft_adapter_names(lora) is not None for _, _, lora in slots):
            return MixedBatchLoRA(slots, rows, n_tot)
        return None

    def __call__(self, hidden_states: torch.Tensor, inplace: bool = True) -> tuple:
        names = None
        for name, _, _, lora in self.layers:
            got = peft_adapter_names(lora)
            if got is None or (names is not None and list(got) != list(names)):
                raise UnsupportedModuleError(
                    f"fusedqkv: {name} carries {'no adapter_names while' if got is None else 'other adapter_names than'} "
                    f"another q/k/v LoRA layer of its attention; the fused block computes one batch's adapters for all "
                    f"three")
            names = got
        batch = hidden_states.shape[0]
        if len(names) != batch:  # PEFT's _check_forward_args, in its words
            raise ValueError(f"Length of `adapter_names` should be the same as the number of inputs, but got "
                             f"{len(names)} and {batch} respectively.")
        for lora in (layer[3] for layer in self.layers):
            if lora.merged:
                raise ValueError("Cannot pass `adapter_names` when there are merged adapters, please call "
                                 "`unmerge_adapter` first.")
            if any(lora.use_dora.get(a, False) for a in set(names) if a != "__base__"):
                raise ValueError("Cannot pass `adapter_names` when DoRA is enabled.")
        residual = None
        dt = hidden_states.dtype
        for a in dict.fromkeys(names):  # (first-seen order: each sample takes one adapter)
            if a == "__base__":
                continue
            samples = [i for i, n in enumerate(names) if n == a]
            index = torch.tensor(samples, device=hidden_states.device)
            for name, start, n, lora in self.layers:
                if lora.disable_adapters or a not in lora.lora_A:
                    continue
                A, B, drop = _plain_adapter(name, lora, a)
                x = hidden_states.index_select(0, index).to(A.weight.dtype)
                update = (B(A(drop(x))) * lora.scaling[a]).to(dt)
                if residual is None:
                    residual = hidden_states.new_zeros((*hidden_states.shape[:-1], self.n_tot))
                residual[index, ..., start:start + n] = update
        return residual, None
