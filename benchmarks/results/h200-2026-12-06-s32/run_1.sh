#!/usr/bin/env bash
# session 32, call 1: on an H200, issue 36's rows and user clock (no H200 came in sessions 29-31); else
# issue 35's end to end under compile (Qwen3-8B shape, 4 layers, torchao float8 rowwise, 100 steps; never run
# since the graph breaks were fixed in session 30). (Issue 34's QLoRA 0.6B row: run_2.sh, which carries .bnb.)
# First the new Ergo row (transformers 5.25, carried as .whl525) in the GPU family tests beside Dory, Kolibri 1.1 and Beam (5.25),
# and the block compiled at several eps in one process (inductor).
# Carry .whl .shared .whl525.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-575}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site525 .whl525/*.whl > $J/pip525.txt 2>&1
step fam525 90 j/k/fam525.txt env PYTHONPATH=/tmp/site525:src:/tmp/site python3 -m pytest -q -p no:cacheprovider -rs \
  tests/test_gpu_hf_families.py -k "ergo or dory or kolibri1_1 or beam"
step t_eps 60 j/k/t_eps.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py -k several_eps
if grep -q H200 $W/gpu.txt; then
  step host 200 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
  step b091 80 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $J/b091
else
  step fp8_8b 250 j/k/fp8.txt python3 benchmarks/bench_hf.py --family qwen3_8b --fp8 rowwise --lr 1e-4 \
    --stacks "hf-bf16,compile(hf-bf16),compile(hf),compile(hf+fusedqkv)" --steps 100 --out $J/fp8
  tail -14 $J/fp8.txt > $W/fp8_tail.txt; cp $J/fp8/bench_hf.json $W/fp8.json 2>/dev/null
fi
cat $W/gpu.txt
grep -E "^FAILED|^SKIPPED|passed|failed" $J/fam525.txt $J/t_eps.txt | cut -c1-200 | head -8
[ -f $W/host.txt ] && { grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt; tail -4 $W/b091.txt | cut -c1-200; }
cat $W/fp8_tail.txt; cat $W/status
