#!/usr/bin/env bash
# session 16, device call B: LoRA in the block alone (bench_lora) and end to end (bench_hf --lora)
export PYTHONPATH=src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=src:/tmp/site
t0=$(date +%s)
timeout 330 python3 benchmarks/bench_lora.py --out $OUT/lora --reps 20 > $OUT/lora.txt 2>&1; echo "bench_lora rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 120 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --lora-init random --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/lora8b > $OUT/lora8b.txt 2>&1; echo "lora8b rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 120 python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 --lora-init random --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/lora06b > $OUT/lora06b.txt 2>&1; echo "lora06b rc=$? $(( $(date +%s) - t0 )) s"
tail -14 $OUT/lora.txt; tail -8 $OUT/lora8b.txt; tail -8 $OUT/lora06b.txt
