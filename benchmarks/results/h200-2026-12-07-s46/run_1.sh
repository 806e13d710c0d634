#!/usr/bin/env bash
# Session 46, device call 1 (carry .whl .bnb .shared). On an H200: the open issues' H200 rows (issue 34's QLoRA
# 0.6B row, issue 36's user clock and host rows), then issue 35's FP8 rows with fp8.L2_ORDER's A/B. On an H100:
# the L2 reuse probe and the A/B (issue 35: each cast pass starting on the tiles the pass before it left in L2),
# the FP8 and fast-path GPU tests (the new tile orders are the default; this session's torch.func refusal) and
# the fuzz, and the FlopCounterMode probe. run_2.sh has the GPU tests of session 45's unrun commits.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-590}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  source benchmarks/results/h200_issue_rows.sh
  step fp8 170 fp8.txt python3 benchmarks/bench_fp8.py --rows 2,8,9 --reps 10 --ab-l2-order --out $J/fp8
  tail -16 $W/fp8.txt | cut -c1-220
else
  step l2 60 l2.txt python3 benchmarks/results/h200-2026-12-07-s46/l2_reuse_probe.py --out $J/l2
  step ab 200 ab.txt python3 benchmarks/bench_fp8.py --rows 2,9 --reps 10 --ab-l2-order --out $J/ab
  step gtests 200 gtests.txt python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_fp8.py \
    tests/test_gpu_fast_path.py
  step fuzz 90 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 80
  step flops 30 flops.txt python3 benchmarks/results/h200-2026-12-07-s46/flop_counter_probe.py
  grep -E "FAILED|SKIPPED" $W/gtests.txt | cut -c1-200 | head -20
  tail -4 $W/flops.txt
  tail -9 $W/l2.txt
  grep -E "L2 order|^config|rowwise " $W/ab.txt | tail -8 | cut -c1-220
fi
cat $W/status
