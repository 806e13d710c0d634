#!/usr/bin/env bash
# Session 42, device call 2 (carry .whl .bnb .shared): the H200 rows alone (run_1.sh's GPU tests passed on an
# H100, run1/): issue 34's QLoRA 0.6B row first, then issue 36's user clock and host rows; nothing on another card.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-420}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: nothing run"; exit 0; }
source benchmarks/results/h200_issue_rows.sh
cat $W/status
