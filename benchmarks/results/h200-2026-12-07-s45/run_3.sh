#!/usr/bin/env bash
# Session 45, device call 3 (carry .whl .bnb .shared): T5Gemma 2's and the code predictor's GPU family tests (the device's transformers 5.17),
# then on an H200 the open issues' H200 rows (issue 34's QLoRA 0.6B row, issue 36's user clock and host rows).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
cat $W/gpu.txt
step t5 120 t5.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py -k "t5gemma2 or code_predictor"
if grep -q H200 $W/gpu.txt; then
  source benchmarks/results/h200_issue_rows.sh
fi
tail -3 $W/t5.txt; cat $W/status
