#!/usr/bin/env bash
# Prepared in session 35 for a next device call (not run; any card): the backward stage writing dQKV's column amax
# partials (fp8.STAGE_AMAX_COLUMNS, off since session 22's 2.5x slower stage) re-measured on today's stage, beside
# the plan's default in the same rounds, with each provider's kernel profile. Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
cat $W/gpu.txt
step fp8 280 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9 --reps 10 --ab-stage-columns --profile --out $W/fp8
grep -E "stagecols|fp8_rowwise:|fp8_rowwise_stagecols:" $W/fp8.txt | cut -c1-700
cat $W/status
