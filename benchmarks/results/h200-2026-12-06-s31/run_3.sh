#!/usr/bin/env bash
# session 31, call 3 (call 2 never started: the device refused): (CPU, the device's torch 2.11) the compile tests,
# torchao Float8Linear over the rows among them, beside the GPU FP8 tests (new: the three torchao ways under inductor);
# then issue 35's end to end (Qwen3-8B shape, 4 layers, torchao float8 rowwise, both compiled, 100 steps), last run in
# session 18 (-3.2 %) when the fused attention still broke the graph (QLoRA compile tests too: carry .bnb); then the Qwen3-0.6B shape at 28 layers with
# the bf16-noise yardstick beside the eager and compile pairs (cut first where the budget is short: TOTAL). Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-585}
step t_compile 100 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py tests/test_hf_projection_plan.py tests/test_fp8.py tests/test_hf_qlora.py \
  -k "compile or forward_set or float8_linears" &
( step t_hf_fp8 60 j/k/t_hf_fp8.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k hf_model_with_torchao
  step t_gpu_fp8 90 j/k/t_gpu_fp8.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "not hf_model_with_torchao" ) &
wait
step fp8_8b 250 j/k/fp8.txt python3 benchmarks/bench_hf.py --family qwen3_8b --fp8 rowwise --lr 1e-4 \
  --stacks "${FP8_STACKS:-hf-bf16,compile(hf-bf16),compile(hf),compile(hf+fusedqkv)}" --steps 100 --out $J/fp8
tail -12 $J/fp8.txt > $W/fp8_tail.txt; cp $J/fp8/bench_hf.json $W/fp8.json 2>/dev/null
[ -n "$SKIP_HF28" ] || step hf28 240 j/k/hf28.txt python3 benchmarks/bench_hf.py --layers 28 --steps 30 --warmup 5 \
  --stacks "hf-fp32,hf,hf+fusedqkv,compile(hf),compile(hf+fusedqkv)" --out $J/hf28
tail -12 $J/hf28.txt > $W/hf28_tail.txt; cp $J/hf28/bench_hf.json $W/hf28.json 2>/dev/null
cat $W/gpu.txt
grep -E "^FAILED|passed|failed" $W/t_compile.txt | cut -c1-200 | head -5
grep -E "^FAILED|^E .*Error|passed|failed" $J/t_hf_fp8.txt $J/t_gpu_fp8.txt | cut -c1-250 | head -12
cat $W/hf28_tail.txt; cat $W/fp8_tail.txt; cat $W/status
