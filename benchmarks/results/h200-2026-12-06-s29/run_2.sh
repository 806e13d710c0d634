#!/usr/bin/env bash
# session 29, call 2: why the chain is slow at 131 tokens and not at 256 (call 1): each kernel of the 091 call,
# GPU-only, at 128..256 tokens, hybrid (default) against the chain with both dX tiles. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
C="chain_max_tokens=256;chain_min_balance=0"
step probe 240 probe.txt python3 benchmarks/chain_token_probe.py --out $W --tokens 128,131,136,144,160,192,224,256 --reps 20 \
  --variant "c64:$C" --variant "c128:$C;chain_dx_above_128=128,64,64,4,6,1"
cat $W/gpu.txt
grep -A40 "^NVIDIA" $W/probe.txt | cut -c1-250
tail -5 $W/probe.txt
cat $W/status
