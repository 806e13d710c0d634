#!/usr/bin/env bash
# session 20, device call 4: A, side by side: the GPU tests of the forward/graph/HF paths and gpu_fuzz 200 (the
# training forward's bound path refactored after call 3); B alone: where the training block's host time goes
# now (host_timeline --cprofile, chunked so the launch queue never fills), and issue 34's 0.6B LoRA step with
# the fp32 yardstick (the loss tolerance), on this tree and on the base (d12cf22, .shared/base/src) in the
# same call. Carry .shared .whl.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
PT="python3 -m pytest -q -p no:cacheprovider"
timeout 200 $PT tests/test_gpu_fused_forward.py tests/test_gpu_all_heads.py tests/test_gpu_head_dim_512.py > $W/t_fwd.txt 2>&1 &
timeout 200 $PT tests/test_gpu_graphs.py tests/test_gpu_workspace.py tests/test_gpu_fast_path.py tests/test_gpu_fp8.py > $W/t_graphs.txt 2>&1 &
timeout 200 $PT tests/test_gpu_hf_families.py > $W/t_hf.txt 2>&1 &
timeout 200 python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 180 --out $W/fuzz > $W/fuzz.txt 2>&1 &
wait
timeout 90 python3 benchmarks/host_timeline.py --cprofile --out $W/tl > $W/tl.txt 2>&1; echo "tl rc=$?"
L="--family qwen3 --layers 28 --lora 16 --lora-init random --autocast --steps 30"
timeout 200 python3 benchmarks/bench_hf.py $L --stacks hf-fp32,hf,hf+fusedqkv --out $W/lora06 > $W/lora06.txt 2>&1; echo "lora06 rc=$?"
PYTHONPATH=.shared/base/src:/tmp/site timeout 120 python3 benchmarks/bench_hf.py $L --stacks hf,hf+fusedqkv --out $W/lora06_base > $W/lora06_base.txt 2>&1; echo "lora06 base rc=$?"
tar -czf $OUT/s20_run4.tgz -C $OUT w
tail -qn1 $W/t_*.txt; grep RESULT $W/fuzz.txt; grep -hE "^FAILED|^ERROR" $W/t_*.txt | head
grep -A10 "^host timeline" $W/tl.txt | cut -c1-150; tail -7 $W/lora06.txt; tail -6 $W/lora06_base.txt
