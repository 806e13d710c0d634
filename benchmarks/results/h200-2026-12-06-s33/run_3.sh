#!/usr/bin/env bash
# session 33, call 3. On an H200 (the issues' card): issue 36's rows and user clock in one run, then issue 35's
# >= 8192-token rows (as run_1.sh). On an H100: this session's hook change on the device's torch 2.11 -- the CPU
# tests of what sits in the projection's place (the PEFT, projection-plan and torchao files, with torchao) -- and
# the GPU compile/graph tests (inductor: test_gpu_graphs.py, the torchao float8 compile test). Carry .whl .shared.
source benchmarks/results/device_setup.sh
cat $W/gpu.txt
python3 -c "import torch; print('torch', torch.__version__)" >> $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step host 210 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
  step fp8 200 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -4 $W/b091.txt | cut -c1-200; tail -24 $W/fp8.txt | cut -c1-220
else
  step cpu211 200 cpu211.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= PYTHONPATH=src:tests:/tmp/site python3 -m pytest -q -rfs -p no:cacheprovider tests/test_hf_peft.py tests/test_hf_projection_plan.py tests/test_fp8.py -k "not gpu"
  step gputests 240 gputests.txt env PYTHONPATH=src:tests:/tmp/site python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_graphs.py "tests/test_gpu_fp8.py::test_hf_model_with_torchao_float8_compiles_with_inductor"
  tail -6 $W/cpu211.txt | cut -c1-200; tail -6 $W/gputests.txt | cut -c1-200
fi
cat $W/status
