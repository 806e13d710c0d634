#!/bin/bash
# Session 10's device checks, one phase per argument (each step under a timeout). From the repo root:
#   OUT=$OUT bash benchmarks/device_s10.sh graphs|tests|fuzz|perf ...   (carry .shared; perf: also .whl .sol_execbench)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=.shared TRITON_INTERPRET=0
OUT=${OUT:-/tmp/s10}
mkdir -p "$OUT"
for what in "$@"; do
  case $what in
    graphs)  # the repro (a copy of ../shared/repro carried in .shared) and the step times
      timeout 400 python3 .shared/repro/cuda_graphs.py 2>&1 | tee "$OUT/repro.txt"
      timeout 300 python3 benchmarks/bench_graphs.py --out "$OUT/graphs.json" 2>&1 | tail -8 ;;
    tests)
      timeout 500 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_workspace.py \
          tests/test_cublaslt.py tests/test_device_state.py 2>&1 | tail -15 ;;
    fuzz)
      timeout 400 python3 benchmarks/gpu_fuzz.py --cases 200 --out "$OUT/fuzz.json" 2>&1 | tail -6 ;;
    b091)
      timeout 420 python3 benchmarks/bench_091_backward.py --out "$OUT/b091" --reps 30 --rounds 3 2>&1 | tail -25 ;;
    module)
      timeout 400 python3 benchmarks/bench_module.py --out "$OUT/module" 2>&1 | tail -20 ;;
    eval)
      timeout 580 bash benchmarks/sol_execbench_eval.sh --wheels .whl --evaluator .sol_execbench \
          --problem .shared/091_fused_gqa_qkv_rope_qk_norm_backward --out "$OUT/eval" 2>&1 | tail -25 ;;
    bench)
      timeout 400 python3 -m fusedqkv bench --out "$OUT/bench" 2>&1 | tail -25 ;;
  esac
done
