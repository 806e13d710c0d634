#!/bin/bash
# Nsight Compute view of the single-launch backward (see profile_single_launch.py). OUT=dir bash benchmarks/profile_single_launch.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/profile_single_launch}
mkdir -p "$OUT"
K="-k regex:gqa_bwd_single_launch --clock-control none"
timeout 300 ncu $K --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active --csv \
    python3 benchmarks/profile_single_launch.py --workloads ${WLS:-11,9} --configs ${CFGS:-base,s4,bkw128,bn64,bk128,w4} \
    > "$OUT/sweep.csv" 2> "$OUT/sweep.order"
timeout 200 ncu $K --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_single_launch.py --workloads 11 --configs base > "$OUT/detail.txt" 2>&1
