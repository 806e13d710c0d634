#!/usr/bin/env bash
# session 30, call 5: after call 4 (torch 2.11 broke the graph at list(module.__dict__.keys())): the read only
# from torch 2.13 on (ops.internals.TRACES_MODULE_DICT_KEYS). The CPU compile tests under the device's torch,
# then bench_hf's compile stacks, Qwen3-0.6B shape, 28 layers, with the graph breaks' reasons kept.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-420}
step t_compile 150 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py tests/test_hf_projection_plan.py -k "compile or forward_set"
step hf_new 230 j/k/hf_new.txt env TORCH_LOGS=graph_breaks python3 benchmarks/bench_hf.py \
  --layers 28 --steps 30 --warmup 5 --stacks "compile(hf),compile(hf+fusedqkv)" --out $J/hf_new
grep -E "Graph break in user code|Explanation|Developer debug|^\[|->|^compile" $J/hf_new.txt | sed 's/.*__graph_breaks\] //' | cut -c1-300 > $W/breaks.txt
cat $W/gpu.txt
grep -E "^FAILED|^E  .*(Explanation|Error|break)|passed|failed" $W/t_compile.txt | cut -c1-250 | head -20
head -30 $W/breaks.txt
cat $W/status
