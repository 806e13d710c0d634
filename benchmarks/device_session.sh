#!/bin/bash
# One device call that re-measures everything the open issues are judged on, each step under a
# timeout (a hang must not eat the device budget). Usage on the device machine, from the repo root:
#   FUSEDQKV_SOL_EXECBENCH=.shared OUT=$OUT bash benchmarks/device_session.sh [bench|module|robust|all]
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_session}
what=${1:-all}
mkdir -p "$OUT"
if [[ $what == bench || $what == all ]]; then
  # issue 2: the 091 table (16 workloads, span, median of 30), plus single launch vs three launches
  timeout 300 python3 benchmarks/bench_091_backward.py --out "$OUT/b091" --reps 30 --paths 2>&1 | tail -40
fi
if [[ $what == module || $what == all ]]; then
  # issue 4: forward, backward, forward+backward of the module vs eager and torch.compile, peak memory
  timeout 200 python3 benchmarks/bench_module.py --out "$OUT/module" 2>&1 | tail -30
fi
if [[ $what == robust || $what == all ]]; then
  # issue 5's checks on the current kernels
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 compute-sanitizer --tool memcheck --target-processes all \
      --error-exitcode 3 python3 benchmarks/gpu_robustness.py --sanitize 2>&1 | grep -E "RESULT|ERROR SUMMARY" | tail -30
  timeout 200 python3 benchmarks/gpu_robustness.py --graph --memory --determinism --out "$OUT/robust" 2>&1 | grep RESULT
fi
