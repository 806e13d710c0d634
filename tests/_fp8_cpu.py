"""The skip of CPU tests whose FP8 GEMMs pass row scales to ``torch._scaled_mm``, where this torch's CPU
kernel takes per-tensor scales only (torch 2.11; 2.13 takes both). The block refuses those recipes there by
name (test_fp8.test_a_cpu_without_row_scaled_gemms_is_refused_by_name)."""

import pytest
import torch

from fusedqkv.ops import fp8

needs_cpu_row_scales = pytest.mark.skipif(
    not fp8.cpu_scaled_mm_takes_row_scales(),
    reason=f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only (torch 2.13's takes both)")


def _torchao_mx_training_runs() -> bool:
    """torchao's MX training (``quantize_`` with ``MXFP8TrainingOpConfig``) wraps a weight on this torch: torchao
    0.18 asserts a newer torch than 2.11 ("Please install the latest torch nightly build")."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
    except ImportError:
        return False
    try:
        quantize_(torch.nn.Sequential(torch.nn.Linear(32, 32)), MXFP8TrainingOpConfig())
    except AssertionError:
        return False
    return True


needs_torchao_mx_training = pytest.mark.skipif(
    not _torchao_mx_training_runs(),
    reason=f"torchao's MX training is not installed or does not run on torch {torch.__version__}")
