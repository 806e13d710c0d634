#!/usr/bin/env bash
# Session 46, device call 2 (carry .whl .bnb .shared; any card): call 1's GPU tests ran out of their step's time
# (and fp8.L2_ORDER is reverted), so: the fast-path tests (this session's torch.func refusal on the GPU), the GPU
# tests that session 45's unrun commits touch (0657dc2 the rows views' gradient hook, eb378f5 the FP8 refusal where
# the plan is taken: HF families, QLoRA, graphs), the fuzz before them (the budget: ~300 s; the HF tests only if time is left).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-230}
cat $W/gpu.txt
step fast 110 fast.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_fast_path.py
step fuzz 100 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 80
step gtests 230 gtests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_qlora.py \
  tests/test_gpu_graphs.py tests/test_gpu_hf_families.py
grep -E "FAILED|SKIPPED" $W/fast.txt $W/gtests.txt | cut -c1-200 | head -20
tail -2 $W/fuzz.txt
cat $W/status
