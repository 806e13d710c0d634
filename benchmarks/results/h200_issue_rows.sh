# Sourced by the device scripts from session 42 on, after device_setup.sh: the open issues' H200 rows -- issue 34's
# QLoRA 0.6B end-to-end row first, then issue 36's user clock and host rows -- each a `step` within $TOTAL, and
# their summaries printed last.
step q06 200 q06.txt python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave \
  --family qwen3 --layers 28 --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 \
  --warmup 4 --out $J/q06
step b091 100 b091.txt python3 benchmarks/bench_091_backward.py --reps 20 --rounds 2 --out $W
step host 110 host.txt python3 benchmarks/host_costs.py --workloads=11,2,15,3 --train-tokens 128,131,512,1571 --out $J/host
echo "== q06"; tail -9 $W/q06.txt | cut -c1-260
grep -A6 "^091 / two torch.mm" $W/host.txt; grep -A9 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
tail -22 $W/b091.txt | cut -c1-200
