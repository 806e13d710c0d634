#!/usr/bin/env bash
# Session 44, device call 3 (carry .whl .bnb .shared): on an H200, the open issues' H200 rows (issue 34's QLoRA 0.6B
# row, issue 36's user clock and host rows) and issue 35's FP8 rows; on an H100, the GPU tests and the fuzz of the
# tree with the side-stream casts reverted (3ce9d9d).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  source benchmarks/results/h200_issue_rows.sh
  step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --out $J/fp8
  echo "== fp8"; tail -5 $W/fp8.txt | cut -c1-220
else
  step gtests 210 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_gpu_fp8.py
  step fuzz 110 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 100 --out $J/fuzz
  grep -E "FAILED|Error" $W/gtests.txt | head -20; tail -2 $W/gtests.txt; tail -3 $W/fuzz.txt
fi
cat $W/status
