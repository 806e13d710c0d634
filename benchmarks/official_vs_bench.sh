#!/usr/bin/env bash
# NVIDIA's evaluator and `fusedqkv bench` on one GPU, both as records, in one table across clocks.
#
# Device command (repo root; carry .whl, .sol_execbench and .shared as for sol_execbench_eval.sh):
#
#   bash benchmarks/official_vs_bench.sh --wheels .whl --evaluator .sol_execbench \
#        --problem .shared/091_fused_gqa_qkv_rope_qk_norm_backward --out $OUT/ovb
#
# Steps: export-solution; the evaluator on it (sol_execbench_eval.sh: fusedqkv not importable there)
# -> traces.jsonl; `fusedqkv runs import` of the traces (with the solution.json: its digest);
# `fusedqkv bench` of fusedqkv; `fusedqkv runs --compare BENCH TRACES` (per-workload B/A, geomeans).
# The run store is OUT/store. Extra arguments go to sol_execbench_eval.sh (e.g. --workloads 0-7).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT="" EVAL=${SOL_EXECBENCH_SRC:-$REPO/.sol_execbench} PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --evaluator) EVAL=$2; PASS+=("$1" "$2"); shift 2 ;;
    *) PASS+=("$1"); shift ;;
  esac
done
[ -n "$OUT" ] || { echo "official_vs_bench: --out is required" >&2; exit 2; }
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
STORE=$OUT/store
fq() { (cd "$REPO" && env -u TRITON_INTERPRET PYTHONPATH="$REPO/src" "$PY" -m fusedqkv "$@"); }

fq export-solution --out "$OUT/solution.json" || exit 1
bash "$REPO/benchmarks/sol_execbench_eval.sh" "${PASS[@]}" --solution "$OUT/solution.json" --no-floor --no-bench \
  --out "$OUT/eval"
[ -s "$OUT/eval/traces.jsonl" ] || { echo "official_vs_bench: the evaluator wrote no traces" >&2; exit 1; }
# the stack's version: the evaluator's commit (its traces do not name one)
VERSION="git-$(cut -c1-12 "$EVAL/.source_commit" 2>/dev/null || echo unknown)"
fq runs import "$OUT/eval/traces.jsonl" --solution "$OUT/solution.json" --stack-version "$VERSION" \
  --store "$STORE" --json >"$OUT/import.json" || exit 1
TRACES=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["name"])' "$OUT/import.json")
fq bench --device cuda --impl fusedqkv --quiet --store "$STORE" --out "$OUT/bench" | tail -4
BENCH=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["run"]["metadata"]["name"])' "$OUT/bench/manifest.json")
fq runs --store "$STORE" --compare "$BENCH" "$TRACES" | tee "$OUT/compare.txt"
fq runs --store "$STORE" --compare "$BENCH" "$TRACES" --json >"$OUT/compare.json"
