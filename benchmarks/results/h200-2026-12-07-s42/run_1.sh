#!/usr/bin/env bash
# Session 42, device call (carry .whl .bnb .shared): on any card, session 41's never-run GPU tests (QLoRA mixed
# batches, bf16 quant storage), the graph cases and the FP8 compile tests (this session's constant-result mark:
# capability() and the CPU probe traced as constants); then, on an H200 only, issue 34's QLoRA 0.6B row, issue
# 36's user clock and host rows, in the time left.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
step gtests 170 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py tests/test_gpu_graphs.py \
  tests/test_gpu_fp8.py::test_hf_model_with_torchao_float8_compiles_with_inductor
tail -15 $W/gtests.txt | cut -c1-300
if grep -q H200 $W/gpu.txt; then
  source benchmarks/results/h200_issue_rows.sh
fi
cat $W/status
