"""Launchers, validation and CPU/GPU dispatch."""

from .gqa_backward import gqa_qkv_rope_qk_norm_backward

__all__ = ["gqa_qkv_rope_qk_norm_backward"]
