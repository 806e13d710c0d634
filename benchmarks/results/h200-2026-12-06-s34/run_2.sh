#!/usr/bin/env bash
# session 34, call 2. Any card: the GPU tests of this session's change (device.capability() and the fp8 probe as
# constants to torch.compile: the torchao float8 inductor compiles through fp8's checks, and the CUDA-graph cases).
# On an H200 first: the three issues' H200 rows (run_1.sh's steps). Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step host 190 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 70 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
  step fp8 170 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
  step blora 100 blora.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/blora
fi
step gputests 150 gputests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py "tests/test_gpu_fp8.py::test_hf_model_with_torchao_float8_compiles_with_inductor"
if grep -q H200 $W/gpu.txt; then
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -4 $W/b091.txt | cut -c1-200; tail -24 $W/fp8.txt | cut -c1-220; tail -14 $W/blora.txt | cut -c1-240
fi
tail -3 $W/gputests.txt
cat $W/status
