#!/usr/bin/env bash
# session 20, device call 1: issue 36's baseline on this tree -- host_costs with the 091 profile,
# the training block's host timeline and profile, and an HF LoRA step's host time and profile.
# Carry .shared .whl (peft 0.21.2, trl 1.16.0, torchao 0.18.0).
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=src:/tmp/site
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $W/gpu.txt; lscpu | head -20 > $W/cpu.txt
timeout 200 python3 benchmarks/host_costs.py --cprofile --out $W/host > $W/host.txt 2>&1; echo "host rc=$?"
timeout 200 python3 benchmarks/host_timeline.py --cprofile --hf-lora 4 --out $W/tl > $W/tl.txt 2>&1; echo "timeline rc=$?"
tar -czf $OUT/s20_run1.tgz -C $OUT w
grep -A4 "HF step host" $W/tl.txt; grep -A12 "^host timeline" $W/tl.txt; tail -45 $W/host.txt | cut -c1-150
