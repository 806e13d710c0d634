#!/usr/bin/env bash
# session 28, call 1 (session 27's run_4.sh plus the fused QLoRA stack's host profile): issue 34's QLoRA 0.6B end
# to end as is and with every stack's backward on the calling thread (bench_hf --backward-on-caller), issue 36's
# rows (host_costs: 091 rows, the training fwd+bwd both ways in the same rounds), host_hf --qlora --cprofile.
# Carry .whl .bnb .shared.
source benchmarks/results/device_setup.sh
Q="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 --layers 28 \
  --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4"
step q06 165 q06.txt $Q --out $J/q06
step q06_caller 165 q06_caller.txt $Q --backward-on-caller --out $J/q06c
step host 140 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
step hosthf 100 hosthf.txt python3 benchmarks/host_hf.py --device cuda --qlora nf4 --rounds 5 --cprofile --profile-steps 5 --out $J/hosthf
cat $W/gpu.txt
for f in q06 q06_caller; do echo "== $f"; tail -9 $W/$f.txt | cut -c1-260; done
grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt; grep -A6 "^091 / two torch.mm" $W/host.txt
tail -14 $W/hosthf.txt
cat $W/status
