#!/usr/bin/env bash
# session 24, device call 2 (tree with the LoRA backward's fp32 dA/dB products): GPU tests of the LoRA/QLoRA
# paths, host_hf QLoRA with the per-pair products as an A/B in the same rounds, then the end-to-end rows
# interleaved (issue 34): QLoRA 0.6B x 28 layers (48 steps), QLoRA 8B x 4 layers, LoRA 0.6B x 28 layers.
# Carry .whl .bnb .shared.
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
PT="python3 -m pytest -q -p no:cacheprovider -rs"
HF="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave"
step t_lora 150 t_lora.txt $PT tests/test_gpu_qlora.py tests/test_gpu_fused_forward.py -k "lora or qlora or fp32_adapters"
step hosthf 110 hosthf.txt python3 benchmarks/host_hf.py --device cuda --qlora nf4 --out $J/hosthf
step q06 150 q06.txt $HF --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv \
  --steps 48 --warmup 4 --out $J/q06
cp $J/q06/bench_hf.json $W/q06.json 2>/dev/null
step q8b 90 q8b.txt $HF --family qwen3_8b --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --warmup 4 --out $J/q8b
step l06 90 l06.txt $HF --family qwen3 --layers 28 --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --warmup 4 --out $J/l06
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
tail -12 $W/hosthf.txt
for f in q06 q8b l06; do echo "== $f"; tail -7 $W/$f.txt | cut -c1-260; done
cat $W/status
