#!/usr/bin/env bash
# session 25, device call 3: the training backward's Triton products -- host time A/B against the landed tree
# (1126094, carried as .shared/base/src) in the same rounds at 128 (the chain) and 512 tokens (the hybrid), then the
# GPU tests, the fuzz and the graph repro on this tree, side by side (correctness only: no timing beside them).
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
for T in 128 512; do
  step glue$T 70 glue$T.txt python3 benchmarks/host_glue_training.py --device cuda --tokens $T --against .shared/base/src --out $J/glue$T
done
PT="python3 -m pytest -q -p no:cacheprovider -rs"
step t_fwd 300 t_fwd.txt $PT tests/test_gpu_fused_forward.py &
step t_graphs 300 t_graphs.txt $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py &
step t_misc 300 t_misc.txt $PT tests/test_gpu_driver_launch.py tests/test_gpu_fast_path.py tests/test_gpu_all_heads.py \
  tests/test_gpu_head_dim_512.py &
step t_hf 300 t_hf.txt $PT tests/test_gpu_hf_families.py tests/test_gpu_qlora.py &
step fuzz 300 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 270 --out $J/fuzz &
step graphs 200 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
grep -hE "^FAILED|^ERROR|^E  " $W/t_*.txt | head -12
grep -E "FAIL|PASS" $W/fuzz.txt | tail -3; tail -3 $W/graphs.txt
for T in 128 512; do grep -A14 "^whole fwd+bwd steps" $W/glue$T.txt; done
cat $W/status
