#!/usr/bin/env bash
# session 24, device call 3 (tree 73ee9c4 + this script: the LoRA backward's fp32 products, gw_hp's dQKV row
# amaxes from the stage): correctness side by side (GPU tests, gpu_fuzz 200, the graph repro), then alone:
# bench_fp8 with the new providers (issue 35), QLoRA 0.6B interleaved once more (issue 34).
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
step t_fwd 230 t_fwd.txt $PT tests/test_gpu_fused_forward.py tests/test_gpu_graphs.py &
step t_misc 230 t_misc.txt $PT tests/test_gpu_driver_launch.py tests/test_gpu_fast_path.py tests/test_gpu_workspace.py \
  tests/test_gpu_qlora.py tests/test_gpu_targets.py &
step t_fp8 230 t_fp8.txt $PT tests/test_gpu_fp8.py &
step fuzz 230 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 200 --out $J/fuzz &
step graphs 200 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9,8 --old-casts --reps 8 --out $J/fp8
cp $J/fp8/bench_fp8.json $W/fp8.json 2>/dev/null
step q06 140 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 \
  --layers 28 --qlora nf4 --stacks hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 40 --warmup 4 --out $J/q06
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
grep -E "FAIL|PASS|forward:" $W/fuzz.txt | tail -3; tail -3 $W/graphs.txt
tail -22 $W/fp8.txt | cut -c1-200
tail -6 $W/q06.txt | cut -c1-240
cat $W/status
