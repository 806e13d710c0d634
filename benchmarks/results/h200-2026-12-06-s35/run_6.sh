#!/usr/bin/env bash
# Prepared in session 35 for the next device call (not run): issue 34's one row not re-measured on an H200 since
# session 25, QLoRA NF4 at the Qwen3-0.6B shape (28 layers), twice, on an H200 only (stops on any other card).
# Carry .whl .bnb .shared. .bnb, here in the repo root (a new checkout has none):
#   echo /.bnb/ >> .git/info/exclude; python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_24_x86_64 -d /tmp/bnb bitsandbytes==0.50.2 && mkdir -p .bnb && \
#     (cd .bnb && unzip -q /tmp/bnb/*.whl && rm -f bitsandbytes/libbitsandbytes_cuda1[12]*.so \
#     bitsandbytes/libbitsandbytes_rocm*.so bitsandbytes/libbitsandbytes_xpu*.so)
# (~8 MB left: the CUDA 13 libraries the device's torch (cu130) loads, and the CPU one; checked in session 35.)
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-400}
cat $W/gpu.txt
grep -q H200 $W/gpu.txt || { echo "not an H200: stopped"; exit 0; }
Q="python3 benchmarks/bench_hf.py --lora 16 --lora-init random --autocast --interleave --family qwen3 --layers 28 \
  --qlora nf4 --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv --steps 64 --warmup 4"
step q06a 180 q06a.txt $Q --out $J/q06a
step q06b 180 q06b.txt $Q --out $J/q06b
for f in q06a q06b; do echo "== $f"; tail -9 $W/$f.txt | cut -c1-260; done
cat $W/status
