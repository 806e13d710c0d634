#!/usr/bin/env bash
# session 29, call 1: issue 36's w02 row (1 x 131 tokens, the hybrid: cuBLASLt dX) against the PDL chain with
# a dX tile of 128 rows (2 x 64 = 128 tiles on 132 SMs: one wave) at 131 and 256 tokens, in the same rounds;
# then host time per call with the best-guess tile against the default, at 131 and 256 tokens. Carry .whl .shared.
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-560}
C="chain_max_tokens=256;chain_min_balance=0"
step b091 200 b091.txt python3 benchmarks/bench_091_backward.py --workloads 2,8,11 --reps 30 --rounds 3 --out $J/b091 \
  --variant "c64:$C" \
  --variant "c128w4s6:$C;chain_dx_above_128=128,64,64,4,6,1" \
  --variant "c128w8s4:$C;chain_dx_above_128=128,64,64,8,4,1" \
  --variant "c128k128:$C;chain_dx_above_128=128,64,128,8,3,1" \
  --variant "c128x32:$C;chain_dx_above_128=128,32,64,4,4,2"
cp $J/b091/bench_091.json $W/ 2>/dev/null
step hostdef 150 host_default.txt python3 benchmarks/host_costs.py --workloads=2,8 --train-tokens 131,256 --out $J/hd
step host128 150 host_c128.txt python3 benchmarks/host_costs.py --workloads=2,8 --train-tokens 131,256 --out $J/hc \
  --config "$C;chain_dx_above_128=128,64,64,4,6,1"
cat $W/gpu.txt
for f in host_default host_c128; do echo "== $f"; grep -A4 "^091 / two torch.mm" $W/$f.txt; grep -A5 "^training fwd+bwd / two torch.mm, interleaved" $W/$f.txt; done
grep -A30 "^variants" $W/b091.txt | cut -c1-160
cat $W/status
