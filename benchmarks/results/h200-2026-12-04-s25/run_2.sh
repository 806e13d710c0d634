#!/usr/bin/env bash
# session 25, device call 2: the training backward's Triton products (chain / hybrid) against its cuBLAS
# products in the same rounds (bench_floor --ab-products, the 512 and 2048 rows; GPU-only, graphs, L2 flushed),
# then the host rows (issue 36) with the new path. Benchmarks only: nothing else runs beside them.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
W=$OUT/w; J=$OUT/w/j/k; mkdir -p $W $J
T0=$(date +%s)
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  if [ $(( t0 - T0 + limit )) -gt 570 ]; then limit=$(( 570 - (t0 - T0) )); fi
  if [ "$limit" -lt 20 ]; then echo "$name skipped (time)" >> "$W/status"; return; fi
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
export PYTHONPATH=src
step floor 300 floor.txt python3 benchmarks/bench_floor.py --rows 0,1,3,4,6,7 --ab-products --reps 15 --out $J/floor
cp $J/floor/bench_floor.json $W/floor.json 2>/dev/null
step host 150 host.txt python3 benchmarks/host_costs.py --workloads "" --train-tokens 128,512 --out $J/host
cp $J/host/host_costs.json $W/host_costs.json 2>/dev/null
step glue 60 glue.txt python3 benchmarks/host_glue_training.py --device cuda --tokens 512 --out $J/glue
tail -20 $W/floor.txt
grep -A4 "^training fwd+bwd / two" $W/host.txt
grep -B2 -A16 "^training block fwd+bwd" $W/glue.txt | head -24
cat $W/status
