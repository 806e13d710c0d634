#!/usr/bin/env bash
# Session 44, device call 1 (any card; carry .whl .shared; base43/src = `git archive c420312 src/fusedqkv`,
# untracked, removed after): the GPU tests of session 43's bound cast launches and session 44's side-stream
# casts, the FP8 A/B (overlapped / serial casts, 091 8192 and 32768), the fuzz, and the eager host time.
# (--ab-overlap exists at 5bb02de only: the design was reverted by 3ce9d9d; `git checkout 5bb02de` to re-run.)
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
cat $W/gpu.txt
step gtests 210 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_gpu_fp8.py
step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,9 --reps 10 --ab-overlap --out $W/fp8
step fuzz 90 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 80 --out $J/fuzz
step host 70 host_fp8.txt python3 benchmarks/host_fp8.py --against base43/src --tokens 512,2048,8192 --out $J/host
grep -E "FAILED|Error" $W/gtests.txt | head -20; tail -3 $W/gtests.txt; tail -3 $W/fuzz.txt
grep -A40 "^fwd+bwd host" $W/host_fp8.txt | head -30; grep "JIT launches" $W/host_fp8.txt
grep "overlapped / serial" $W/fp8.txt; tail -5 $W/fp8.txt | cut -c1-200
cat $W/status
