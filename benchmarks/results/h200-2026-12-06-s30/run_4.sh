#!/usr/bin/env bash
# session 30, call 4: the graph breaks left on the device's torch (call 3: 2 "Graph break" log lines with this tree):
# the CPU compile tests (every family's fused attention with fullgraph=True; PEFT's; changes after compiling refused)
# under this torch, then bench_hf's compile stacks again with the breaks' reasons kept, then the GPU family tests.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
step t_compile 200 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py -k "compile"
step hf_new 200 j/k/hf_new.txt env TORCH_LOGS=graph_breaks python3 benchmarks/bench_hf.py \
  --layers 28 --steps 30 --warmup 5 --stacks "compile(hf),compile(hf+fusedqkv)" --out $J/hf_new
grep -E "Graph break in user code|Explanation|Developer debug|^\[|->|^compile" $J/hf_new.txt | sed 's/.*__graph_breaks\] //' | cut -c1-300 > $W/breaks.txt
step t_gpu_hf 160 t_gpu_hf.txt python3 -m pytest -q -x tests/test_gpu_hf_families.py
cat $W/gpu.txt
grep -E "^FAILED|^E  .*(Explanation|Error|break)|passed|failed" $W/t_compile.txt | cut -c1-250 | head -20
head -40 $W/breaks.txt
tail -3 $W/t_gpu_hf.txt
cat $W/status
