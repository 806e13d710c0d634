#!/usr/bin/env bash
# session 20, device call 3: the merged tree (issue 36 host path + the HF integration's kept plans).
# A, side by side: GPU tests, gpu_fuzz 200, the graph repro, and the FP8 graph test that aborted at exit
# in call 2 (rowwise_with_gw_hp), three times on this tree and three on the base (d12cf22, .shared/base).
# B alone: host_costs, host_timeline, host_hf --device cuda, bench_hf LoRA end to end (issue 34).
# Carry .shared .whl .bnb.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/  # bitsandbytes 0.50.2 unpacked, without its CUDA 11.8-12.8 libraries
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
G="test_block_in_a_cuda_graph_equals_eager_and_repeats_bitwise"
step t_fp8 300 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_qlora.py &
step t_graphs 300 t_graphs.txt $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py tests/test_gpu_fast_path.py &
step t_fwd 300 t_fwd.txt $PT tests/test_gpu_fused_forward.py tests/test_gpu_all_heads.py tests/test_gpu_head_dim_512.py &
step t_hf 300 t_hf.txt $PT tests/test_gpu_hf_families.py &
step fuzz 300 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 280 --out $W/fuzz &
step graphs 300 graphs.txt python3 .shared/repro/cuda_graphs.py &
(for i in 1 2 3; do step gwhp_new$i 120 gwhp_new$i.txt $PT tests/test_gpu_fp8.py -k "$G"; done) &
(cd .shared/base && for i in 1 2 3; do PYTHONPATH=src:/tmp/site step gwhp_base$i 120 gwhp_base$i.txt $PT tests/test_gpu_fp8.py -k "$G"; done) &
wait
step host 150 host.txt python3 benchmarks/host_costs.py --out $W/host
step tl 60 tl.txt python3 benchmarks/host_timeline.py --out $W/tl
step host_hf 150 host_hf.txt python3 benchmarks/host_hf.py --device cuda --out $W/host_hf
step lora06 180 lora06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --stacks hf,hf+fusedqkv --steps 30 --out $W/lora06
tar -czf $OUT/s20_run3.tgz -C $OUT w
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -12; grep -E "FAIL" $W/fuzz.txt | head -4; tail -3 $W/graphs.txt
grep -E "091 call|two torch.mm|training forward|training fwd" $W/host.txt | grep -v "A/B" | grep -v "^  " | cut -c1-120
grep -A10 "^host timeline" $W/tl.txt | cut -c1-150; tail -14 $W/host_hf.txt; tail -8 $W/lora06.txt
cat $W/status
