#!/usr/bin/env bash
# session 23, device call 2 (issue 34, QLoRA at the 0.6B shape): the GPU QLoRA tests with the kept absmax,
# bench_lora --qlora at the 0.6B attention shape (one-launch vs split forward), host_hf --qlora (the host time
# of the attention forwards, kept absmax vs recompute, cProfile), then bench_hf QLoRA 28 layers interleaved.
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
PT="python3 -m pytest -q -p no:cacheprovider -rs"
step t_qlora 150 t_qlora.txt $PT tests/test_gpu_qlora.py tests/test_hf_qlora.py -k "gpu or kept_absmax"
step bqlora 150 bqlora.txt python3 benchmarks/bench_lora.py --qlora nf4 --configs qwen3_0.6b_h1024_q16_kv8 --reps 10 --out $W/bqlora
step blora 150 blora.txt python3 benchmarks/bench_lora.py --configs 091_h4096_q32_kv8,qwen3_0.6b_h1024_q16_kv8 --tokens 2048,8192 --reps 10 --out $W/blora
step hosthf 150 hosthf.txt python3 benchmarks/host_hf.py --device cuda --qlora nf4 --rounds 5 --cprofile --profile-steps 5 --out $W/hosthf
step qlora06 200 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --interleave --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 16 --warmup 4 --out $W/qlora06
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -10
tail -5 $W/bqlora.txt | cut -c1-220
tail -5 $W/blora.txt | cut -c1-220
grep -A60 "cumulative" $W/hosthf.txt | grep -E "fusedqkv|bitsandbytes|peft" | head -40 | cut -c1-160
tail -14 $W/hosthf.txt
tail -9 $W/qlora06.txt | cut -c1-260
cat $W/status
