#!/usr/bin/env bash
# session 17, device call 3 (issue 35): the FP8 graph test per recipe (and a capture on the warmed
# stream: is the failure a lazy per-stream initialisation?), the kernel profile after the coalesced
# transposed cast, bench_fp8.py on four rows
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_fp8/*.whl 2>&1 | tail -1
export PYTHONPATH=src:/tmp/site
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py > $W/gpu_tests.txt 2>&1; echo "tests rc=$?"; grep -E "passed|failed|^FAILED" $W/gpu_tests.txt | tail -5
timeout 60 python3 - > $W/graph_diag.txt 2>&1 <<'PY'
import torch, fusedqkv
for name in (None, "rowwise", "tensorwise"):
    for same_stream in (True, False):
        torch.manual_seed(0)
        blk = fusedqkv.GQAQKVRoPEQKNorm(1024, 8, 2, 128, fp8=name, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(2, 200, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ang = torch.randn(1, 200, 128, device="cuda"); cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        g = None
        def step():
            global g
            out = blk(x, cos, sin)
            if g is None: g = [torch.randn_like(o) for o in out]
            return torch.autograd.grad(out, [x, blk.qkv_weight], g)
        step()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(gr, stream=s if same_stream else None):
                step()
            print(name, "same_stream" if same_stream else "new_stream", "capture ok", flush=True)
        except Exception as e:
            print(name, "same_stream" if same_stream else "new_stream", "capture FAILED", str(e).splitlines()[0], flush=True)
            torch.cuda.synchronize()
PY
echo "diag rc=$?"; cat $W/graph_diag.txt | grep capture
timeout 60 python3 - > $W/profile.txt 2>&1 <<'PY'
import torch, sys
sys.path.insert(0, "benchmarks")
from bench_fp8 import Row
from bench_module import CONFIGS
row = Row(CONFIGS["091_h4096_q32_kv8"], 2, 4096, torch.device("cuda"), torch.bfloat16)
fn = row.fwd_bwd(row.fused("rowwise"))
for _ in range(3): fn()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(5): fn()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
PY
grep -E "kernel|nvjet|total" $W/profile.txt | awk '{print $1, $(NF-3), $(NF-2)}' | head -14
timeout 300 python3 benchmarks/bench_fp8.py --reps 10 --rows 0,1,2,9 --out $W/fp8 > $W/bench_fp8.txt 2>&1; echo "bench rc=$?"
tar -czf $OUT/s17_run3.tgz -C $OUT w
tail -7 $W/bench_fp8.txt
