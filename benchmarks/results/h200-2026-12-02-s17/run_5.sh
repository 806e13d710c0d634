#!/usr/bin/env bash
# session 17, device call 5 (the merged tree): Gemma 4's global layer (issue 38), the GPU tests (FP8, head_dim 512,
# QLoRA, graphs, ...), gpu_fuzz --cases 200 (fp8, k_eq_v and 512 drawn), the LoRA block and QLoRA (issue 34),
# bench_fp8 on the h5120 rows. Carry .shared .whl_peft (peft 0.21.2) .whl_bnb .whl_fp8.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_peft/*.whl .whl_bnb/*.whl \
  .whl_fp8/*.whl > /dev/null 2>&1; export PYTHONPATH=src:/tmp/site
status=()
step() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  status+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|RESULT|criteria' "$W/$log" | tail -1 | cut -c1-100)")")
}
step gemma4 95 gemma4.txt python3 benchmarks/bench_families.py --families gemma4_text --tokens 1x2048,4x2048 --reps 20 \
  --out $W/gemma4
step gpu_tests 150 gpu_tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py \
  tests/test_gpu_head_dim_512.py tests/test_gpu_qlora.py tests/test_gpu_graphs.py tests/test_gpu_fused_forward.py \
  tests/test_gpu_workspace.py tests/test_gpu_all_heads.py tests/test_gpu_fast_path.py tests/test_gpu_hf_families.py
step fuzz 105 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 90 --out $W/fuzz
step lora 85 lora.txt python3 benchmarks/bench_lora.py --out $W/lora --reps 20
step qlora 50 qlora.txt python3 benchmarks/bench_lora.py --qlora nf4 --configs 091_h4096_q32_kv8 --out $W/qlora --reps 20
step fp8 50 fp8.txt python3 benchmarks/bench_fp8.py --reps 10 --rows 7,8 --out $W/fp8
tar -czf $OUT/s17_run5.tgz -C $OUT w
grep -E "^FAILED|^ERROR" $W/gpu_tests.txt | head -8
grep -E "FAIL" $W/fuzz.txt | head -4
tail -5 $W/gemma4.txt; tail -10 $W/lora.txt; tail -5 $W/qlora.txt; tail -3 $W/fp8.txt
printf '%s\n' "step       status  time  last line" "${status[@]}"
