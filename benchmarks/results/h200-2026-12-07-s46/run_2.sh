#!/usr/bin/env bash
# Session 46, device call 2 (carry .whl .bnb .shared; any card): the GPU tests that session 45's unrun commits touch
# (0657dc2 the rows views' gradient hook, eb378f5 the FP8 refusal where the plan is taken): HF families, QLoRA,
# graphs.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-330}
cat $W/gpu.txt
step gtests 320 gtests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py \
  tests/test_gpu_qlora.py tests/test_gpu_graphs.py
grep -E "FAILED|SKIPPED" $W/gtests.txt | cut -c1-200 | head -20
cat $W/status
