#!/usr/bin/env bash
# session 27, prepared for the next session's device (not run: this session's budget was spent): on the issue's
# card (H200), issue 34's QLoRA 0.6B end to end as is and with every stack's backward on the calling thread
# (bench_hf --backward-on-caller), and issue 36's training rows both ways (host_costs). Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
Q="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 --layers 28 \
  --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4"
step q06 170 q06.txt $Q --out $J/q06
step q06_caller 170 q06_caller.txt $Q --backward-on-caller --out $J/q06c
H="python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571"
step host 100 host.txt $H --out $J/host
step host_caller 100 host_caller.txt $H --backward-on-caller --out $J/hostc
cat $W/gpu.txt
for f in q06 q06_caller; do echo "== $f"; tail -9 $W/$f.txt | cut -c1-260; done
for f in host host_caller; do echo "== $f"; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/$f.txt; grep -A6 "^091 / two torch.mm" $W/$f.txt; done
cat $W/status
