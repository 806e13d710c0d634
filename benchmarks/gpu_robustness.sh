#!/usr/bin/env bash
# GPU robustness (issue 5): compute-sanitizer memcheck + racecheck over every Triton
# kernel path, then CUDA-graph replay, 1000-call memory and determinism checks.
# Summaries and full logs go to $OUT (default ./out/gpu_robustness). ~2-4 minutes.
#
#   OUT=$OUT bash benchmarks/gpu_robustness.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_robustness}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
status=0
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)

if [ -z "$SAN" ]; then
  echo "compute-sanitizer not found" | tee "$OUT/sanitizer_summary.txt"; status=1
else
  : > "$OUT/sanitizer_summary.txt"
  for tool in memcheck racecheck; do
    # no caching allocator: each tensor its own cudaMalloc, so memcheck sees out-of-bounds accesses
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 "$SAN" --tool "$tool" --target-processes all --error-exitcode 3 \
      "$PY" benchmarks/gpu_robustness.py --sanitize --out "$OUT/$tool" > "$OUT/$tool.log" 2>&1
    rc=$?
    { echo "== $tool (exit $rc)"; grep -E "RESULT|SUMMARY|ERROR SUMMARY|RACECHECK SUMMARY|Error|error" "$OUT/$tool.log" | head -40; } \
      | tee -a "$OUT/sanitizer_summary.txt"
    [ $rc -eq 0 ] || status=1
  done
fi

timeout 240 "$PY" benchmarks/gpu_robustness.py --graph --memory --determinism --out "$OUT" 2>&1 | tee "$OUT/checks.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_robustness: exit $status; logs in $OUT"
exit $status
