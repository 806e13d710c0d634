#!/usr/bin/env bash
# Session 36, device call 2 (H200 only: stops on any other card; carry .whl .shared): issue 36's rows on this
# host, same commands as session 35's run_4.sh/run5: host_costs (091 and training rows) and the user clock.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step host 160 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/b091.txt | cut -c1-200
cat $W/status
