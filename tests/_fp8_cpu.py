"""The skip of CPU tests whose FP8 GEMMs pass row scales to ``torch._scaled_mm``, where this torch's CPU
kernel takes per-tensor scales only (torch 2.11; 2.13 takes both). The block refuses those recipes there by
name (test_fp8.test_a_cpu_without_row_scaled_gemms_is_refused_by_name)."""

import pytest
import torch

from fusedqkv.ops import fp8

needs_cpu_row_scales = pytest.mark.skipif(
    not fp8.cpu_scaled_mm_takes_row_scales(),
    reason=f"torch {torch.__version__}'s CPU torch._scaled_mm takes per-tensor scales only (torch 2.13's takes both)")
