#!/usr/bin/env bash
# session 29, call 5: the hybrid's products in the other order: cuBLAS dX right behind the stage, the Triton dW
# a programmatic dependent of dX that waits for it only at its end (hybrid_dx_first=1): do cuBLAS's kernels
# let it start early, side by side with dX (as the chain's two Triton products run)? GPU-only per kernel, then
# both clocks on the hybrid's workloads in the same rounds. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
V=(--variant "dxfirst:hybrid_dx_first=1")
step probe 100 probe.txt python3 benchmarks/chain_token_probe.py --out $W --tokens 131,256,512,1571,2048 --reps 20 "${V[@]}"
step b091 150 b091.txt python3 benchmarks/bench_091_backward.py --workloads 2,8,15,13,3,1,14 --reps 30 --rounds 3 --out $J/b091 "${V[@]}"
cp $J/b091/bench_091.json $W/ 2>/dev/null
cat $W/gpu.txt
grep -A40 "^NVIDIA" $W/probe.txt | cut -c1-250
grep -A30 "^variants" $W/b091.txt | cut -c1-160
cat $W/status
