#!/usr/bin/env bash
# Session 45, device call 8 (carry .whl .bnb .shared; the budget's last ~300 s): on an H200, issue 34's QLoRA 0.6B
# row alone; on any other card nothing (the GPU tests of this tree ran in calls 1-7).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-250}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step q06 240 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
  echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
fi
cat $W/status
