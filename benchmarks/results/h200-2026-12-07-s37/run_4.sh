#!/usr/bin/env bash
# Session 37, device call 4 (H200 only; carry .whl .bnb .shared), in the budget's last minutes: issue 34's QLoRA 0.6B
# row alone (run_2.sh's first step).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-240}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step q06 220 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
  --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
  --warmup 4 --out $J/q06
tail -9 $W/q06.txt | cut -c1-260
cat $W/status
