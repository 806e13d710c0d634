#!/usr/bin/env bash
# session 27, device call 3 (the budget's last ~400 s): issue 36's training rows (host_costs.py, the issue's
# command, training rows only) as is and with the backward on the calling thread
# (--backward-on-caller: torch.autograd.set_multithreading_enabled(False)), then issue 34's QLoRA 0.6B end to
# end again (64 steps interleaved). Carry .whl .bnb .shared.
TOTAL=330
source benchmarks/results/device_setup.sh
H="python3 benchmarks/host_costs.py --workloads= --train-tokens 128,131,512,1571"
step host 100 host.txt $H --out $J/host
cp $J/host/host_costs.json $W/host.json 2>/dev/null
step host_caller 100 host_caller.txt $H --backward-on-caller --out $J/hostc
cp $J/hostc/host_costs.json $W/host_caller.json 2>/dev/null
step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 \
  --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4 --out $J/q06
cp $J/q06/bench_hf.json $W/q06.json 2>/dev/null
cat $W/gpu.txt
for f in host host_caller; do echo "== $f"; grep -E "training fwd\+bwd / two torch.mm \(same" $W/$f.txt; grep -E "per block" $W/$f.txt | head -8; done
tail -9 $W/q06.txt | cut -c1-260
cat $W/status
