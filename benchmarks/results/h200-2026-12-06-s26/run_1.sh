#!/usr/bin/env bash
# session 26, device call 1 (tree 2b... = main after session 25): the FP8 rowwise block at 2048 and 512 tokens
# (issue 35's <= 0.85x-at-2048 row, last measured in session 18), with each FP8 provider's kernels (--profile).
# Carry .whl .shared.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; J=$OUT/w/j/k; mkdir -p $W $J
T0=$(date +%s)
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  if [ $(( t0 - T0 + limit )) -gt 575 ]; then limit=$(( 575 - (t0 - T0) )); fi
  if [ "$limit" -lt 20 ]; then echo "$name skipped (time)" >> "$W/status"; return; fi
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
export PYTHONPATH=src:/tmp/site
step fp8 480 fp8.txt python3 benchmarks/bench_fp8.py --rows 1,4,7,0,3,6 --profile --reps 12 --out $J/fp8
cp $J/fp8/bench_fp8.json $W/fp8.json 2>/dev/null
tail -30 $W/fp8.txt
cat $W/status
