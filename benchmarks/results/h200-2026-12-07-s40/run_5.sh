#!/usr/bin/env bash
# Session 40, device call 5 (any card; carry .whl .bnb .shared): every family added this session on the GPU (MuseGlimmer
# text came after call 4; Molmo2 needs transformers 5.25: skipped on the device's 5.17), and the families whose test
# inputs now come from Family.inputs.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-400}
step fams 380 fams.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py
cat $W/gpu.txt; grep -E "passed|failed|FAILED" $W/fams.txt | cut -c1-200 | tail -8; cat $W/status
