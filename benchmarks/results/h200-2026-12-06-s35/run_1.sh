#!/usr/bin/env bash
# session 35, call 1: on an H200, all three issues' H200 rows first (session 34's run_1.sh steps); on any card, the
# FP8 cast kernels' launch sweep (benchmarks/cast_tuning.py) and the rowwise fwd+bwd's kernel profile at 091 8192.
# Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-585}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
  step fp8 190 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
  step blora 110 blora.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/blora
fi
step casts 200 casts.txt python3 benchmarks/cast_tuning.py --reps 30 --out $W/casts
step prof 150 prof.txt python3 benchmarks/bench_fp8.py --rows 2 --reps 10 --profile --out $W/prof
grep -A6 "^091 / two torch.mm" $W/host.txt 2>/dev/null; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt 2>/dev/null
tail -4 $W/b091.txt 2>/dev/null | cut -c1-200; tail -24 $W/fp8.txt 2>/dev/null | cut -c1-220; tail -14 $W/blora.txt 2>/dev/null | cut -c1-240
grep "fp8_rowwise:" $W/prof.txt | cut -c1-600; tail -3 $W/prof.txt | cut -c1-400
tail -22 $W/casts.txt
cat $W/status
