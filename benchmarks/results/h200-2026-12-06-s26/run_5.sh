#!/usr/bin/env bash
# session 26, prepared for device call 5 (not run: the session's device budget was spent): config.fp8_frozen_weight_cache (a frozen W's FP8 casts kept across eager calls) against
# the uncached path, eager, events, interleaved (bench_fp8_frozen.py), plus its GPU test. Carry .whl.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=src:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; J=$OUT/w/j/k; mkdir -p $W $J
nvidia-smi --query-gpu=name --format=csv,noheader > $W/gpu.txt
timeout 100 python3 benchmarks/bench_fp8_frozen.py --rows 1,4,0,2 --reps 30 --out $J/frozen > $W/frozen.txt 2>&1
cp $J/frozen/bench_fp8_frozen.json $W/frozen.json 2>/dev/null
cat $W/gpu.txt; tail -7 $W/frozen.txt
