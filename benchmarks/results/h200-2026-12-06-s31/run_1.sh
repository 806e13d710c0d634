#!/usr/bin/env bash
# session 31, call 1: GPU correctness of session 30's review (the training plan's hybrid launches as two lists):
# gpu_fuzz 200, the graph cases and the GPU tests of the products' paths; beside them (CPU) the compile tests under
# the device's torch 2.11; then session 30's run_5: bench_hf's compile stacks at 28 layers with the graph breaks' reasons.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-580}
step fuzz 150 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 140 --out $J/fuzz &
step graphs 150 graphs.txt python3 .shared/repro/cuda_graphs.py &
step t_compile 150 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py tests/test_hf_projection_plan.py -k "compile or forward_set" &
wait
step t_gpu 150 j/k/t_gpu.txt python3 -m pytest -q -x tests/test_gpu_graphs.py tests/test_gpu_fast_path.py \
  tests/test_gpu_head_dim_512.py tests/test_gpu_driver_launch.py tests/test_gpu_workspace.py
step hf_new 230 j/k/hf_new.txt env TORCH_LOGS=graph_breaks python3 benchmarks/bench_hf.py \
  --layers 28 --steps 30 --warmup 5 --stacks "compile(hf),compile(hf+fusedqkv)" --out $J/hf_new
grep -E "Graph break in user code|Explanation|Developer debug|^\[|->|^compile" $J/hf_new.txt | sed 's/.*__graph_breaks\] //' | cut -c1-300 > $W/breaks.txt
tail -40 $J/hf_new.txt > $W/hf_tail.txt
cat $W/gpu.txt
grep -E "^FAILED|^E  .*(Explanation|Error|break)|passed|failed" $W/t_compile.txt | cut -c1-250 | head -20
tail -3 $W/graphs.txt; tail -2 $W/fuzz.txt; tail -3 $J/t_gpu.txt
grep -E "^FAILED" $J/t_gpu.txt | head
head -30 $W/breaks.txt
cat $W/status
