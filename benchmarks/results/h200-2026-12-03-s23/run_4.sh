#!/usr/bin/env bash
# session 23, device call 4: the merged final tree (FP8 one-launch forward rule, QLoRA one-launch dequant, the
# training block's host glue). Correctness side by side (GPU tests, gpu_fuzz 200, the graph repro), then alone:
# host_costs (issue 36), host_glue_training against 57717b0 (.shared/base), bench_hf QLoRA interleaved (issue 34).
# Carry .whl .bnb .shared.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
T0=$(date +%s)
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  if [ $(( t0 - T0 + limit )) -gt 560 ]; then limit=$(( 560 - (t0 - T0) )); fi
  if [ "$limit" -lt 20 ]; then echo "$name skipped (time)" >> "$W/status"; return; fi
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
export PYTHONPATH=src:/tmp/site
PT="python3 -m pytest -q -p no:cacheprovider -rs"
step t_fwd 220 t_fwd.txt $PT tests/test_gpu_fused_forward.py tests/test_gpu_graphs.py &
step t_launch 220 t_launch.txt $PT tests/test_gpu_driver_launch.py tests/test_gpu_fast_path.py tests/test_gpu_workspace.py tests/test_gpu_qlora.py &
step t_fp8 220 t_fp8.txt $PT tests/test_gpu_fp8.py &
step fuzz 220 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 200 --out $W/fuzz &
step graphs 200 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step host 150 host.txt python3 benchmarks/host_costs.py --out $W/host
step qlora06 100 qlora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --qlora nf4 --interleave --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 16 --warmup 4 --out $W/qlora06
step glue 90 glue.txt python3 benchmarks/host_glue_training.py --device cuda --tokens 512 --against .shared/base/src --out $W/glue
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
grep -E "FAIL|PASS|forward:" $W/fuzz.txt | tail -3; tail -3 $W/graphs.txt
grep -A12 "^training fwd+bwd / two torch.mm" $W/host.txt
tail -8 $W/glue.txt | cut -c1-200
tail -9 $W/qlora06.txt | cut -c1-260
cat $W/status
