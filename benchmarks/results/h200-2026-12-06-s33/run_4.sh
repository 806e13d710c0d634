#!/usr/bin/env bash
# session 33, call 4 (the budget's last ~600 s): issue 36's rows and user clock and issue 35's >= 8192-token rows
# on an H200 only (their card); on any other card it stops at once. Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-250}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step host 190 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 60 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
step fp8 60 fp8.txt python3 benchmarks/bench_fp8.py --rows 2 --reps 10 --out $J/fp8
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -4 $W/b091.txt | cut -c1-200; tail -16 $W/fp8.txt | cut -c1-220
cat $W/status
