#!/usr/bin/env bash
# session 30, call 1: session 29's run_6 again on the tree whose hybrid dW behind dX waits at its start (not at its end),
# and whose 091 plan derives its launch order after dX (the review): the user and official clocks with dW first
# as a variant in the same rounds, gpu_fuzz 200, the graph cases and the GPU tests. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
step b091 210 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091 \
  --variant "dwfirst:hybrid_dx_first_max_tokens=0"
cp $J/b091/bench_091.json $W/ 2>/dev/null
step fuzz 150 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 140 --out $J/fuzz &
step graphs 150 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step t_gpu 200 t_gpu.txt python3 -m pytest -q -x tests/test_gpu_graphs.py tests/test_gpu_fast_path.py \
  tests/test_gpu_head_dim_512.py tests/test_gpu_driver_launch.py tests/test_gpu_workspace.py
cat $W/gpu.txt
grep -B2 -A20 "^workload " $W/b091.txt | grep -v "^variants" | cut -c1-200 | head -24
grep -A40 "^variants" $W/b091.txt | cut -c1-160
tail -3 $W/graphs.txt; tail -2 $W/fuzz.txt; tail -3 $W/t_gpu.txt
cat $W/status
