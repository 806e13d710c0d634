#!/usr/bin/env bash
# session 18, device call 2: end to end (issue 34: LoRA at 28 layers, QLoRA NF4; issue 35: FP8 rowwise
# against torchao, bf16 yardsticks beside). Carry .shared .whl_peft .whl_bnb .whl_fp8.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_peft/*.whl \
  .whl_bnb/*.whl .whl_fp8/*.whl > /dev/null 2>&1; export PYTHONPATH=src:/tmp/site
st=()
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout "$limit" "$@" > "$W/$name.txt" 2>&1; local rc=$?
  st+=("$(printf '%-9s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'criteria' "$W/$name.txt" | tail -1 | cut -c1-100)")"); }
B="python3 benchmarks/bench_hf.py"
step lora06b 150 $B --family qwen3 --layers 28 --lora 16 --lora-init random --autocast --stacks hf-fp32,hf,hf+fusedqkv \
  --steps 30 --out $W/lora06b
step qlora8b 130 $B --family qwen3_8b --lora 16 --qlora nf4 --lora-init random --autocast --stacks hf-fp32,hf,hf+fusedqkv \
  --steps 30 --out $W/qlora8b
step fp8_8b 280 $B --family qwen3_8b --fp8 rowwise --stacks "hf-bf16,compile(hf-bf16),compile(hf),compile(hf+fusedqkv)" \
  --steps 100 --out $W/fp8_8b
tar -czf $OUT/s18_run2.tgz -C $OUT w
for n in lora06b qlora8b fp8_8b; do echo "== $n"; tail -8 $W/$n.txt; done
printf '%s\n' "${st[@]}"
