#!/usr/bin/env bash
# session 31, call 2: the Qwen3-0.6B shape at 28 layers with the bf16-noise yardstick (hf-fp32) beside the eager and
# the compile pairs (call 1's compile pair had no yardstick: its loss was judged against a bare 1e-3); then the
# QLoRA NF4 0.6B row of issue 34 (64 steps interleaved), the HF integration's forward path changed in session 30.
# First (CPU, the device's torch 2.11): the compile tests, torchao Float8Linear over the rows among them (new).
# Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-575}
step t_compile 90 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py tests/test_hf_projection_plan.py tests/test_fp8.py \
  -k "compile or forward_set or float8_linears"
step hf28 270 j/k/hf28.txt python3 benchmarks/bench_hf.py --layers 28 --steps 30 --warmup 5 \
  --stacks "hf-fp32,hf,hf+fusedqkv,compile(hf),compile(hf+fusedqkv)" --out $J/hf28
tail -12 $J/hf28.txt > $W/hf28_tail.txt; cp $J/hf28/bench_hf.json $W/hf28.json 2>/dev/null
step qlora06 210 j/k/q06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --interleave --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4 --out $J/q06
tail -12 $J/q06.txt > $W/q06_tail.txt
cat $W/gpu.txt; grep -E "^FAILED|passed|failed" $W/t_compile.txt | cut -c1-200 | head; cat $W/hf28_tail.txt; cat $W/q06_tail.txt; cat $W/status
