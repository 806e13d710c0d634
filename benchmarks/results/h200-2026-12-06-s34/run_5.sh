#!/usr/bin/env bash
# session 34, the budget's last ~390 s: issue 36's host rows and user clock on an H200 only (stops on any other
# card). Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-250}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step host 170 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 70 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -4 $W/b091.txt | cut -c1-200
cat $W/status
