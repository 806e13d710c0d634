#!/usr/bin/env bash
# session 30, call 3: the HF fused attention under torch.compile without graph breaks (this tree) against the
# tree before it (1aa98ee's src, carried as .prev/src): Qwen3-0.6B shape, 28 layers, compile(hf) and
# compile(hf+fusedqkv) (inductor), one process per tree on the same machine. Carry .prev.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-570}
for tree in prev new; do
  src=src; [ $tree = prev ] && src=.prev/src
  step hf_$tree 280 j/k/hf_$tree.txt env PYTHONPATH=$src:/tmp/site TORCH_LOGS=graph_breaks python3 benchmarks/bench_hf.py \
    --layers 28 --steps 30 --warmup 5 --stacks "compile(hf),compile(hf+fusedqkv)" --out $J/hf_$tree
  grep -c "Graph break in user code" $J/hf_$tree.txt > $W/breaks_$tree.txt; grep -v "graph_breaks\]" $J/hf_$tree.txt > $W/hf_$tree.txt
done
cat $W/gpu.txt
for tree in prev new; do echo "== $tree: graph-break log lines $(cat $W/breaks_$tree.txt)"; grep -E "ms/step|compile\(hf|step time|loss" $W/hf_$tree.txt | grep -v "Graph break" | tail -8 | cut -c1-180; done
cat $W/status
