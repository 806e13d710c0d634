#!/usr/bin/env bash
# session 32, call 2: issue 34's QLoRA 0.6B row (64 steps interleaved; last run in session 27), and on an H200
# issue 36's rows if call 1 did not get them. Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-575}
step qlora06 230 j/k/q06.txt python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random \
  --autocast --interleave --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4 --out $J/q06
tail -12 $J/q06.txt > $W/q06_tail.txt
if grep -q H200 $W/gpu.txt && [ -z "$SKIP_HOST" ]; then
  step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
fi
cat $W/gpu.txt; cat $W/q06_tail.txt
[ -f $W/host.txt ] && { grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt; tail -4 $W/b091.txt | cut -c1-200; }
cat $W/status
