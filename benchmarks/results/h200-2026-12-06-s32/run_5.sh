#!/usr/bin/env bash
# session 32, call 5 (the budget's last ~300 s): issue 36's host rows on an H200 only (its card; none came in
# sessions 29-32 so far); on any other card it stops at once. Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-230}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
cat $W/status
