#!/usr/bin/env bash
# session 18, device call 3: where the 28-layer LoRA step goes, with and without bf16 autocast
# (profile_hf --lora 16), and the FP8 end to end again at lr 1e-4 (run 2's lr 1e-3 left bf16's own
# curves 3 apart: no loss rule can read that). Carry .shared .whl_peft .whl_fp8.
export TRITON_INTERPRET=0 FUSEDQKV_SOL_EXECBENCH=.shared PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_peft/*.whl \
  .whl_fp8/*.whl > /dev/null 2>&1; export PYTHONPATH=src:/tmp/site
st=()
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s); timeout "$limit" "$@" > "$W/$name.txt" 2>&1; local rc=$?
  st+=("$(printf '%-9s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'criteria|->' "$W/$name.txt" | tail -1 | cut -c1-120)")"); }
P="python3 benchmarks/profile_hf.py --layers 28 --lora 16 --stacks hf,hf+fusedqkv --no-traces --timed-steps 6 --profile-steps 1"
step prof_ac 110 $P --autocast --out $W/prof_ac
step prof_noac 110 $P --out $W/prof_noac
step fp8_8b 260 python3 benchmarks/bench_hf.py --family qwen3_8b --fp8 rowwise --lr 1e-4 \
  --stacks "hf-bf16,compile(hf-bf16),compile(hf),compile(hf+fusedqkv)" --steps 100 --out $W/fp8_8b
tar -czf $OUT/s18_run3.tgz -C $OUT w
for n in prof_ac prof_noac; do echo "== $n"; grep -A22 "^ms/step, CPU op\|^ms/step" $W/$n.txt | tail -22; done
echo "== fp8"; tail -9 $W/fp8_8b.txt
printf '%s\n' "${st[@]}"
