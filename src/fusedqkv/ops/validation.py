"""Argument checks shared by every public entry point.

Every check runs on the host before any kernel launches and raises ``TypeError``
(not a tensor / not a number) or ``ValueError`` (shape, dtype, device, head
configuration) with a message naming the argument and what was expected.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence

import torch

from .internals import has_internal_overlap

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 512  # Gemma 4's global layers
# the norm over all heads of a token holds every head of it in one tile: above 256 (OLMo's are 128) the
# stage spills kilobytes per thread (sm_90 offline, NOTES session 17)
ALL_HEADS_MAX_HEAD_DIM = 256


def _fmt_shape(shape: Iterable) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def require_tensor(name: str, t) -> torch.Tensor:
    """A dense (strided) torch.Tensor; sparse/nested tensors have no strides for a kernel."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        layout = "nested" if getattr(t, "is_nested", False) else str(t.layout).replace("torch.", "")
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {layout}")
    return t


def require_float_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported; expected one of {names}")


def require_shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {_fmt_shape(expected)}{extra}, got {_fmt_shape(t.shape)}")


def require_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor {layout}, got shape {_fmt_shape(t.shape)}")


def require_same_dtype(names_tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.dtype:
    first_name, first = names_tensors[0]
    for name, t in names_tensors[1:]:
        if t.dtype != first.dtype:
            raise ValueError(
                f"{name}: dtype {str(t.dtype).replace('torch.', '')} differs from {first_name}'s "
                f"{str(first.dtype).replace('torch.', '')}; these arguments must share one dtype"
            )
    return first.dtype


def require_same_device(names_tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    first_name, first = names_tensors[0]
    for name, t in names_tensors[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: on device {t.device}, but {first_name} is on {first.device}; all tensors must be on one device")
    return first.device


def require_head_config(num_heads: int, num_kv_heads: int, head_dim: int, where: str = "") -> None:
    at = f" ({where})" if where else ""
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"head configuration{at}: num_heads={num_heads} and num_kv_heads={num_kv_heads} must be >= 1")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"head configuration{at}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs a whole number of query heads per KV head"
        )
    if head_dim % 2 != 0 or head_dim < 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim{at}: {head_dim} is not supported; expected an even size from 2 to {MAX_HEAD_DIM} (RoPE rotates half-dims)")


def require_all_heads_head_dim(head_dim: int, where: str = "") -> None:
    """norm_scope='all_heads' takes head_dim up to ALL_HEADS_MAX_HEAD_DIM."""
    if head_dim > ALL_HEADS_MAX_HEAD_DIM:
        at = f" ({where})" if where else ""
        raise ValueError(f"head_dim{at}: {head_dim} is not supported with norm_scope='all_heads'; expected at most "
                         f"{ALL_HEADS_MAX_HEAD_DIM} (norm_scope='head' takes up to {MAX_HEAD_DIM})")


def require_matching_hidden(hidden_states: torch.Tensor, qkv_weight, rows: Optional[int] = None) -> None:
    """hidden_states' last size and qkv_weight's columns are one hidden_size (checked where both
    have the right number of dims -- and, given ``rows``, the weight has that many rows -- before
    the weight's full shape, so the message names both)."""
    if not isinstance(qkv_weight, torch.Tensor) or qkv_weight.dim() != 2 or hidden_states.dim() != 3:
        return
    if rows is not None and qkv_weight.shape[0] != rows:
        return
    if hidden_states.shape[2] != qkv_weight.shape[1]:
        raise ValueError(
            f"hidden_states / qkv_weight: hidden_states has hidden_size {hidden_states.shape[2]} "
            f"(shape {_fmt_shape(hidden_states.shape)}) but qkv_weight has {qkv_weight.shape[1]} columns "
            f"(shape {_fmt_shape(qkv_weight.shape)}); expected one hidden_size for both")


def require_number(name: str, x, *, min_value: Optional[float] = None, finite: bool = True) -> float:
    """A real scalar: a Python/NumPy number or a one-element real tensor (never bool)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got a tensor of shape {_fmt_shape(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name}: expected a real number, got a tensor of dtype {_dt(x.dtype)}")
        v = float(x.item())
    elif isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")
    else:
        v = float(x)
    # (comparisons, not math.isfinite: under torch.compile a float that differed between two compiled calls, an eps
    # of two models, arrives symbolic, and math.isfinite of it breaks the graph)
    if finite and not (v == v and -math.inf < v < math.inf):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name}: expected a number >= {min_value}, got {v}")
    return v


def _byte_range(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """[first, last + 1) bytes a strided tensor can touch (torch strides are >= 0), or
    None where it touches no memory (empty, meta). Two live allocations never share
    addresses, so overlapping ranges on one device mean shared memory."""
    n = t.numel()
    if n == 0 or t.is_meta:
        return None
    p = t.data_ptr()
    if t.is_contiguous():  # the common case, without a Python loop over dims
        return (p, p + n * t.element_size())
    span = 1
    for size, st in zip(t.shape, t.stride()):
        span += (size - 1) * st
    return (p, p + span * t.element_size())


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory may overlap (conservative: their byte ranges)."""
    if a.device != b.device:
        return False
    ra, rb = _byte_range(a), _byte_range(b)
    return ra is not None and rb is not None and ra[0] < rb[1] and rb[0] < ra[1]


class OutputSpecs(list):
    """A list of (name, shape, dtype) output specs that also carries the validated
    inputs ((name, tensor) pairs), so ``require_out`` can refuse destinations that
    alias an input."""

    def __init__(self, specs, inputs: Sequence[tuple[str, torch.Tensor]] = ()):
        super().__init__(specs)
        self.inputs = tuple(inputs)


def require_out(out, specs: Sequence[tuple[str, Sequence[int], torch.dtype]], device: torch.device,
                inputs: Optional[Sequence[tuple[str, torch.Tensor]]] = None) -> tuple[torch.Tensor, ...]:
    """Check a destination tuple against (name, shape, dtype) specs.

    Each destination must be a dense tensor of its shape, dtype and device, with no
    internal overlap (e.g. not an ``expand``-ed view), not overlapping another
    destination, nor any of ``inputs`` ((name, tensor) pairs; by default those an
    :class:`OutputSpecs` carries) -- a kernel writing into memory it also reads would
    return a silently wrong answer.
    """
    if inputs is None:
        inputs = getattr(specs, "inputs", ())
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"out: expected a tuple of {len(specs)} tensors, got {type(out).__name__}")
    if len(out) != len(specs):
        raise ValueError(f"out: expected {len(specs)} tensors ({', '.join(s[0] for s in specs)}), got {len(out)}")
    for t, (name, shape, dtype) in zip(out, specs):
        oname = f"out[{name}]"
        require_tensor(oname, t)
        require_shape(oname, t, shape)
        if t.dtype != dtype:
            raise ValueError(f"{oname}: expected dtype {str(dtype).replace('torch.', '')}, got {str(t.dtype).replace('torch.', '')}")
        if t.device != device:
            raise ValueError(f"{oname}: on device {t.device}, expected {device} like the inputs")
        if not t.is_contiguous() and not t.is_meta and has_internal_overlap(t):
            raise ValueError(f"{oname}: has internally overlapping memory (a stride-0 or expanded view); "
                             "expected a tensor whose elements each have their own memory")
    # overlap: byte ranges compared as integers (host time matters: ~20 ranges, no allocation)
    ranges = [_byte_range(t) for t in out]
    # (all on ``device``: outs checked above, inputs validated onto one device)
    in_ranges = [(iname, _byte_range(x)) for iname, x in inputs if isinstance(x, torch.Tensor)]
    for i, ri in enumerate(ranges):
        if ri is None:
            continue
        for j in range(i):
            rj = ranges[j]
            if rj is not None and ri[0] < rj[1] and rj[0] < ri[1]:
                raise ValueError(f"out[{specs[i][0]}]: shares memory with out[{specs[j][0]}]; expected separate destinations")
        for iname, rx in in_ranges:
            if rx is not None and ri[0] < rx[1] and rx[0] < ri[1]:
                raise ValueError(f"out[{specs[i][0]}]: shares memory with the input {iname}; expected a destination "
                                 "that does not alias any input")
    return tuple(out)


def span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last (0: empty)."""
    r = _byte_range(t)
    return 0 if r is None else r[1] - r[0]


def overlaps_any(out_ptrs, out_spans, in_ptrs, in_spans) -> bool:
    """Whether any destination's bytes [ptr, ptr + span) overlap another destination's or an
    input's (inputs may overlap each other). One sorted sweep: a plan's fast check before
    :func:`require_out` names the culprit."""
    iv = sorted([(p, p + s, True) for p, s in zip(out_ptrs, out_spans) if s]
                + [(p, p + s, False) for p, s in zip(in_ptrs, in_spans) if s])
    end_all = end_out = -1
    for lo, hi, is_out in iv:
        if lo < end_out or (is_out and lo < end_all):
            return True
        end_all = max(end_all, hi)
        if is_out:
            end_out = max(end_out, hi)
    return False
