#!/usr/bin/env bash
# Session 36, device call 1 (any card; carry .whl .bnb .shared). On an H200 first issue 34's QLoRA 0.6B row
# (session 35's run_6.sh, once). Then on any card: host_costs (this session's forward_plan change touches a host
# path: issue 36's rule) and session 35's run_7.sh (the backward stage's column amax partials,
# fp8.STAGE_AMAX_COLUMNS, against the default, with each provider's kernel profile). .bnb: run_6.sh's header.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-560}
cat $W/gpu.txt
if grep -q H200 $W/gpu.txt; then
  step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
    --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
    --warmup 4 --out $J/q06
fi
step host 160 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
ROWS=2,9; grep -q H200 $W/gpu.txt && ROWS=2  # (the H200 spends ~200 s on q06 first)
step fp8 300 fp8.txt python3 benchmarks/bench_fp8.py --rows $ROWS --reps 10 --ab-stage-columns --profile --out $W/fp8
[ -f $W/q06.txt ] && { echo "== q06"; tail -9 $W/q06.txt | cut -c1-260; }
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
grep -E "stagecols|fp8_rowwise:|fp8_rowwise_stagecols:" $W/fp8.txt | cut -c1-700
cat $W/status
