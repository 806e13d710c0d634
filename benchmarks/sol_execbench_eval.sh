#!/usr/bin/env bash
# NVIDIA's SOL-ExecBench evaluator on our exported solution, with fusedqkv NOT importable.
#
# Device command (H200; repo root; carry .whl, .sol_execbench and .shared):
#
#   bash benchmarks/sol_execbench_eval.sh --wheels .whl --evaluator .sol_execbench \
#        --problem .shared/091_fused_gqa_qkv_rope_qk_norm_backward --out $OUT/eval
#
# (--wheels installs the carried wheels into --site, default /tmp/sol_execbench_site, i.e.
#  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sol_execbench_site .whl/*.whl
#  less the CUDA Python bindings when torch's are already there.) Split over two commands if
#  one runs past the device's 10 minutes: --workloads 0-7 --out $OUT/a, then --workloads 8-15
#  --out $OUT/b, then: python3 benchmarks/sol_execbench_eval.py merge --out $OUT/table.json $OUT/{a,b}/table.json
#
# Steps:
#  1. export the solution (here fusedqkv is importable: PYTHONPATH=src) -> OUT/solution.json;
#  2. in a clean folder, with PYTHONPATH = the wheels' site + the evaluator's src only, check that
#     `python3 -c 'import fusedqkv'` FAILS there, then run the evaluator's own CLI
#     (`sol-execbench <problem_dir> --solution solution.json -o traces.jsonl`);
#  3. time the two-GEMM floor with the evaluator's time_runnable (same CUPTI span, shifting
#     allocator and L2 flush) in the same clean environment;
#  4. `fusedqkv bench --impl fusedqkv,gemm_floor` in the same session (fusedqkv importable again,
#     cupti-python on the path: CUPTI span) for the row-by-row comparison with the evaluator;
#  5. OUT/table.json: per workload status, latency, reference latency, speed-up (the evaluator's),
#     floor, fused/floor, our bench's span and events; printed last. Exit 1 unless all PASSED.
#
# Options: --solution FILE (evaluate this file instead of exporting), --workloads SPEC (0,3,8-15),
#   --no-floor, --no-bench, --timeout S (the evaluator's subprocess; default 540),
#   --site DIR, --python PY (default python3), --max-tokens N (CPU dry run: workloads cut to N
#   tokens; no floor, no bench; the evaluator's timing then fails on CPU by design).
# Environment: SOL_EXECBENCH_SRC (default for --evaluator).
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
HELPER=$REPO/benchmarks/sol_execbench_eval.py
PY=${PYTHON:-python3}
EVAL=${SOL_EXECBENCH_SRC:-$REPO/.sol_execbench}
PROBLEM=""
OUT=""
WHEELS=""
SITE=/tmp/sol_execbench_site
WORKLOADS=all
SOLUTION=""
FLOOR=1
BENCH=1
TIMEOUT=540
MAX_TOKENS=""

die() { echo "sol_execbench_eval: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --evaluator) EVAL=$2; shift 2 ;;
    --problem) PROBLEM=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --site) SITE=$2; shift 2 ;;
    --workloads) WORKLOADS=$2; shift 2 ;;
    --solution) SOLUTION=$2; shift 2 ;;
    --no-floor) FLOOR=0; shift ;;
    --no-bench) BENCH=0; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; FLOOR=0; BENCH=0; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done
[ -n "$PROBLEM" ] || die "--problem: the problem folder (definition.json, workload.jsonl) is required"
[ -n "$OUT" ] || die "--out: an output folder is required"
[ -f "$PROBLEM/definition.json" ] && [ -f "$PROBLEM/workload.jsonl" ] || die "--problem $PROBLEM: no definition.json/workload.jsonl"
[ -f "$EVAL/src/sol_execbench/cli/main.py" ] || die "--evaluator $EVAL: not a SOL-ExecBench source tree (src/sol_execbench/cli/main.py)"
command -v "$PY" >/dev/null || die "--python $PY: not found"
PY=$(command -v "$PY")
mkdir -p "$OUT" || die "--out $OUT: cannot create"
OUT=$(cd "$OUT" && pwd)
EVAL=$(cd "$EVAL" && pwd)
PROBLEM=$(cd "$PROBLEM" && pwd)

# 1. the solution
if [ -z "$SOLUTION" ]; then
  echo "== export (fusedqkv importable here: PYTHONPATH=$REPO/src)"
  (cd "$REPO" && PYTHONPATH="$REPO/src" "$PY" -m fusedqkv export-solution --out "$OUT/solution.json") \
    || die "export-solution failed"
else
  cp "$SOLUTION" "$OUT/solution.json" || die "--solution $SOLUTION: cannot read"
fi

# 2. the clean environment
if [ -n "$WHEELS" ]; then
  echo "== install $WHEELS -> $SITE"
  "$PY" "$HELPER" install --wheels "$WHEELS" --site "$SITE" || die "installing the wheels failed"
fi
CLEAN=$(mktemp -d /tmp/sol_execbench_eval.XXXXXX)
mkdir -p "$CLEAN/bin"
# the evaluator runs `python eval_driver.py`: make that our interpreter (a wrapper, not a symlink:
# a venv's interpreter finds its venv from the path it was started by)
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" >"$CLEAN/bin/python"
chmod +x "$CLEAN/bin/python"
cp "$HELPER" "$CLEAN/helper.py"
CUPTI_DIRS=$(cd "$CLEAN" && PYTHONPATH="$SITE" "$PY" helper.py cupti-dirs 2>/dev/null | paste -sd: -)
clean() {
  (cd "$CLEAN" && env -u PYTHONHOME -u TRITON_INTERPRET -u FUSEDQKV_SOL_EXECBENCH PYTHONNOUSERSITE=1 \
     PATH="$CLEAN/bin:$PATH" PYTHONPATH="$SITE:$EVAL/src" \
     LD_LIBRARY_PATH="${CUPTI_DIRS:+$CUPTI_DIRS:}${LD_LIBRARY_PATH:-}" "$@")
}
echo "== clean environment: $CLEAN, PYTHONPATH=$SITE:$EVAL/src"
if clean "$PY" -c 'import fusedqkv' 2>/dev/null; then
  die "fusedqkv is importable in the clean environment ($(clean "$PY" -c 'import fusedqkv; print(fusedqkv.__file__)')); uninstall it first"
fi
echo "   python3 -c 'import fusedqkv' fails there: ok"
clean "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/environment.txt"
import importlib.metadata as md, platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for d in ("pydantic", "pydantic-core", "click", "rich", "cupti-python", "cuda-bindings"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "absent")
import sol_execbench.cli  # noqa: F401 - the evaluator imports
from cupti import cupti  # noqa: F401 - its timer
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")
    print("cupti timestamp", cupti.get_timestamp())
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || die "the evaluator cannot run in the clean environment (see above)"
[ -f "$EVAL/.source_commit" ] && echo "evaluator commit $(cat "$EVAL/.source_commit")" | tee -a "$OUT/environment.txt"

"$PY" "$HELPER" problem --problem "$PROBLEM" --dest "$CLEAN/problem" --workloads "$WORKLOADS" \
  ${MAX_TOKENS:+--max-tokens "$MAX_TOKENS"} || die "--workloads $WORKLOADS"

echo "== sol-execbench $CLEAN/problem --solution $OUT/solution.json"
clean timeout $((TIMEOUT + 60)) "$PY" -c 'import sys; from sol_execbench.cli import cli; sys.argv[0] = "sol-execbench"; cli()' \
  "$CLEAN/problem" --solution "$OUT/solution.json" -o "$OUT/traces.jsonl" --timeout "$TIMEOUT" -v \
  >"$OUT/evaluator.stdout" 2>"$OUT/evaluator.stderr"
EVAL_RC=$?
echo "   evaluator exit status $EVAL_RC (0: all PASSED); its table and logs: $OUT/evaluator.stderr"
grep -E "workloads passed|Error|error" "$OUT/evaluator.stderr" | tail -5
[ -s "$OUT/traces.jsonl" ] || { tail -30 "$OUT/evaluator.stderr" >&2; die "the evaluator wrote no traces"; }
"$PY" "$HELPER" table --problem "$PROBLEM" --traces "$OUT/traces.jsonl" --out "$OUT/table.json" >/dev/null

# 3. the two-GEMM floor, by the evaluator's timer
if [ "$FLOOR" = 1 ]; then
  echo "== two-GEMM floor (sol_execbench time_runnable)"
  clean "$PY" helper.py floor --problem "$CLEAN/problem" --out "$OUT/floor.json" || echo "   floor failed" >&2
fi

# 4. our bench, same session
if [ "$BENCH" = 1 ]; then
  IDX=$("$PY" -c 'import json,sys; print(",".join(str(i) for i, l in enumerate(open(sys.argv[1])) if l.strip() and json.loads(l)["uuid"] in {json.loads(m)["uuid"] for m in open(sys.argv[2]) if m.strip()}))' \
        "$PROBLEM/workload.jsonl" "$CLEAN/problem/workload.jsonl")
  echo "== fusedqkv bench --impl fusedqkv,gemm_floor --workloads $IDX (fusedqkv importable; cupti-python on the path)"
  (cd "$REPO" && env -u TRITON_INTERPRET PYTHONPATH="$REPO/src:$SITE" FUSEDQKV_SOL_EXECBENCH="$(dirname "$PROBLEM")" \
     LD_LIBRARY_PATH="${CUPTI_DIRS:+$CUPTI_DIRS:}${LD_LIBRARY_PATH:-}" \
     "$PY" -m fusedqkv bench --device cuda --impl fusedqkv,gemm_floor --workloads "$IDX" --no-store --quiet \
     --out "$OUT/bench") | tail -8 || echo "   bench failed" >&2
fi

# 5. the table
echo "== table ($OUT/table.json)"
"$PY" "$HELPER" table --problem "$PROBLEM" --traces "$OUT/traces.jsonl" --floor "$OUT/floor.json" \
  --bench "$OUT/bench/results.json" --out "$OUT/table.json"
TABLE_RC=$?
rm -rf "$CLEAN"
exit $TABLE_RC
