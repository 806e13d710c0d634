#!/usr/bin/env bash
# session 35, call 2 (any card): the FP8 cast kernels' launch sweep (benchmarks/cast_tuning.py), then issue 35's
# 8192-token rows (091, h5120) with the sweep's best launches beside the library's (bench_fp8.py --tuned), same rounds.
# Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-440}
cat $W/gpu.txt
step casts 150 casts.txt python3 benchmarks/cast_tuning.py --reps 30 --out $W/casts
step fp8 280 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8 --reps 10 --tuned $W/casts/cast_tuning.json --out $W/fp8
tail -22 $W/casts.txt
grep -E "tuned cast launches|tuned/default" $W/fp8.txt | cut -c1-300; tail -14 $W/fp8.txt | cut -c1-220
cat $W/status
