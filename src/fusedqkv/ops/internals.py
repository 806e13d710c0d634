"""Placeholder until the gate lands (branch h22g): the torch internals fusedqkv uses."""

from __future__ import annotations

import torch

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover
    TensorGuards = None

raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None
set_grad_enabled = torch._C._set_grad_enabled


def fast_path_info() -> dict:
    return {}
