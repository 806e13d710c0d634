"""fusedqkv: fused Triton kernels for the GQA attention input block (QKV projection,
RoPE, per-head RMSNorm of q and k), forward and backward, and a SOL-ExecBench-style
benchmark harness."""

from .ops.backward_091 import gqa_qkv_rope_qk_norm_backward

__version__ = "0.1.0"

__all__ = ["gqa_qkv_rope_qk_norm_backward", "__version__"]

# device state (plans, kept buffers, the fast launch path): fusedqkv.ops.device
from .ops.device import clear as clear_caches, info as cache_info  # noqa: E402

__all__ += ["clear_caches", "cache_info"]

# training-ready block (issue 4): differentiable, torch.compile-safe forward + module
from .autograd import gqa_qkv_rope_qk_norm  # noqa: E402
from .module import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm  # noqa: E402

__all__ += ["gqa_qkv_rope_qk_norm", "GQAQKVRoPEQKNorm", "ReferenceGQAQKVRoPEQKNorm"]

# Hugging Face models (issue 16): transformers is imported only when apply_to is called
from .integrations import apply_to  # noqa: E402
from .errors import UnsupportedModelError  # noqa: E402  (no transformers needed)

__all__ += ["apply_to", "UnsupportedModelError"]
