#!/usr/bin/env bash
# session 29, call 4: the hybrid's CUDA events exceed its span by up to 30-60 % on some runs (calls 1 and 3:
# w02 1.17 / 1.36x, w08 1.68 / 1.20x the floor) while the chain's stay at its span. The events' own loop with
# the host's time per iteration and per call stamped: hybrid (cuBLASLt dX), hybrid with torch.mm dX, the
# chain side by side and the chain in sequence. Carry .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
C="chain_max_tokens=256;chain_min_balance=0"
V=(--variant "mm:cublaslt=0"
   --variant "ov128:$C;chain_dx_above_128=128,64,64,4,6,1"
   --variant "sq64x128:$C;chain_overlap=0;chain_dw_above_128=128,128,32,4,5,2;chain_dx_above_128=64,128,64,4,5,1")
step loop 150 loop.txt python3 benchmarks/chain_token_probe.py --events-loop --out $W --tokens 131,256,512 --reps 30 --rounds 4 "${V[@]}"
step loop2 100 loop2.txt python3 benchmarks/chain_token_probe.py --events-loop --out $J --tokens 131,256 --reps 30 --rounds 4 "${V[@]}"
cat $W/gpu.txt
grep -A20 "^NVIDIA" $W/loop.txt | cut -c1-250
grep -A20 "^NVIDIA" $W/loop2.txt | cut -c1-250
cat $W/status
