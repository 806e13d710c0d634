#!/usr/bin/env bash
# session 23, device call 1: where QLoRA's 0.6B step goes (issue 34) and the training block's host phases
# (issue 36). QLoRA 0.6B E2E with session 22's LoRA rule (the one-launch forward now runs at that shape), the
# profile of the fused QLoRA stack against its dense-qkv bound, then host_timeline --cprofile at 128 tokens.
# Carry .whl .bnb.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
export PYTHONPATH=src:/tmp/site
step qlora06 200 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --stacks hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 20 --out $W/qlora06
step pqlora 200 pqlora.txt python3 benchmarks/profile_hf.py --layers 28 --lora 16 --autocast --qlora nf4 \
  --stacks hf+fusedqkv,hf+fusedqkv:dense-qkv --warmup 3 --timed-steps 6 --profile-steps 1 --out $W/pqlora
step timeline 120 timeline.txt python3 benchmarks/host_timeline.py --tokens 128 --calls 300 --cprofile --out $W/timeline
tail -9 $W/qlora06.txt | cut -c1-260
grep -A18 ": top " $W/pqlora.txt | cut -c1-200 | head -60
tail -24 $W/pqlora.txt | cut -c1-200
ls -la $W/pqlora
cat $W/status
