#!/usr/bin/env bash
# session 31, call 5 (typed as the run command, the machine still warm after call 4): the 28-layer pairs with the
# bf16-noise yardstick at 4 x 2048 tokens. hf-fp32 ran out of the H100's 80 GB (call 6 halves the batch).
source benchmarks/results/device_setup.sh; TOTAL=190 step hf28 185 hf28.txt python3 benchmarks/bench_hf.py --layers 28 --steps 20 --warmup 5 --stacks "hf-fp32,hf,compile(hf),compile(hf+fusedqkv)" --out $J/hf28; tail -8 $W/hf28.txt; cat $W/status
