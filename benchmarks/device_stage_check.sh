# one device call: the stage under ncu (configs x variants), correctness on 5 workloads, the per-call timeline
cd $PWD && export PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
K="-k regex:rope_qk_norm_bwd_kernel --clock-control none"
timeout 240 ncu $K --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread --csv python3 benchmarks/profile_stage.py --workloads ${WLS:-11,15,13,3,1,5,0} --configs ${CFGS:-default} --variants ${VARS:-exact,nofin} > $OUT/sweep.csv 2> $OUT/sweep.order
echo ncu rc=$?
python3 benchmarks/ncu_table.py $OUT/sweep.csv $OUT/sweep.order
timeout 200 python3 benchmarks/bench_091_backward.py --out $OUT/b --reps 10 --workloads 11,9,13,1,0 --no-span 2>&1 | tail -8
timeout 150 python3 benchmarks/diag_timeline.py --out $OUT 2>&1 | tail -24
