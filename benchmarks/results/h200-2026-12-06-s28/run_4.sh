#!/usr/bin/env bash
# session 28, call 4 (the budget's last ~400 s): issue 36's rows and user clock once more in one run on
# whatever host comes (call 1's host A met every host row, call 2's host B did not). Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
step host 210 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
cat $W/gpu.txt
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -4 $W/b091.txt | cut -c1-200
cat $W/status
