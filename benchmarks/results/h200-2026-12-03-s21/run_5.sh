#!/usr/bin/env bash
# session 21, device call 5: LoRA end to end at the Qwen3-0.6B shape, 28 layers (issue 34's -25 % row), with the
# fp32 yardstick for the loss tolerance. Carry .whl.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
timeout 330 python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random --autocast \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --out $W/lora06 > $W/lora06.txt 2>&1; echo "lora06 rc=$?" >> $W/status
tail -8 $W/lora06.txt | cut -c1-200; cat $W/status
