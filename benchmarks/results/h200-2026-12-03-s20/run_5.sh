#!/usr/bin/env bash
# session 20, device call 5 (what 341 s of device time allow): the GPU checks of the training forward's bound path
# after its refactor (one _bound_call for both launch kinds): the forward/graph tests and gpu_fuzz, side by side;
# then the block's host timeline with its chunked profile. Carry .shared .whl.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
PT="python3 -m pytest -q -p no:cacheprovider"
timeout 170 $PT tests/test_gpu_fused_forward.py tests/test_gpu_head_dim_512.py > $W/t_fwd.txt 2>&1 &
timeout 170 $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py tests/test_gpu_fast_path.py tests/test_gpu_all_heads.py > $W/t_graphs.txt 2>&1 &
timeout 170 $PT tests/test_gpu_hf_families.py > $W/t_hf.txt 2>&1 &
timeout 170 python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 150 --out $W/fuzz > $W/fuzz.txt 2>&1 &
wait
timeout 60 python3 benchmarks/host_timeline.py --cprofile --calls 200 --out $W/tl > $W/tl.txt 2>&1; echo "tl rc=$?"
tar -czf $OUT/s20_run5.tgz -C $OUT w
tail -qn1 $W/t_*.txt; grep RESULT $W/fuzz.txt; grep -hE "^FAILED|^ERROR" $W/t_*.txt | head
grep -A10 "^host timeline" $W/tl.txt | cut -c1-150
