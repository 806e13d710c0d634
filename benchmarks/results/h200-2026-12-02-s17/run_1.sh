#!/usr/bin/env bash
# session 17, device call 1: host cost per call at 72a2a65 and at this tree with their Python
# profiles (issue 36), then NVIDIA's evaluator + runs import + fusedqkv bench + runs --compare (issue 37)
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
i=0
for v in r72 head r72 head; do
  if [ $v = r72 ]; then src=.shared/r72/src; script=.shared/r72/benchmarks/host_costs.py; else src=src; script=benchmarks/host_costs.py; fi
  prof=""; [ $i -lt 2 ] && prof=--cprofile
  PYTHONPATH=$src timeout 100 python3 $script --out $W/host_${v}_$i $prof > $W/host_${v}_$i.txt 2>&1; echo "host $v $i rc=$?"
  i=$((i+1))
done
SECONDS=0
timeout 380 bash benchmarks/official_vs_bench.sh --wheels .whl --evaluator .sol_execbench \
  --problem .shared/091_fused_gqa_qkv_rope_qk_norm_backward --out $W/ovb > $W/ovb.txt 2>&1; echo "ovb rc=$? ${SECONDS}s"
tar -czf $OUT/s17_run1.tgz -C $OUT w
tail -30 $W/ovb.txt
for f in $W/host_*_[23].txt; do echo "== $f"; grep -E "091 call|two torch|training forward" $f | tail -16; done
