#!/usr/bin/env bash
# session 21, device call 1: LoRA adapters inside the one-launch Hopper forward (issue 34).
# GPU tests of the fused forward (new LoRA tests) and QLoRA side by side, then bench_lora alone
# (fusedqkv = auto, fused_split = fused_forward off, fused_gemm = on; the nine rows). Carry .whl .bnb.
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
PT="python3 -m pytest -q -p no:cacheprovider"
step t_fwd 200 t_fwd.txt $PT tests/test_gpu_fused_forward.py &
step t_qlora 200 t_qlora.txt $PT tests/test_gpu_qlora.py &
wait
step lora 400 lora.txt python3 benchmarks/bench_lora.py --reps 15 --out $W/lora
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
tail -11 $W/lora.txt | cut -c1-190
cat $W/status
