#!/usr/bin/env bash
# session 29, call 8: would the hybrid's two products gain from running side by side on two streams (cuBLAS's dX
# does not let a programmatic dependent start early: call 5)? The products alone, GPU-only. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-200}
step side 150 side.txt python3 benchmarks/chain_token_probe.py --side-stream --out $W --tokens 131,256,512,1024,1571,2048 --reps 20
cat $W/gpu.txt
grep -A12 "^NVIDIA" $W/side.txt
tail -5 $W/side.txt
cat $W/status
