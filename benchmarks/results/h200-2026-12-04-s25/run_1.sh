#!/usr/bin/env bash
# session 25, device call 1 (tree as landed, 1126094 + this script): fresh numbers of the landed tree for the three
# issues' open rows -- QLoRA 0.6B end to end interleaved over 64 steps (issue 34), host_costs' 091 and training
# rows in the same rounds plus the training block's phases on the device (issue 36), and where a planned cuBLASLt
# call's 18 us of host time goes (w02's dX). Carry .whl .bnb .shared.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
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
R=benchmarks/results/h200-2026-12-04-s25
step lt 60 lt.txt python3 $R/lt_host_probe.py $W/lt.json
step host 170 host.txt python3 benchmarks/host_costs.py --workloads 11,2,15,3 --train-tokens 128,512 --out $J/host
cp $J/host/host_costs.json $W/host_costs.json 2>/dev/null
step glue 90 glue.txt python3 benchmarks/host_glue_training.py --device cuda --tokens 512 --cprofile --out $J/glue
step q06 230 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 \
  --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4 --out $J/q06
cp $J/q06/bench_hf.json $W/q06.json 2>/dev/null
cat $W/lt.txt
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A4 "^training fwd+bwd / two" $W/host.txt
grep -B2 -A22 "^training block fwd+bwd" $W/glue.txt | head -40
tail -9 $W/q06.txt | cut -c1-260
cat $W/status
