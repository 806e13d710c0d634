#!/usr/bin/env bash
# session 16, device call C: host cost per call at 0333ee3 and at this tree (alternating, same run),
# and the training block (no LoRA) against eager and torch.compile (bench_module, 9 rows)
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
for i in 1 2; do
  for v in base head; do
    src=src; [ $v = base ] && src=.shared/base/src
    PYTHONPATH=$src timeout 85 python3 benchmarks/host_costs.py --out $OUT/host_${v}_$i > $OUT/host_${v}_$i.txt 2>&1; echo "host $v $i rc=$?"
  done
done


for v in base head; do echo "== $v"; grep -E "091 call|two torch|training|fwd" $OUT/host_${v}_2.txt | head -40; done

