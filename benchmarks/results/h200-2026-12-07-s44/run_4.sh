#!/usr/bin/env bash
# Session 44, device call 4 (carry .whl .bnb .shared; the budget's last ~260 s): on an H200, issue 34's QLoRA 0.6B
# row alone; on an H100, the FP8 and fast-path GPU tests of the final tree (id(fn) in TensorLaunches' key).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-260}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step q06 240 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
  echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
else
  step gtests 230 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_gpu_fp8.py
  grep -E "FAILED|Error" $W/gtests.txt | head -20; tail -2 $W/gtests.txt
fi
cat $W/status
