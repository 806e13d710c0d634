"""Integrations with other libraries. Each imports its library only when called, so the
core never requires them (for Hugging Face, from the clone: ``pip install -e '.[transformers]'``)."""

from __future__ import annotations


def apply_to(model, *, fp8=None) -> int:
    """Fuse the attention input blocks of a built Hugging Face ``transformers`` model in
    place; returns the number of attention layers fused. ``fp8``: the fused projections in FP8
    with torchao's recipe of that name. See :func:`fusedqkv.integrations.transformers.apply_to`."""
    from .transformers import apply_to as _apply_to

    return _apply_to(model, fp8=fp8)


__all__ = ["apply_to"]
