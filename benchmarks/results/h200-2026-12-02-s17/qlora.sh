#!/usr/bin/env bash
# session 17, one device call (one H200, < 3 min): the LoRA block alone (bench_lora, the nine rows:
# the floor ratio of issue 34), QLoRA NF4 in the block against PEFT QLoRA (bench_lora --qlora nf4),
# and the QLoRA GPU tests. Carry: .whl (peft 0.21.2) and .whl_bnb (bitsandbytes 0.50.2, 43 MB).
#   bash benchmarks/results/h200-2026-12-02-s17/qlora.sh
export PYTHONPATH=src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl .whl_bnb/*.whl \
  >/dev/null 2>&1 && export PYTHONPATH=src:/tmp/site
python3 -c "import bitsandbytes, peft; print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)"
t0=$(date +%s)
timeout 85 python3 benchmarks/bench_lora.py --out $OUT/lora --reps 20 > $OUT/lora.txt 2>&1
echo "bench_lora rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 50 python3 benchmarks/bench_lora.py --qlora nf4 --configs 091_h4096_q32_kv8 --out $OUT/qlora \
  --reps 20 > $OUT/qlora.txt 2>&1
echo "bench_lora --qlora nf4 rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 35 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qlora.py > $OUT/gpu_qlora_tests.txt 2>&1
echo "test_gpu_qlora rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/gpu_qlora_tests.txt)"
grep -E "failed:|Error" $OUT/qlora.txt | head -4
tail -10 $OUT/lora.txt
tail -6 $OUT/qlora.txt
