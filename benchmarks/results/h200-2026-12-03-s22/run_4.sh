#!/usr/bin/env bash
# session 22, device call 4: the final tree (the rowwise stage partials off by default) -- the fuzz (FP8 cases
# drawn), then bench_fp8 on the three rows (every switch against the new path). Carry .shared .whl .bnb.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
timeout 150 python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 130 --out $W/fuzz > $W/fuzz.txt 2>&1; echo "fuzz rc=$?" >> $W/status
grep -E "RESULT|FAIL" $W/fuzz.txt | tail -3
timeout 150 python3 benchmarks/bench_fp8.py --rows 2,9,8 --reps 8 --old-casts --out $W/fp8 > $W/fp8.txt 2>&1; echo "fp8 rc=$?" >> $W/status
tail -16 $W/fp8.txt | cut -c1-240
cat $W/status
