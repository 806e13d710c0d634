#!/usr/bin/env bash
# session 29, call 7: issue 36's host rows on the tree with the hybrid's dX first (the run path's launch loops
# split around dX), and the training block at 512 tokens (its hybrid, dX first now) against eager and
# torch.compile (no regression). Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-480}
step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step module 220 module.txt python3 benchmarks/bench_module.py --tokens 512 --reps 20 --out $J/module
cat $W/gpu.txt
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/module.txt | cut -c1-160
cat $W/status
