#!/usr/bin/env bash
# session 22, device call 2: no-regression checks (fuzz 200, the graph repro, the HF GPU tests) side by side, then
# host_costs alone (issue 36: the training block at 128/131/512/1571 tokens, its fwd+bwd interleaved with two
# torch.mm). Carry .shared .whl .bnb.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
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
PT="python3 -m pytest -q -p no:cacheprovider"
step fuzz 280 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 260 --out $W/fuzz &
step graphs 200 graphs.txt python3 .shared/repro/cuda_graphs.py &
step t_hf 250 t_hf.txt $PT tests/test_gpu_hf_families.py tests/test_gpu_all_heads.py tests/test_gpu_head_dim_512.py &
wait
step host 280 host.txt python3 benchmarks/host_costs.py --out $W/host
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -8; grep -E "FAIL|passed" $W/fuzz.txt | tail -3; tail -3 $W/graphs.txt
grep -A12 "^training fwd+bwd / two torch.mm" $W/host.txt
cat $W/status
