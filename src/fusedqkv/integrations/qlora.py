"""QLoRA inside the fused block: q/k/v as bitsandbytes 4-bit layers (NF4 or FP4, with or without
double quantisation), as ``BitsAndBytesConfig(load_in_4bit=True, ...)`` loads them.

A 4-bit weight is one packed tensor per projection, so there is no fused parameter: ``apply_to``
keeps the three ``bnb.nn.Linear4bit`` modules where HF put them (PEFT wraps them as it does
unfused, and the state dict is bitsandbytes' own), and every fused forward builds the fused
``[Q | K | V]`` weight in the block's dtype by dequantizing each projection with bitsandbytes'
``dequantize_4bit`` into its rows of one workspace (:func:`fusedqkv.ops.device.workspace`: kept per
stream, fresh per call while a CUDA graph is captured). The block then runs as for a frozen dense
weight (no dW GEMM), with the adapters of :mod:`fusedqkv.integrations.peft`.

The dequantized weight is not kept for the backward: the block's backward calls
:class:`DequantizedQKV` again (``qkv_weight_source``), as bitsandbytes' own 4-bit matmul
dequantizes again in its backward, so one layer's dense weight is live at a time (the point of
QLoRA's memory). Under ``torch.compile`` the weight is a traced tensor the graph keeps instead.

``Linear8bitLt`` is refused: its product quantizes the activations too (LLM.int8(), with fp16
outlier columns above ``llm_int8_threshold``), which a GEMM on the dequantized weight does not
reproduce.
"""

from __future__ import annotations

import sys

import torch

from ..ops.device import current_stream, workspace

# bitsandbytes' 4-bit layer classes whose forward is x W^T + b with W = dequantize_4bit(weight)
_4BIT = ("Linear4bit", "LinearNF4", "LinearFP4")


def _bnb_nn():
    return sys.modules.get("bitsandbytes.nn.modules")


def is_4bit(m) -> bool:
    """``m`` is exactly one of bitsandbytes' 4-bit linear classes (bitsandbytes is imported
    wherever one exists)."""
    mod = _bnb_nn()
    return mod is not None and any(type(m) is getattr(mod, name, None) for name in _4BIT)


def is_8bit(m) -> bool:
    mod = _bnb_nn()
    return mod is not None and type(m) is getattr(mod, "Linear8bitLt", None)


REFUSED_8BIT = ("bitsandbytes Linear8bitLt computes LLM.int8() (the activations quantized too, fp16 outlier "
                "columns above llm_int8_threshold), which a GEMM on its dequantized weight would not reproduce; "
                "fusedqkv takes 4-bit q/k/v (load_in_4bit=True, NF4 or FP4)")


def quant_state(m):
    """The 4-bit layer's QuantState (restored from the module where FSDP dropped it, as
    bitsandbytes' forward does), or None."""
    qs = getattr(m.weight, "quant_state", None)
    if qs is None and getattr(m, "quant_state", None) is not None:  # the module kept a copy
        fix = getattr(_bnb_nn(), "fix_4bit_weight_quant_state_from_module", None)
        if fix is not None:
            fix(m)
            qs = getattr(m.weight, "quant_state", None)
    return qs


def check_4bit(path: str, m, hidden: int, error) -> None:
    """What the fused block needs of one 4-bit projection (raises ``error`` naming it)."""
    qs = quant_state(m)
    if qs is None:
        raise error(f"fusedqkv: {path} ({type(m).__name__}) has no quantization state: its weight is not quantized "
                    f"yet (move the model to its device, or load it with a BitsAndBytesConfig)")
    if tuple(qs.shape) != (m.out_features, m.in_features) or m.in_features != hidden:
        raise error(f"fusedqkv: {path}: a 4-bit weight of shape {tuple(qs.shape)}; expected "
                    f"[{m.out_features}, {hidden}] (hidden_size from the config)")
    if qs.quant_type not in ("nf4", "fp4"):
        raise error(f"fusedqkv: {path}: 4-bit quant_type {qs.quant_type!r}; expected 'nf4' or 'fp4'")
    if getattr(qs, "packing_format_for_cpu", False):
        raise error(f"fusedqkv: {path}: the 4-bit weight was repacked for bitsandbytes' CPU inference kernel (an "
                    f"eval-mode call without grad on a CPU); dequantize_4bit does not read that layout")


def block_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype the block computes in: autocast's where it is on (the block casts to it), else
    the activations'."""
    dev = hidden_states.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden_states.dtype


class DequantizedQKV:
    """The fused ``[n_tot, hidden]`` weight of 4-bit projections, in one dtype, on demand.

    ``bases``: the bitsandbytes layers in row order (Gemma 4's shared K/V: k twice). Each call
    dequantizes them again (bitsandbytes' ``dequantize_4bit``, into the rows of the stream's
    workspace: in place on CUDA where the dtypes agree, else through a copy): the forward and the backward both
    call it, so nothing dense is held between them."""

    def __init__(self, bases: list, dtype: torch.dtype, device: torch.device):
        self.bases, self.dtype, self.device = bases, dtype, device
        self.rows = [m.out_features for m in bases]
        self.n_tot, self.hidden = sum(self.rows), bases[0].in_features

    def __call__(self) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        if torch.compiler.is_compiling():  # traced: plain tensors, kept by the graph
            parts = [dequantize_4bit(m.weight.data, quant_state(m)).to(self.dtype) for m in self.bases]
            return torch.cat(parts, 0)
        n = self.n_tot * self.hidden
        buf = workspace("qlora_qkv_weight", self.device, current_stream(self.device), n * self.dtype.itemsize)
        w = buf[:n * self.dtype.itemsize].view(self.dtype).view(self.n_tot, self.hidden)
        start = 0
        for m, rows in zip(self.bases, self.rows):
            qs = quant_state(m)
            part = w[start:start + rows]
            if qs.dtype == self.dtype and part.is_cuda:
                dequantize_4bit(m.weight.data, qs, out=part)
            else:  # bitsandbytes writes into out= on CUDA only, and in the weight's own dtype only
                part.copy_(dequantize_4bit(m.weight.data, qs))
            start += rows
        return w


def fused_bias(bases: list, dtype: torch.dtype):
    """The joined q/k/v bias in the block's dtype (differentiable: PEFT's ``bias="all"`` trains
    it), or None."""
    biases = [m.bias for m in bases]
    if biases[0] is None:
        return None
    return torch.cat([b.to(dtype) for b in biases])
