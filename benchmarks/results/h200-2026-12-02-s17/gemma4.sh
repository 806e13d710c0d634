#!/usr/bin/env bash
# session 17 (issue 38 part 1), one H200, under 3 minutes: head_dim 512 -- the GPU tests of 512 and of the
# Gemma 4 tiny model (head_dim 16 / 512 layers), the fuzz at 512, and Gemma 4 31B's global layer against HF
# eager and torch.compile (benchmarks/bench_families.py). Run from the repository root: OUT=... bash <this>
export PYTHONPATH=src TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gemma4}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
  && export PYTHONPATH=src:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
status=()
step() {  # name, timeout (s), log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  status+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|RESULT|criteria' "$OUT/$log" | tail -1 | cut -c1-90)")")
}
# the benchmark first (the result this call is for; it compiles the 512 specialisations the tests then
# find in Triton's cache), then the GPU tests, then the fuzz: timeouts 95 + 45 + 32 s
step bench 95 bench.txt python3 benchmarks/bench_families.py --families gemma4_text --tokens 1x2048,4x2048 \
  --reps 20 --out "$OUT/gemma4"
step gpu_tests 45 gpu_tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_head_dim_512.py \
  tests/test_gpu_hf_families.py -k "gemma4 or not family"
step fuzz512 32 fuzz512.txt python3 benchmarks/gpu_fuzz.py --head-dims 512 --cases 12 --max-tokens 4096 \
  --time-limit 24 --out "$OUT/fuzz512"
grep -E "FAIL|Error|error" "$OUT/gpu_tests.txt" | head -5
tail -7 "$OUT/bench.txt"
printf '%s\n' "step       status  time  last line" "${status[@]}"
