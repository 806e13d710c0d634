#!/usr/bin/env bash
# session 28, call 3: issue 34's QLoRA 0.6B end to end twice more (as is), issue 35's >= 8192-token rows
# (bench_fp8: rowwise and rowwise_with_gw_hp against the bf16 and FP8 floors and torchao, one run).
# Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
Q="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 --layers 28 \
  --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4"
step fp8 200 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
step q06a 165 q06a.txt $Q --out $J/q06a
step q06b 165 q06b.txt $Q --out $J/q06b
cat $W/gpu.txt
for f in q06a q06b; do echo "== $f"; tail -9 $W/$f.txt | cut -c1-260; done
tail -30 $W/fp8.txt | cut -c1-220
cat $W/status
