#!/usr/bin/env bash
# session 23, device call 3: the FP8 one-launch forward (issue 35) and QLoRA's kept absmax + one-launch NF4
# dequantization + the LoRA block rule (issue 34): their GPU tests, bench_fp8 (every switch, the split FP8
# forward beside), bench_hf QLoRA 28 layers interleaved. Carry .whl .bnb.
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
step t_ffp8 200 t_ffp8.txt $PT -rP tests/test_gpu_fused_forward.py -k "fp8 or lora" &
step t_fp8 200 t_fp8.txt $PT tests/test_gpu_fp8.py &
step t_qlora 200 t_qlora.txt $PT tests/test_gpu_qlora.py &
wait
step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9,8 --old-casts --reps 8 --out $W/fp8
step qlora06 200 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --interleave --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 16 --warmup 4 --out $W/qlora06
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
grep -hE "bitwise|ulp" $W/t_ffp8.txt | head -8 | cut -c1-200
tail -16 $W/fp8.txt | cut -c1-230
tail -9 $W/qlora06.txt | cut -c1-260
cat $W/status
