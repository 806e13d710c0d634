#!/usr/bin/env bash
# session 27, device call 2: issue 36, whether the training fwd+bwd's in-autograd slowdown is the engine's device
# thread (host_glue_training at 128 tokens: as is, with the backward on the calling thread, pinned to one core);
# issue 35, the frozen-weight FP8 cache's GPU time without host time (bench_fp8_frozen, calls behind a GPU
# sleep); issue 34's open row, QLoRA NF4 at the Qwen3-0.6B shape (28 layers) end to end, interleaved over 64
# steps, then where the fused stack's attention input spends GPU time against its dense-qkv bound (profile_hf,
# each category's largest kernels in profile_hf.json). Carry .whl .bnb .shared.
TOTAL=430  # the device budget left after failed starts
source benchmarks/results/device_setup.sh
G="python3 benchmarks/host_glue_training.py --device cuda --tokens 128 --rounds 8"
step glue 60 glue.txt $G
step glue_caller 60 glue_caller.txt $G --backward-on-caller
step glue_pin 60 glue_pin.txt taskset -c 3 $G
step frozen 80 frozen.txt python3 benchmarks/bench_fp8_frozen.py --rows 1,4,0,2 --reps 30 --out $J/frozen
cp $J/frozen/bench_fp8_frozen.json $W/frozen.json 2>/dev/null
step q06 250 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 \
  --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4 --out $J/q06
cp $J/q06/bench_hf.json $W/q06.json 2>/dev/null
# the device budget left (707 s after failed starts) keeps the profile out: run it with TOTAL=575
step pq 150 pq.txt python3 benchmarks/profile_hf.py --layers 28 --lora 16 --autocast --qlora nf4 --no-traces \
  --stacks hf+fusedqkv,hf+fusedqkv:dense-qkv --warmup 3 --timed-steps 6 --profile-steps 1 --out $J/pq
cp $J/pq/profile_hf.json $W/pq.json 2>/dev/null
cat $W/gpu.txt
for f in glue glue_caller glue_pin; do echo "== $f"; grep -E "^(  of which|Function\.| *total)|^  (fused|do-nothing Function, saves 7|planned|two torch)" $W/$f.txt | cut -c1-190; done
tail -8 $W/frozen.txt
tail -9 $W/q06.txt | cut -c1-260
tail -22 $W/pq.txt | cut -c1-200
python3 - $W/pq.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"]
for stack, v in r.items():
    c = v["categories"].get("attn_input", {})
    print(f"{stack}: attn_input {c.get('ms', 0):.2f} ms/step (fwd {c.get('fwd_ms', 0):.2f}, bwd {c.get('bwd_ms', 0):.2f})")
    for k in c.get("top", [])[:12]:
        print(f"   {k['ms']:8.3f}  {k['name'][:110]}")
PY
cat $W/status
