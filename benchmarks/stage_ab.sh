#!/bin/bash
# A/B of the backward stage under Nsight Compute: an older revision's sources against the
# working tree, in one device call (cold L2: ncu flushes caches before each replay).
#
#   # here, before the device call: the old sources into an untracked folder
#   mkdir -p benchmarks/scratch/old_src && git archive HEAD src/fusedqkv | tar -x -C benchmarks/scratch/old_src
#   # on the GPU machine
#   OUT=dir WL=0,5,1,3,14,9,11 CFGS=default VARS=exact,notma bash benchmarks/stage_ab.sh
set -u
export PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=${FUSEDQKV_SOL_EXECBENCH:-.shared}
OUT=${OUT:-/tmp/stage_ab}
mkdir -p "$OUT"
OLD_SRC=${OLD_SRC:-benchmarks/scratch/old_src/src}
K="-k regex:rope_qk_norm_bwd_kernel --clock-control none"
MET="--metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active"
WL=${WL:-0,5,1,3,14,9,11}
if [ -d "$OLD_SRC" ]; then
  PYTHONPATH=$OLD_SRC ncu $K $MET --csv python3 benchmarks/profile_stage.py --workloads "$WL" --configs default \
    --variants exact > "$OUT/old.csv" 2> "$OUT/old.order"
fi
PYTHONPATH=src ncu $K $MET --csv python3 benchmarks/profile_stage.py --workloads "$WL" --configs "${CFGS:-default}" \
  --variants "${VARS:-exact}" > "$OUT/new.csv" 2> "$OUT/new.order"
if [ -d "$OLD_SRC" ]; then echo "== old ($OLD_SRC)"; python3 benchmarks/ncu_table.py "$OUT/old.csv" "$OUT/old.order"; fi
echo "== working tree"; python3 benchmarks/ncu_table.py "$OUT/new.csv" "$OUT/new.order"
