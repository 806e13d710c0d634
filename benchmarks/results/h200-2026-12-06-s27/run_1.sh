#!/usr/bin/env bash
# session 27, device call 1: issue 36's training fwd+bwd, where the in-autograd time goes (host_glue_training
# --cprofile-diff: the fused step against the planned work alone, own time per function, the engine's thread
# included on Python 3.12); issue 35's frozen-weight FP8 cache measured (bench_fp8_frozen, session 26's run_5),
# then with the cache on: the GPU FP8 tests and the graph repro; the fuzz. Carry .whl .shared.
source benchmarks/results/device_setup.sh
python3 -c "import sys; print(sys.version)" >> $W/gpu.txt
step glue128 130 glue128.txt python3 benchmarks/host_glue_training.py --device cuda --tokens 128 --rounds 10 --cprofile-diff --out $J/g128
step glue512 130 glue512.txt python3 benchmarks/host_glue_training.py --device cuda --tokens 512 --rounds 10 --cprofile-diff --out $J/g512
step frozen 100 frozen.txt python3 benchmarks/bench_fp8_frozen.py --rows 1,4,0,2 --reps 30 --out $J/frozen
cp $J/frozen/bench_fp8_frozen.json $W/frozen.json 2>/dev/null
PT="python3 -m pytest -q -p no:cacheprovider -rs"
FUSEDQKV_FP8_FROZEN_WEIGHT_CACHE=1 step t_fp8c 200 t_fp8c.txt $PT tests/test_gpu_fp8.py &
FUSEDQKV_FP8_FROZEN_WEIGHT_CACHE=1 step graphs 150 graphs.txt python3 .shared/repro/cuda_graphs.py &
step fuzz 200 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 180 --out $J/fuzz &
wait
cat $W/gpu.txt
for T in 128 512; do grep -A22 "^training block fwd+bwd" $W/glue$T.txt | cut -c1-200; grep -A24 "^==== cProfile own" $W/glue$T.txt | cut -c1-150; done
tail -8 $W/frozen.txt
grep -hE "^FAILED|^ERROR" $W/t_*.txt | head -12
grep -E "FAIL|PASS" $W/fuzz.txt | tail -2; tail -2 $W/graphs.txt
cat $W/status
