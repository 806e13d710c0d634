#!/usr/bin/env bash
# session 20, device call 2: issue 36's first changes (descriptor memo, gathered addresses, rstd and
# dQKV scratch, one-op views). A: correctness side by side (GPU tests, gpu_fuzz 200, the graph repro);
# B alone: host_costs and host_timeline on this tree and on the session's base (.shared/base/src, d12cf22).
# Carry .shared .whl .bnb.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/  # bitsandbytes 0.50.2 unpacked, without its CUDA 11.8-12.8 libraries
W=$OUT/w; mkdir -p $W
step() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" > "$W/status_$name"
}
export PYTHONPATH=src:/tmp/site
PT="python3 -m pytest -q -p no:cacheprovider"
step t_fp8 300 t_fp8.txt $PT tests/test_gpu_fp8.py tests/test_gpu_qlora.py &
step t_graphs 300 t_graphs.txt $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py tests/test_gpu_fast_path.py &
step t_fwd 300 t_fwd.txt $PT tests/test_gpu_fused_forward.py tests/test_gpu_all_heads.py tests/test_gpu_head_dim_512.py &
step t_hf 300 t_hf.txt $PT tests/test_gpu_hf_families.py &
step fuzz 300 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 280 --out $W/fuzz &
step graphs 300 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step host_new 150 host_new.txt python3 benchmarks/host_costs.py --out $W/host_new
PYTHONPATH=.shared/base/src:/tmp/site step host_base 150 host_base.txt python3 benchmarks/host_costs.py --out $W/host_base
step tl_new 120 tl_new.txt python3 benchmarks/host_timeline.py --out $W/tl_new
PYTHONPATH=.shared/base/src:/tmp/site step tl_base 120 tl_base.txt python3 benchmarks/host_timeline.py --out $W/tl_base
tar -czf $OUT/s20_run2.tgz -C $OUT w
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -12; grep -E "FAIL" $W/fuzz.txt | head -4; tail -3 $W/graphs.txt
for t in new base; do echo "== $t"; grep -E "091 call|two torch.mm|training forward|training fwd" $W/host_$t.txt | grep -v "A/B" | cut -c1-120; grep -A10 "^host timeline" $W/tl_$t.txt | cut -c1-150; done
echo "step       status  time  last line"; cat $W/status_*
