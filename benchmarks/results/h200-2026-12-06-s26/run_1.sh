#!/usr/bin/env bash
# session 26, device call 1 (tree 2b... = main after session 25): the FP8 rowwise block at 2048 and 512 tokens
# (issue 35's <= 0.85x-at-2048 row, last measured in session 18), with each FP8 provider's kernels (--profile).
# Carry .whl .shared.
source benchmarks/results/device_setup.sh  # (as session 27 factored it out)
step fp8 480 fp8.txt python3 benchmarks/bench_fp8.py --rows 1,4,7,0,3,6 --profile --reps 12 --out $J/fp8
cp $J/fp8/bench_fp8.json $W/fp8.json 2>/dev/null
tail -30 $W/fp8.txt
cat $W/status
