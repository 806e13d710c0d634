#!/usr/bin/env bash
# Session 41, the budget's last ~300 s (carry .whl .bnb .shared): on any card, the GPU tests of this session's
# changes alone (PEFT's mixed batches over the 4-bit block; bnb_4bit_quant_storage=bf16), then the rest of
# test_gpu_qlora.py in the time left.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-170}
cat $W/gpu.txt
step new 110 new.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py -k "mixed_batch or quant_storage"
step qlora 60 qlora.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py -k "not mixed_batch and not quant_storage"
tail -6 $W/new.txt | cut -c1-300; tail -3 $W/qlora.txt | cut -c1-300
cat $W/status
