#!/usr/bin/env bash
# session 21, device call 4: the 091 user clock (issue 36: CUDA events, L2 flushed, 16 workloads), then the LoRA
# end to end on the Qwen3-8B shape (issue 34; the fused forward takes the adapters at 4 x 2048). Carry .shared .whl.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
W=$OUT/w; mkdir -p $W
export PYTHONPATH=src:/tmp/site
timeout 230 python3 benchmarks/bench_091_backward.py --out $W/b091 --reps 20 --rounds 2 > $W/b091.txt 2>&1; echo "b091 rc=$?" >> $W/status
timeout 200 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --lora-init random --autocast \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 20 --out $W/lora8b > $W/lora8b.txt 2>&1; echo "lora8b rc=$?" >> $W/status
tail -24 $W/b091.txt | cut -c1-160; tail -8 $W/lora8b.txt | cut -c1-200; cat $W/status
