#!/usr/bin/env bash
# session 16, device call A: GPU tests, the fuzz, the CUDA-graph repros on this tree
export PYTHONPATH=src TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=src:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
t0=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_*.py 2>&1 | tail -25 > $OUT/gpu_tests.txt; echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s"; tail -4 $OUT/gpu_tests.txt
t0=$(date +%s)
timeout 120 python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 95 --out $OUT/fuzz > $OUT/fuzz.txt 2>&1; echo "fuzz rc=$? $(( $(date +%s) - t0 )) s"; tail -3 $OUT/fuzz.txt
t0=$(date +%s)
timeout 100 python3 .shared/repro/cuda_graphs.py > $OUT/graphs.txt 2>&1; echo "graphs rc=$? $(( $(date +%s) - t0 )) s"; tail -6 $OUT/graphs.txt
