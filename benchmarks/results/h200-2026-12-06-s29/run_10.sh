#!/usr/bin/env bash
# session 29, call 10: call 9 again after its two findings: the GPU family tests now take each family's attention
# implementation (Flint: HF's eager only), and Kolibri's bf16 three-way skips, naming HF's own bf16 error, where no
# gradient of the block is judgeable. Transformers 5.25 (carry .whl525), then the device's own 5.17.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site525 .whl525/*.whl > $W/pip.txt 2>&1
PYTHONPATH=/tmp/site525:src timeout 200 python3 -m pytest -q tests/test_gpu_hf_families.py -rs > $W/all525.txt 2>&1
PYTHONPATH=src timeout 200 python3 -m pytest -q tests/test_gpu_hf_families.py -rs > $W/all517.txt 2>&1
for f in all525 all517; do echo "== $f"; grep -E "SKIPPED|FAILED" $W/$f.txt | cut -c1-220; tail -1 $W/$f.txt; done
