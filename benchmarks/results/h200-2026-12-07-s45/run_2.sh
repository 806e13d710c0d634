#!/usr/bin/env bash
# Session 45, device call 2 (any card; carry .whl .bnb .shared .whl525): the GPU family tests on transformers 5.25
# after the harness took encoders (EmbeddingGemma 2 new; every family's outputs and loss now through Family).
source benchmarks/results/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site525 .whl525/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site525:/tmp/site
python3 -c "import transformers; print('transformers', transformers.__version__)" | tee $W/tf.txt
TOTAL=${TOTAL:-400}
step fams 380 fams.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py
cat $W/gpu.txt; grep -E "SKIPPED|passed|failed|FAILED" $W/fams.txt | cut -c1-200 | tail -8; cat $W/status
