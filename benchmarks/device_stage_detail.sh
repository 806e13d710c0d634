# one device call: Nsight Compute sections of the stage on a few workloads/configs (text)
cd $PWD && export PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
K="-k regex:rope_qk_norm_bwd_kernel --clock-control none --launch-skip-before-match 0"
timeout 400 ncu $K --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --section InstructionStats \
    python3 benchmarks/profile_stage.py --workloads ${WLS:-11,15} --configs ${CFGS:-default} --variants ${VARS:-exact} > $OUT/detail.txt 2>&1
echo ncu rc=$?
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Block Limit|Stall|Executed Instructions  |warp|Waves Per SM|Shared Memory Config|Dynamic Shared" $OUT/detail.txt | grep -v "^\s*-" | head -150
