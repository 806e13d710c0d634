#!/bin/bash
# Nsight Compute view of the backward stage (see profile_stage.py). Usage: OUT=dir bash benchmarks/profile_stage.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/profile_stage}
mkdir -p "$OUT"
K="-k regex:rope_qk_norm_bwd_kernel --clock-control none"
# 1) duration of each (workload, config, variant); ncu flushes caches before each replay (cold L2)
ncu $K --metrics gpu__time_duration.sum,dram__bytes.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active --csv \
    python3 benchmarks/profile_stage.py --workloads ${WLS:-11,9,1,5,0} --configs ${CFGS:-default} --variants ${VARS:-exact} \
    > "$OUT/sweep.csv" 2> "$OUT/sweep.order"
python3 benchmarks/ncu_table.py "$OUT/sweep.csv" "$OUT/sweep.order"
[[ ${DETAIL_WLS:-1,5} == none ]] && exit 0
# 2) full sections for the default config on two workloads (DETAIL_WLS=none skips them)
ncu $K --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
    --section SourceCounters \
    python3 benchmarks/profile_stage.py --workloads ${DETAIL_WLS:-1,5} --configs ${DETAIL_CFGS:-default} > "$OUT/detail.txt" 2>&1
