#!/usr/bin/env bash
# session 22, device call 1: the merged tree (LoRA block B, W's FP8 dual cast) -- the GPU tests that cover them,
# bench_lora (issue 34: fused vs fused_pairs vs the floor), then QLoRA at the 0.6B shape with the dense-qkv bound
# (what any attention input could cut from PEFT's step). Carry .whl .bnb.
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
step t_fwd 200 t_fwd.txt $PT tests/test_gpu_fused_forward.py &
step t_launch 200 t_launch.txt $PT tests/test_gpu_driver_launch.py tests/test_gpu_fast_path.py tests/test_gpu_graphs.py tests/test_gpu_workspace.py &
step t_fp8 200 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_qlora.py &
wait
step lora 150 lora.txt python3 benchmarks/bench_lora.py --reps 12 --out $W/lora
step qlora06 200 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 20 --out $W/qlora06
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -14
tail -12 $W/lora.txt | cut -c1-220
tail -9 $W/qlora06.txt | cut -c1-260
cat $W/status
