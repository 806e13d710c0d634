#!/usr/bin/env bash
# Session 40, device call 4 (any card; carry .whl .bnb .shared): MiniMax M3 text (added after call 3) and Kolibri's
# indexer hook (its signature changed) on the GPU, with the other new families again.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-300}
step fams 240 fams.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py \
  -k "minimax or afmoe or gemma4_unified or kolibri"
cat $W/gpu.txt; grep -E "passed|failed|FAILED" $W/fams.txt | cut -c1-200 | tail -8; cat $W/status
