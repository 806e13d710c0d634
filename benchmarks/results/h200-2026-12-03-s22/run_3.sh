#!/usr/bin/env bash
# session 22, device call 3: the merged FP8 changes (dQKV's amax partials from the stage, x's amaxes kept) and the
# LoRA plans' new rule -- their GPU tests, the fuzz (it draws FP8 cases), then bench_fp8 (--old-casts: every switch
# against the new path in one run) and bench_lora. Carry .whl .bnb.
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
step t_fp8 200 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_graphs.py &
step t_fwd 200 t_fwd.txt $PT tests/test_gpu_fused_forward.py -k "auto_takes or lora" &
step fuzz 200 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 180 --out $W/fuzz &
wait
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -10; cat $W/status
step fp8 170 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9,8 --reps 10 --old-casts --profile --out $W/fp8
tail -16 $W/fp8.txt | cut -c1-240
step lora 150 lora.txt python3 benchmarks/bench_lora.py --reps 12 --out $W/lora
tail -10 $W/lora.txt | cut -c1-200
cat $W/status
