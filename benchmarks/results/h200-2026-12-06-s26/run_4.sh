#!/usr/bin/env bash
# session 26, device call 4: x's cast with fewer rows a column partial against 16 (session 25's launch) in the same
# rounds (bench_fp8 --ab-part-rows), 2048 and 512 tokens. Call 3's fp8_cast_probe timed the host at these sizes
# (every variant ~50-60 us of events, launch-bound): its small rows say nothing; the graphs here do. Carry .whl.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=src:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; J=$OUT/w/j/k; mkdir -p $W $J
nvidia-smi --query-gpu=name --format=csv,noheader > $W/gpu.txt
timeout 300 python3 benchmarks/bench_fp8.py --rows 1,4,7,0,3,6 --reps 12 --ab-part-rows --out $J/fp8 > $W/fp8.txt 2>&1
cp $J/fp8/bench_fp8.json $W/fp8.json 2>/dev/null
cat $W/gpu.txt; grep "pr16" $W/fp8.txt; grep -A8 "^config " $W/fp8.txt
