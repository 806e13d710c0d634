#!/usr/bin/env bash
# session 18, device call 4: issue 35's block-alone table in one run (bench_fp8 on the nine rows and
# 1 x 32768, both floors, the three recipes, torchao + compile). Carry .shared .whl_fp8.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_fp8/*.whl \
  > /dev/null 2>&1; export PYTHONPATH=src:/tmp/site
timeout 420 python3 benchmarks/bench_fp8.py --reps 10 --out $W/fp8 > $W/fp8.txt 2>&1; echo "bench_fp8 rc=$?"
tar -czf $OUT/s18_run4.tgz -C $OUT w
tail -20 $W/fp8.txt
