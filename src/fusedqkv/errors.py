"""Exceptions of the public API that must be importable without the optional dependencies
(``from fusedqkv import UnsupportedModelError`` works where transformers is not installed)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model, one of its attention modules or its configuration cannot be fused."""


__all__ = ["UnsupportedModelError"]
