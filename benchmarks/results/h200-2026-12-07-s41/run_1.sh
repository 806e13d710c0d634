#!/usr/bin/env bash
# Session 41, device call (carry .whl .bnb .shared): on an H200 only, the three issues' open H200 rows in one call:
# issue 34's QLoRA 0.6B row, issue 36's user clock and host rows (session 37's run_2.sh), then issue 35's FP8 block
# rows at >= 8192 tokens; any other card stops at once.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
  --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
  --warmup 4 --out $J/q06
step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
step host 150 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step fp8 130 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --out $J/fp8
echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/b091.txt | cut -c1-200
tail -5 $W/fp8.txt | cut -c1-220
cat $W/status
