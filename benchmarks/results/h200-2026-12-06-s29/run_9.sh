#!/usr/bin/env bash
# session 29, call 9: the HF families on the GPU under transformers 5.25 (the current release; the device has 5.17):
# the six 5.25 newcomers (never run on a GPU) and every other family, fp32 against HF and bf16 three-way
# (tests/test_gpu_hf_families.py). Carry .whl525 (transformers 5.25.0, huggingface_hub 2.4.0, tokenizers 0.23.3,
# kernels 0.19.1).
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site525 .whl525/*.whl > $W/pip.txt 2>&1
export PYTHONPATH=/tmp/site525:src
python3 -c "import transformers, torch; print('transformers', transformers.__version__, torch.cuda.get_device_name())" | tee $W/versions.txt
timeout 240 python3 -m pytest -q tests/test_gpu_hf_families.py -k "apertus1p5 or lara_mini or lfm3 or flint or beam or muse_spark" -rA > $W/new.txt 2>&1
timeout 280 python3 -m pytest -q tests/test_gpu_hf_families.py > $W/all.txt 2>&1
grep -E "PASSED|FAILED|SKIPPED|ERROR" $W/new.txt | cut -c1-150; tail -2 $W/new.txt
tail -15 $W/all.txt | cut -c1-200
