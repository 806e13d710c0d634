#!/usr/bin/env bash
# session 24, device call 1 (tree 78efef3): where the 0.6B QLoRA step's host time goes now (issue 34: the
# profile of the fused stack against its dense-qkv bound, host_hf's Python profile, a 32-step interleaved
# baseline) and whether host_costs' training rows depend on their order (issue 36: 128/131 run again last).
# Carry .whl .bnb .shared.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
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
export PYTHONPATH=src:/tmp/site
step pqlora 120 pqlora.txt python3 benchmarks/profile_hf.py --layers 28 --lora 16 --autocast --qlora nf4 \
  --stacks hf+fusedqkv,hf+fusedqkv:dense-qkv --warmup 3 --timed-steps 6 --profile-steps 1 --out $W/pqlora
step host 200 host.txt python3 benchmarks/host_costs.py --workloads "" --train-tokens 128,131,512,1571,128,131 --out $W/host
step hosthf 120 hosthf.txt python3 benchmarks/host_hf.py --device cuda --qlora nf4 --cprofile --out $W/hosthf
step qlora06 160 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --interleave --stacks hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 32 --warmup 4 --out $W/qlora06
grep -E "training fwd\+bwd / two" $W/host.txt
tail -24 $W/pqlora.txt | cut -c1-200
tail -9 $W/qlora06.txt | cut -c1-260
cat $W/status
