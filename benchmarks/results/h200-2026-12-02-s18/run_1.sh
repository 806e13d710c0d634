#!/usr/bin/env bash
# session 18, device call 1: the re-runs session 17 left (GPU tests incl. the FP8 and QLoRA graph
# tests, gpu_fuzz --cases 200 with fp8, ../shared/repro/cuda_graphs.py), the host-cost baseline
# (issue 36), LoRA end to end under bf16 autocast (issue 34). Carry .shared .whl_peft .whl_bnb .whl_fp8.
# Phase A runs the correctness checks side by side on the one GPU (no timing in it); B and C alone.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_peft/*.whl \
  .whl_bnb/*.whl .whl_fp8/*.whl > /dev/null 2>&1; export PYTHONPATH=src:/tmp/site
status=()
step() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|RESULT|criteria|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" > "$W/status_$name"
}
PT="python3 -m pytest -q -p no:cacheprovider"
step t_fp8 300 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_qlora.py &
step t_graphs 300 t_graphs.txt $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py tests/test_gpu_fast_path.py &
step t_fwd 300 t_fwd.txt $PT tests/test_gpu_fused_forward.py tests/test_gpu_all_heads.py tests/test_gpu_head_dim_512.py &
step t_hf 300 t_hf.txt $PT tests/test_gpu_hf_families.py &
step fuzz 300 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 280 --out $W/fuzz &
step graphs 300 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step host 100 host.txt python3 benchmarks/host_costs.py --out $W/host
step lora8b 150 lora8b.txt python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --lora-init random --autocast \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $W/lora8b
tar -czf $OUT/s18_run1.tgz -C $OUT w
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -12
grep -E "FAIL" $W/fuzz.txt | head -4
tail -4 $W/graphs.txt; tail -14 $W/host.txt; tail -6 $W/lora8b.txt
echo "step       status  time  last line"; cat $W/status_*
