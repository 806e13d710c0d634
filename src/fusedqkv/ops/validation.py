"""Argument checks shared by every public entry point.

Every check runs on the host before any kernel launches and raises ``TypeError``
(not a tensor / not a number) or ``ValueError`` (shape, dtype, device, head
configuration) with a message naming the argument and what was expected.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def _fmt_shape(shape: Iterable) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def require_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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


def require_number(name: str, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got a tensor of shape {_fmt_shape(x.shape)}")
        return float(x.item())
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")
    return float(x)


def require_out(out, specs: Sequence[tuple[str, Sequence[int], torch.dtype]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Check a destination tuple against (name, shape, dtype) specs."""
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
    return tuple(out)
