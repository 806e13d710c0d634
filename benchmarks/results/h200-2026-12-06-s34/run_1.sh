#!/usr/bin/env bash
# session 34, call 1: on an H200 (the issues' card) only, all three issues' H200 rows in one run: issue 36's host
# rows and user clock, issue 35's >= 8192-token FP8 rows, issue 34's LoRA block rows. On any other card it stops
# at once (the H100 measured all of these in sessions 26-33, with no code change since). Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
step fp8 190 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,5,8,9 --reps 12 --out $J/fp8
step blora 110 blora.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/blora
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -4 $W/b091.txt | cut -c1-200; tail -24 $W/fp8.txt | cut -c1-220; tail -14 $W/blora.txt | cut -c1-240
cat $W/status
