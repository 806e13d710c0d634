#!/usr/bin/env bash
# session 35, the budget's last ~500 s: on an H200 only (stops on any other card), the three issues' block rows:
# issue 34's LoRA block (bench_lora), issue 35's >= 8192-token FP8 rows, issue 36's host rows. Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-400}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
step blora 110 blora.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/blora
step fp8 140 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --out $J/fp8
step host 150 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
tail -14 $W/blora.txt | cut -c1-240; tail -5 $W/fp8.txt | cut -c1-220
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
cat $W/status
