#!/usr/bin/env bash
# session 31, call 4 (the budget's last ~380 s after refused starts): run_3.sh's tests only -- the CPU compile tests
# under the device's torch 2.11 (Float8Linear and QLoRA ones new) beside the GPU FP8 tests (the inductor test new).
# Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-200}
step t_compile 100 t_compile.txt env TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
  tests/test_hf_families.py tests/test_hf_peft.py tests/test_hf_projection_plan.py tests/test_fp8.py tests/test_hf_qlora.py \
  -k "compile or forward_set or float8_linears" &
( step t_hf_fp8 60 t_hf_fp8.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k hf_model_with_torchao
  step t_gpu_fp8 100 j/k/t_gpu_fp8.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "not hf_model_with_torchao" ) &
wait
cat $W/gpu.txt
grep -E "^FAILED|passed|failed" $W/t_compile.txt | cut -c1-200 | head -5
grep -E "^FAILED|^E .*Error|passed|failed" $W/t_hf_fp8.txt $J/t_gpu_fp8.txt | cut -c1-250 | head -12
cat $W/status
