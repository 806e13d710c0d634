#!/usr/bin/env bash
# Session 46, device call 1 (carry .whl .bnb .shared). On an H200: the open issues' H200 rows (issue 34's QLoRA
# 0.6B row, issue 36's user clock and host rows), then issue 35's FP8 rows if time is left. On an H100: the GPU
# tests that session 45's unrun commits touch (0657dc2 the rows views' gradient hook, eb378f5 the FP8 refusal where
# the plan is taken) and this session's torch.func refusal (0260cf2): HF families, QLoRA, FP8, graphs, fast path;
# then the fuzz; and two probes (FlopCounterMode over a fused model, L2 reuse by traversal order).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  source benchmarks/results/h200_issue_rows.sh
  step fp8 150 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --out $J/fp8
  tail -16 $W/fp8.txt | cut -c1-220
else
  step flops 40 flops.txt python3 benchmarks/results/h200-2026-12-07-s46/flop_counter_probe.py
  step l2 60 l2.txt python3 benchmarks/results/h200-2026-12-07-s46/l2_reuse_probe.py --out $J/l2
  step gtests 440 gtests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_hf_families.py \
    tests/test_gpu_qlora.py tests/test_gpu_fp8.py tests/test_gpu_graphs.py tests/test_gpu_fast_path.py
  step fuzz 110 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 85

  grep -E "FAILED|SKIPPED" $W/gtests.txt | cut -c1-200 | head -20
  tail -4 $W/flops.txt
  tail -9 $W/l2.txt
fi
cat $W/status
