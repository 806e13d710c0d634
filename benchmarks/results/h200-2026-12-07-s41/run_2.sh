#!/usr/bin/env bash
# Session 41, device call (carry .whl .bnb .shared): on any card, the GPU tests of this session's changes (PEFT's
# mixed-batch inference over QLoRA, bnb_4bit_quant_storage=bf16 read as bytes; the graph cases); then, on an H200
# only, run_1.sh's rows (issues 34, 36, 35) in the time left.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
step gtests 150 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py tests/test_gpu_graphs.py
tail -15 $W/gtests.txt | cut -c1-300
if grep -q H200 $W/gpu.txt; then
  step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
  step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
  step host 130 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -22 $W/b091.txt | cut -c1-200
fi
cat $W/status
