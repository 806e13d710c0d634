#!/usr/bin/env bash
# session 26, device call 3 (one start: the lent machines were scarce): the FP8 cast kernels' launch shapes
# (fp8_cast_probe: session 25's launch vs the plan's, x's cast with fewer rows per partial), bench_fp8 at 2048 and
# 512 tokens with the change, then the GPU FP8 tests, the fuzz and the graph repro. Carry .whl .shared.
TOTAL=580
source benchmarks/results/device_setup.sh  # (as session 27 factored it out)
step probe 150 probe.txt python3 benchmarks/fp8_cast_probe.py --reps 30 --out $J/probe
cp $J/probe/fp8_cast_probe.json $W/probe.json 2>/dev/null
step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 1,4,7,0,3,6 --reps 12 --out $J/fp8
cp $J/fp8/bench_fp8.json $W/fp8.json 2>/dev/null
PT="python3 -m pytest -q -p no:cacheprovider -rs"
step t_fp8 250 t_fp8.txt $PT tests/test_gpu_fp8.py &
step fuzz 250 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 230 --out $J/fuzz &
step graphs 200 graphs.txt python3 .shared/repro/cuda_graphs.py &
wait
cat $W/gpu.txt
grep -E "colamax" $W/probe.txt | head -48
grep -E "^dual" $W/probe.txt | head -30
grep -A8 "^config " $W/fp8.txt
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -12
grep -E "FAIL|PASS" $W/fuzz.txt | tail -2; tail -2 $W/graphs.txt
cat $W/status
