#!/usr/bin/env bash
# session 17, optional second device call (one H200, ~1-2 min): QLoRA NF4 end to end, the
# Qwen3-8B shape (4 layers, vocab 151936, 4 x 2048 tokens, bf16, AdamW), PEFT all-linear r=16,
# with and without fusedqkv. Carry: .whl and .whl_bnb (as qlora.sh).
#   bash benchmarks/results/h200-2026-12-02-s17/qlora_e2e.sh
export PYTHONPATH=src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_bnb/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=src:/tmp/site
t0=$(date +%s)
timeout 150 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --qlora nf4 --lora-init random \
  --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/qlora8b > $OUT/qlora8b.txt 2>&1
echo "bench_hf --qlora nf4 rc=$? $(( $(date +%s) - t0 )) s"
tail -9 $OUT/qlora8b.txt
