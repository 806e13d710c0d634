#!/usr/bin/env bash
# Session 40, device call 2 (any card; carry .whl .bnb .shared): the GPU tests that run apply_to's changed
# paths (state-dict hooks, meta weights, the parameter refusal): HF families, QLoRA, FP8 (torchao on qkv_proj),
# graphs.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-420}
step tests 400 tests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py \
  tests/test_gpu_qlora.py tests/test_gpu_fp8.py tests/test_gpu_graphs.py
cat $W/gpu.txt; grep -E "SKIPPED|passed|failed|FAILED" $W/tests.txt | cut -c1-200 | tail -15; cat $W/status
