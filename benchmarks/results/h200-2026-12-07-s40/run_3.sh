#!/usr/bin/env bash
# Session 40, device call 3 (any card; carry .whl .bnb .shared): the two families added this session (AFMoE, Gemma 4
# unified text) on the GPU: fp32 against HF with generate(), bf16 against fp32; then the PEFT/QLoRA GPU tests.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
step fams 200 fams.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py -k "afmoe or gemma4"
cat $W/gpu.txt; grep -E "passed|failed|FAILED" $W/fams.txt | cut -c1-200 | tail -8; cat $W/status
