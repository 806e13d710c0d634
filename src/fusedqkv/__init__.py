"""fusedqkv: fused Triton kernels for the GQA attention input block (QKV projection,
RoPE, per-head RMSNorm of q and k), forward and backward, and a SOL-ExecBench-style
benchmark harness."""

from .ops.gqa_backward import gqa_qkv_rope_qk_norm_backward

__version__ = "0.1.0"

__all__ = ["gqa_qkv_rope_qk_norm_backward", "__version__"]
