#!/usr/bin/env bash
# session 26, device call 2: the FP8 cast kernels' launch shapes at small token counts (fp8_cast_probe.py).
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=src
W=$OUT/w; mkdir -p $W
timeout 400 python3 benchmarks/fp8_cast_probe.py --out $W > $W/probe.txt 2>&1; echo "rc=$?" >> $W/probe.txt
cat $W/probe.txt | tail -60
