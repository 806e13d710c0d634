#!/usr/bin/env bash
# Session 37, device call 1 (any card; carry .whl .bnb .shared).
# On an H200: issue 34's QLoRA 0.6B row (session 35's run_6.sh), then issue 36's rows (host_costs and the user
# clock; session 36's run_2.sh). On any other card: session 36's tree (forward_plan and the HF checks changed
# host paths) through gpu_fuzz 200, the graph cases and the GPU tests of the fast paths.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
  step host 170 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
  echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -22 $W/b091.txt | cut -c1-200
else
  step fuzz 150 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 140 --out $J/fuzz &
  step graphs 150 graphs.txt python3 .shared/repro/cuda_graphs.py &
  wait
  step t_gpu 200 t_gpu.txt python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_fast_path.py \
    tests/test_gpu_head_dim_512.py tests/test_gpu_driver_launch.py tests/test_gpu_workspace.py tests/test_gpu_hf_families.py
  tail -3 $W/graphs.txt; tail -2 $W/fuzz.txt; tail -3 $W/t_gpu.txt; grep -E "^FAILED" $W/t_gpu.txt | head
fi
cat $W/status
