#!/usr/bin/env bash
# session 21, device call 6: QLoRA (NF4) end to end at both shapes (issue 34), then the bf16 training block
# against compile and eager (bench_module: no regression from the kernel's LoRA arguments). Carry .whl .bnb.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
cp -r .bnb/bitsandbytes* /tmp/site/
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
timeout 150 python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random --autocast --qlora nf4 \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --out $W/qlora06 > $W/qlora06.txt 2>&1; echo "qlora06 rc=$?" >> $W/status
timeout 150 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --lora-init random --autocast --qlora nf4 \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --out $W/qlora8b > $W/qlora8b.txt 2>&1; echo "qlora8b rc=$?" >> $W/status
timeout 200 python3 benchmarks/bench_module.py --reps 15 --out $W/module > $W/module.txt 2>&1; echo "module rc=$?" >> $W/status
tail -6 $W/qlora06.txt | cut -c1-200; tail -6 $W/qlora8b.txt | cut -c1-200; tail -14 $W/module.txt | cut -c1-200; cat $W/status
