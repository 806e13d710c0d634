"""Session 25 probe: where a planned cuBLASLt call's host time goes (w02's dX, 131 tokens).

Interleaved rounds, median us per call: torch.mm(out=), LtMatmul.__call__ as the 091 plan calls it
(capture known), the same with capture asked inside, the workspace lookup alone, and the bare
cublasLtMatmul through ctypes with every argument prebuilt.
"""
import ctypes
import json
import statistics
import sys
import time

import torch

from fusedqkv.ops import cublaslt, device as D
from fusedqkv.ops.config import Config

M, K, N = 131, 6144, 4096
dev = torch.device("cuda")
a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
d = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
lt = cublaslt.lt_matmul(a, b, d, Config())
stream = torch.cuda.current_stream().cuda_stream
ap, bp, dp = a.data_ptr(), b.data_ptr(), d.data_ptr()
ws = D.workspace("cublaslt", dev, stream, lt.ws_bytes, False)
b_l, a_l, d_l = lt.layouts
args = (lt.handle, lt.desc, lt.scalars[0], bp, b_l, ap, a_l, lt.scalars[1], dp, d_l, dp, d_l, lt.algos[0],
        ws.data_ptr(), lt.ws_bytes, stream)
raw = lt.lib.matmul
vp = ctypes.c_void_p
pre = tuple(vp(x) if i not in (14,) else ctypes.c_size_t(x) for i, x in enumerate(args))
try:
    raw(*pre)
    pre_ok = True
except Exception as e:  # noqa: BLE001
    print("prebuilt ctypes args refused:", e)
    pre_ok = False
cases = {
    "torch.mm(out=)": lambda: torch.mm(a, b, out=d),
    "LtMatmul(capture=False)": lambda: lt(ap, bp, dp, stream, False),
    "LtMatmul(capture=None)": lambda: lt(ap, bp, dp, stream),
    "workspace lookup": lambda: D.workspace("cublaslt", dev, stream, lt.ws_bytes, False),
    "capturing(dev)": lambda: D.capturing(dev),
    "raw cublasLtMatmul, int args": lambda: raw(*args),
    "cublasLtGetVersion (no args)": cublaslt._find_library().cublasLtGetVersion,
}
if pre_ok:
    cases["raw cublasLtMatmul, prebuilt ctypes args"] = lambda: raw(*pre)
res = {k: [] for k in cases}
calls = 50
for f in cases.values():
    for _ in range(5):
        f()
torch.cuda.synchronize()
for r in range(31):
    order = list(cases.items())
    order = order[r % len(order):] + order[:r % len(order)]
    for name, f in order:
        torch.cuda._sleep(2_000_000)  # the GPU busy: host time only
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        res[name].append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
out = {k: statistics.median(v) for k, v in res.items()}
for k, v in out.items():
    print(f"{k:45s} {v:7.2f} us")
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
