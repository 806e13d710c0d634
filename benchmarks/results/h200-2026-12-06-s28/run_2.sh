#!/usr/bin/env bash
# session 28, call 2: issue 36's done-when in one run on one tree (d3474df's src): host_costs (the issue's
# 091 and training rows, interleaved with two torch.mm), the user clock (bench_091_backward: CUDA events, cold L2,
# 16 workloads), then the graph cases and gpu_fuzz 200 side by side (correctness only). Carry .whl .shared.
source benchmarks/results/device_setup.sh
step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 190 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
step fuzz 150 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 140 --out $J/fuzz &
step graphs 150 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
step t_graphs 120 t_graphs.txt python3 -m pytest -q -x tests/test_gpu_graphs.py
cat $W/gpu.txt
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/b091.txt | cut -c1-200
tail -3 $W/graphs.txt; tail -2 $W/fuzz.txt
cat $W/status
