#!/usr/bin/env bash
# Session 43, device call 1 (carry .whl .bnb .shared): the open issues' H200 rows (issue 34's QLoRA 0.6B row,
# issue 36's user clock and host rows), then issue 35's FP8 rows; nothing on another card.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: nothing run"; exit 0; }
source benchmarks/results/h200_issue_rows.sh
step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --out $J/fp8
echo "== fp8"; tail -16 $W/fp8.txt | cut -c1-220
cat $W/status
