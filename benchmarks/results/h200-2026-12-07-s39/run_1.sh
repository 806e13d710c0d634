#!/usr/bin/env bash
# Session 39, device call (carry .whl .bnb .shared): on an H200, issue 34's QLoRA 0.6B row (run_2.sh of session 37
# with TOTAL=240); on any other card, the GPU tests of this session's changes to apply_to's checks (DDP wrapper,
# optimizer step pre-hook) and the bf16 rule helper: graphs, HF families, QLoRA.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TOTAL=240 bash benchmarks/results/h200-2026-12-07-s37/run_2.sh
  exit 0
fi
source benchmarks/results/device_setup.sh
step tests 240 tests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_hf_families.py \
  tests/test_gpu_qlora.py
cat $W/gpu.txt; grep -E "SKIPPED|passed|failed" $W/tests.txt | cut -c1-200 | tail -15; cat $W/status
