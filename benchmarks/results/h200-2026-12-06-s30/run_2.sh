#!/usr/bin/env bash
# session 30, call 2: session 29's run_7 again (issue 36's host rows, and the training block at 512 tokens against
# eager and torch.compile) on the tree whose hybrid dW behind dX waits at its start. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-480}
step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step module 220 module.txt python3 benchmarks/bench_module.py --tokens 512 --reps 20 --out $J/module
cat $W/gpu.txt
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/module.txt | cut -c1-160
cat $W/status
