#!/usr/bin/env bash
# session 29, call 3: call 2 showed the chain's dX and dW side by side slower above 128 tokens than one after
# the other (the hybrid: Triton dW, then cuBLAS dX). The chain with its two products in sequence
# (chain_overlap=0), each tile: GPU-only per kernel, then both clocks in the same rounds. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
C="chain_max_tokens=256;chain_min_balance=0"
H="chain_dw_above_128=128,128,32,4,5,2"
V=(--variant "ov128:$C;chain_dx_above_128=128,64,64,4,6,1"
   --variant "sq128:$C;chain_overlap=0;$H;chain_dx_above_128=128,64,64,4,6,1"
   --variant "sq128w8:$C;chain_overlap=0;$H;chain_dx_above_128=128,64,64,8,4,1"
   --variant "sq64:$C;chain_overlap=0;$H;chain_dx_above_128=64,64,64,4,6,2"
   --variant "sq64x128:$C;chain_overlap=0;$H;chain_dx_above_128=64,128,64,4,5,1")
step probe 120 probe.txt python3 benchmarks/chain_token_probe.py --out $W --tokens 128,131,144,192,256 --reps 20 "${V[@]}"
step b091 150 b091.txt python3 benchmarks/bench_091_backward.py --workloads 2,8,11 --reps 30 --rounds 3 --out $J/b091 "${V[@]}"
cp $J/b091/bench_091.json $W/ 2>/dev/null
cat $W/gpu.txt
grep -A40 "^NVIDIA" $W/probe.txt | cut -c1-250
grep -A30 "^variants" $W/b091.txt | cut -c1-160
cat $W/status
