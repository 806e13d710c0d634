#!/usr/bin/env bash
# session 33, call 2: is call 1's bench_lora on the H100 (f/floor 1.073-1.139, 3 of 9 <= 1.10; session 22's H200
# 1.049-1.093, 9 of 9) the card or a regression since then? The same bench on session 22's tree (c0595b8, its own
# src and bench_lora.py, carried as .prev) and on this tree, alternating processes on one machine. Carry .whl .prev.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-420}
cat $W/gpu.txt
step new1 100 new1.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/new1
step old1 100 old1.txt env PYTHONPATH=.prev/src:/tmp/site python3 .prev/benchmarks/bench_lora.py --reps 12 --out $J/old1
step new2 100 new2.txt python3 benchmarks/bench_lora.py --reps 12 --out $J/new2
step old2 100 old2.txt env PYTHONPATH=.prev/src:/tmp/site python3 .prev/benchmarks/bench_lora.py --reps 12 --out $J/old2
for f in new1 old1 new2 old2; do echo "== $f"; grep -A10 "^config" $W/$f.txt | awk '{print $1, $2, $5, $8, $11}'; done
cat $W/status
