#!/usr/bin/env bash
# session 17, device call 2 (issue 35): the FP8 GPU tests, a kernel profile of one fp8 fwd+bwd, bench_fp8.py
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_fp8/*.whl 2>&1 | tail -1
export PYTHONPATH=src:/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_fp8.py -x > $W/gpu_tests.txt 2>&1; echo "tests rc=$?"; tail -3 $W/gpu_tests.txt
timeout 90 python3 - > $W/profile.txt 2>&1 <<'PY'
import torch, sys
sys.path.insert(0, "benchmarks")
from bench_fp8 import Row
from bench_module import CONFIGS
row = Row(CONFIGS["091_h4096_q32_kv8"], 2, 4096, torch.device("cuda"), torch.bfloat16)
for name in ("rowwise", None):
    fn = row.fwd_bwd(row.fused(name))
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5): fn()
        torch.cuda.synchronize()
    print(f"== fp8={name}, 8192 tokens, 5 calls")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
PY
echo "profile rc=$?"
timeout 400 python3 benchmarks/bench_fp8.py --reps 10 --out $W/fp8 > $W/bench_fp8.txt 2>&1; echo "bench rc=$?"
tar -czf $OUT/s17_run2.tgz -C $OUT w
grep -E "Self CUDA time total|fp8=|^ *(Name|rowwise|cast|tile|outer|void|sm90|nvjet|kernel|rope|triton|cutlass)" $W/profile.txt | cut -c1-150 | head -60
tail -14 $W/bench_fp8.txt
