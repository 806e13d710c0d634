#!/usr/bin/env bash
# Session 42, device call (carry .whl .bnb .shared): on any card, session 41's never-run GPU tests (QLoRA mixed
# batches, bf16 quant storage), the graph cases and the FP8 compile tests (this session's constant-result mark:
# capability() and the CPU probe traced as constants); then, on an H200 only, issue 34's QLoRA 0.6B row, issue
# 36's user clock and host rows, in the time left.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
step gtests 170 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py tests/test_gpu_graphs.py \
  tests/test_gpu_fp8.py::test_hf_model_with_torchao_float8_compiles_with_inductor
tail -15 $W/gtests.txt | cut -c1-300
if grep -q H200 $W/gpu.txt; then
  step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
  step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
  step host 110 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -22 $W/b091.txt | cut -c1-200
fi
cat $W/status
