#!/usr/bin/env bash
# session 17, device call 4 (issue 35): the rowwise cast in one read; A/B of rowwise scales in
# cuBLASLt's epilogue (ROWWISE_IN_EPILOGUE) against torchao's unit-scaled GEMM + scaling pass
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_fp8/*.whl 2>&1 | tail -1
export PYTHONPATH=src:/tmp/site
timeout 120 python3 - > $W/ab.txt 2>&1 <<'PY'
import sys, statistics, torch
sys.path.insert(0, "benchmarks")
from bench_fp8 import Row
from bench_module import CONFIGS
from bench_families import capture_graph
from fusedqkv.bench import timing
from fusedqkv.ops import fp8
fl = timing.L2Flusher(torch.device("cuda"))
for b, s in ((2, 4096), (1, 32768)):
    row = Row(CONFIGS["091_h4096_q32_kv8"], b, s, torch.device("cuda"), torch.bfloat16)
    graphs, outs = {}, {}
    for flag in (False, True):
        fp8.ROWWISE_IN_EPILOGUE = flag
        fn = row.fwd_bwd(row.fused("rowwise"))
        outs[flag] = [t.clone() for t in fn()]
        graphs[flag] = capture_graph(fn)[0]
    fp8.ROWWISE_IN_EPILOGUE = False
    bf = capture_graph(row.fwd_bwd(row.fused(None)))[0]
    ms = timing.time_cuda_events_interleaved({"unit+scale": graphs[False].replay, "epilogue": graphs[True].replay,
                                              "bf16": bf.replay}, reps=15, warmup=3, flusher=fl)
    med = {k: statistics.median(v) for k, v in ms.items()}
    diff = [float((a.float() - c.float()).abs().max() / c.float().abs().max()) for a, c in zip(outs[True], outs[False])]
    print(f"tokens {b*s}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()) + f"; max rel diff epi vs unit {max(diff):.2e}")
PY
echo "ab rc=$?"; cat $W/ab.txt | grep tokens
timeout 200 python3 benchmarks/bench_fp8.py --reps 10 --rows 1,2,9 --out $W/fp8 > $W/bench_fp8.txt 2>&1; echo "bench rc=$?"
tar -czf $OUT/s17_run4.tgz -C $OUT w
tail -4 $W/bench_fp8.txt
