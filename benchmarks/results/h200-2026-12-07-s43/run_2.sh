#!/usr/bin/env bash
# Session 43, device call 2 (any card; carry .whl .shared; base43/src = the change's base, untracked: `mkdir base43 &&
# git archive c420312 src/fusedqkv | tar -x -C base43`, removed after): the FP8
# casts' bound launches -- the GPU tests they touch, the fuzz, and the eager FP8 block's host time against the base.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-380}
cat $W/gpu.txt
step gtests 200 gtests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_gpu_fp8.py
step host 60 host_fp8.txt python3 benchmarks/host_fp8.py --against base43/src --tokens 512,2048,8192 --out $J/host
step fuzz 90 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 80 --out $J/fuzz
tail -5 $W/gtests.txt; tail -4 $W/fuzz.txt
grep -A40 "^fwd+bwd host" $W/host_fp8.txt; grep "JIT launches" $W/host_fp8.txt
cat $W/status
