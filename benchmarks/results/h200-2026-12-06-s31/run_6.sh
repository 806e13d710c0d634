#!/usr/bin/env bash
# session 31, call 6: as call 5 at 2 x 2048 tokens (hf-fp32 fits): the compile pair judged against the bf16 noise.
source benchmarks/results/device_setup.sh; TOTAL=175 step hf28 170 hf28.txt python3 benchmarks/bench_hf.py --layers 28 --batch 2 --steps 20 --warmup 5 --stacks "hf-fp32,hf,compile(hf),compile(hf+fusedqkv)" --out $J/hf28; tail -9 $W/hf28.txt; cat $W/status
