#!/usr/bin/env bash
# session 27, prepared for the next session's device (not run: this session's budget was spent): on the issue's
# card (H200), issue 34's QLoRA 0.6B end to end as is and with every stack's backward on the calling thread
# (bench_hf --backward-on-caller), and issue 36's rows (host_costs: the training fwd+bwd both ways in the same rounds). Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
Q="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 --layers 28 \
  --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4"
step q06 170 q06.txt $Q --out $J/q06
step q06_caller 170 q06_caller.txt $Q --backward-on-caller --out $J/q06c
# (host_costs times the training fwd+bwd with the backward on the calling thread in the same rounds)
step host 150 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
cat $W/gpu.txt
for f in q06 q06_caller; do echo "== $f"; tail -9 $W/$f.txt | cut -c1-260; done
grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt; grep -A6 "^091 / two torch.mm" $W/host.txt
cat $W/status
