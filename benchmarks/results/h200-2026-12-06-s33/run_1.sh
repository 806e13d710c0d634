#!/usr/bin/env bash
# session 33, call 1. On an H200 (the issues' card): issue 36's rows and user clock in one run, then issue 35's
# >= 8192-token rows. On an H100: the no-regression rows of the bf16 block (bench_module, nine rows against eager
# and torch.compile) and of the LoRA block (bench_lora: against PEFT eager, compile and the floor), last run
# sessions 22-23 before the training products changed (sessions 24-29). Carry .whl .shared.
source benchmarks/results/device_setup.sh
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step host 210 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
  step fp8 200 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
  grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
  tail -4 $W/b091.txt | cut -c1-200; tail -24 $W/fp8.txt | cut -c1-220
else
  step module 120 module.txt python3 benchmarks/bench_module.py --reps 15 --out $J/module
  step blora 200 blora.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/blora
  tail -16 $W/module.txt | cut -c1-220; tail -20 $W/blora.txt | cut -c1-240
fi
cat $W/status
