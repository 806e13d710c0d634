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

With double quantisation bitsandbytes first dequantizes the weight's absmax (its own blockwise
dequantization, then the offset added) on every call: three ops and their Python a projection,
twice a step, for values that change only when the weight is quantized again. Where the caller
keeps the :class:`DequantizedQKV` (the kept projection plan), it keeps each projection's absmax
dequantized too (``config.qlora_absmax == "keep"``, the default): 4 bytes per ``blocksize``
weights (1/16 of the bf16 weight's bytes at blocksize 64, 1/8 of the 4-bit weight's), and one
``dequantize_4bit`` a projection per call, on a flat quantization state carrying the kept absmax
(bitsandbytes' public path for an absmax given). The kept absmax is dropped whenever the
weight's quantization state is another object or its absmax, nested state or offset were
written since (their version counters); it is never computed while a CUDA graph is captured.

``Linear8bitLt`` is refused: its product quantizes the activations too (LLM.int8(), with fp16
outlier columns above ``llm_int8_threshold``), which a GEMM on the dequantized weight does not
reproduce.
"""

from __future__ import annotations

import sys

import torch

from ..ops import config as _config
from ..ops.device import capturing, current_stream, workspace

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
    call it, so nothing dense is held between them. ``keep_absmax``: keep each base's dequantized
    absmax (double quantisation; the module docstring) -- for an object that lives across calls."""

    def __init__(self, bases: list, dtype: torch.dtype, device: torch.device, keep_absmax: bool = False):
        self.bases, self.dtype, self.device = bases, dtype, device
        self.rows = [m.out_features for m in bases]
        self.n_tot, self.hidden = sum(self.rows), bases[0].in_features
        self.keep_absmax = keep_absmax
        self._flat = {}  # id(base) -> (the objects and versions it was made from, the flat QuantState)
        self._one_launch = None  # (key, ops.dequant_4bit.Dequant4bit, the code table on the device) or None

    def _state(self, m, qs):
        """The QuantState to dequantize base ``m`` with: ``qs`` itself, or with double quantisation
        and a kept absmax, a flat state over the dequantized absmax (made once per state of ``qs``)."""
        if not (self.keep_absmax and qs.nested and _config.current().qlora_absmax == "keep"):
            return qs
        nested, offset = qs.state2, qs.offset
        made_of = (qs, qs.absmax, nested, nested.absmax, offset)
        versions = (qs.absmax._version, nested.absmax._version,
                    offset._version if isinstance(offset, torch.Tensor) else None)
        kept = self._flat.get(id(m))
        if kept is not None and kept[1] == versions and all(a is b for a, b in zip(kept[0], made_of)):
            return kept[2]
        if capturing(self.device):  # nothing allocated during a capture outlives it
            return qs
        from bitsandbytes.functional import QuantState, dequantize_blockwise

        absmax = dequantize_blockwise(qs.absmax, nested)  # bitsandbytes' own steps, as dequantize_4bit takes them
        absmax += offset
        flat = QuantState(absmax=absmax.float(), shape=qs.shape, code=qs.code, blocksize=qs.blocksize,
                          quant_type=qs.quant_type, dtype=qs.dtype)
        self._flat[id(m)] = (made_of, versions, flat)  # the bases live as long as this object
        return flat

    def __call__(self) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        if torch.compiler.is_compiling():  # traced: plain tensors, kept by the graph
            parts = [dequantize_4bit(m.weight.data, quant_state(m)).to(self.dtype) for m in self.bases]
            return torch.cat(parts, 0)
        n = self.n_tot * self.hidden
        stream = current_stream(self.device)
        buf = workspace("qlora_qkv_weight", self.device, stream, n * self.dtype.itemsize)
        w = buf[:n * self.dtype.itemsize].view(self.dtype).view(self.n_tot, self.hidden)
        states = [self._state(m, quant_state(m)) for m in self.bases]
        one = self._one_launch_for(states, w)
        if one is not None:  # NF4 with fp32 absmax throughout: the three projections in one launch
            plan, code = one
            plan(w, code, [_packed(m) for m in self.bases], [qs.absmax for qs in states], stream)
            return w
        start = 0
        for m, rows, qs in zip(self.bases, self.rows, states):
            part = w[start:start + rows]
            if qs.dtype == self.dtype and part.is_cuda:
                dequantize_4bit(m.weight.data, qs, out=part)
            else:  # bitsandbytes writes into out= on CUDA only, and in the weight's own dtype only
                part.copy_(dequantize_4bit(m.weight.data, qs))
            start += rows
        return w


    def _one_launch_for(self, states: list, out: torch.Tensor):
        """``(Dequant4bit, code)`` where every base is NF4 with an fp32 absmax (a kept one, or not
        double-quantized), one blocksize, its quantization dtype the block's or fp32 (where
        bitsandbytes' values reach the block's dtype in one rounding too); planned once per such
        geometry, the operands checked then. None otherwise: each base through bitsandbytes'
        ``dequantize_4bit``."""
        if not self.keep_absmax or _config.current().qlora_dequant != "one_launch":
            return None
        first = states[0]
        # bitsandbytes' values in the block's dtype: its fp32 product rounded once -- directly where the state's
        # dtype is the block's, or through an fp32 result copied into the block's dtype (also one rounding)
        if any(qs.nested or qs.quant_type != "nf4" or qs.blocksize != first.blocksize
               or qs.dtype not in (self.dtype, torch.float32) or qs.absmax.dtype != torch.float32 for qs in states):
            return None
        key = (first.blocksize, self.dtype, tuple(id(qs) for qs in states))
        kept = self._one_launch
        if kept is not None and kept[0] == key:
            return kept[1], kept[2]
        from ..ops import dequant_4bit as D

        values = [m.out_features * m.in_features for m in self.bases]
        if D.supported(values, first.blocksize, self.dtype, self.device) is not None or capturing(self.device):
            return None
        plan = D.Dequant4bit(values, first.blocksize, self.dtype, self.device)
        code = first.code.to(device=self.device, dtype=torch.float32).contiguous()
        plan.check(out.view(-1), code, [_packed(m).reshape(-1) for m in self.bases], [qs.absmax for qs in states])
        if any(not torch.equal(qs.code.to(code.device, torch.float32), code) for qs in states[1:]):
            return None  # NF4 tables that differ: not bitsandbytes' own
        self._one_launch = (key, plan, code)
        return plan, code


def _packed(m) -> torch.Tensor:
    """A 4-bit layer's packed codes as bytes: ``bnb_4bit_quant_storage`` (bf16 for FSDP's QLoRA recipe) stores the
    same bytes in another dtype, which bitsandbytes' kernels read as bytes too."""
    t = m.weight.data
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fused_bias(bases: list, dtype: torch.dtype):
    """The joined q/k/v bias in the block's dtype (differentiable: PEFT's ``bias="all"`` trains
    it), or None."""
    biases = [m.bias for m in bases]
    if biases[0] is None:
        return None
    return torch.cat([b.to(dtype) for b in biases])
