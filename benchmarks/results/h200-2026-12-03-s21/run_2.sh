#!/usr/bin/env bash
# session 21, device call 2 (call 1 was never started: no machine): the merged tree.
# A, side by side: GPU tests of the LoRA-in-GEMM forward (issue 34), the driver launch (issue 36), FP8 with the
# dual dQKV cast (issue 35) and QLoRA. B alone: bench_lora (fusedqkv = auto, fused_split = off, fused_gemm = on),
# bench_fp8 old vs new casts. Carry .whl .bnb.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
step() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
export PYTHONPATH=src:/tmp/site
PT="python3 -m pytest -q -p no:cacheprovider -rs"
python3 -c "import triton,torch;from fusedqkv.ops import internals as i;print(triton.__version__,torch.__version__,i.fast_path_info())" > $W/info.txt 2>&1
step t_fwd 220 t_fwd.txt $PT tests/test_gpu_fused_forward.py &
step t_launch 220 t_launch.txt $PT tests/test_gpu_driver_launch.py tests/test_gpu_fast_path.py tests/test_gpu_graphs.py tests/test_gpu_workspace.py &
step t_fp8 220 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_qlora.py &
wait
step lora 230 lora.txt python3 benchmarks/bench_lora.py --reps 12 --out $W/lora
step fp8 110 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9,8 --reps 10 --old-casts --out $W/fp8
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -14
tail -11 $W/lora.txt | cut -c1-200
tail -8 $W/fp8.txt | cut -c1-220
cut -c1-400 $W/info.txt
cat $W/status
