"""Can the forward stage hide behind the projection GEMM? A probe for issue 24 before any plan is
built on it: the tokens cut into ``k`` chunks, chunk i's GEMM (``torch.mm``) on the main stream
while chunk i-1's RoPE + QK-norm stage runs on a second stream (an event per chunk orders each
stage after its own GEMM). Against the planned forward of today (one GEMM, then the stage) and the
GEMM alone (the floor), and the same chunks on one stream (what the cut itself costs). Each
provider a CUDA graph, timed interleaved (rotating order, L2 flushed), median of --reps.

    PYTHONPATH=src python3 benchmarks/chunked_forward_probe.py --out $OUT/chunks

Prints a table last; writes --out/chunked_forward_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fusedqkv.ops import training_forward as P
from fusedqkv.ops.gqa_forward import rope_qk_norm_forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_families as BF  # noqa: E402  (time_graphs_interleaved)

CONFIGS = {  # name: (hidden, hq, hkv, D, norm position)
    "091_h4096_q32_kv8": (4096, 32, 8, 128, "after_rope"),
    "h5120_q64_kv8": (5120, 64, 8, 128, "before_rope"),
}
CHUNKS = (2, 4, 8)


def providers(hidden, hq, hkv, D, pos, M, dev):
    g = torch.Generator(device="cpu").manual_seed(M)
    n_tot = (hq + 2 * hkv) * D
    x = torch.randn(1, M, hidden, generator=g).to(dev, torch.bfloat16)
    W = (torch.randn(n_tot, hidden, generator=g) * hidden ** -0.5).to(dev, torch.bfloat16)
    wq = (torch.rand(D, generator=g) + 0.5).to(dev, torch.bfloat16)
    wk = (torch.rand(D, generator=g) + 0.5).to(dev, torch.bfloat16)
    ang = torch.randn(1, M, D, generator=g).to(dev)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    after = pos == "after_rope"
    plan = P.forward_plan(x, W, wq, wk, cos, sin, hq, hkv, 1e-6, pos, "auto")
    x2d = x.view(M, hidden)
    qkv = torch.empty(1, M, n_tot, device=dev, dtype=torch.bfloat16)
    qkv2d = qkv.view(M, n_tot)
    side = torch.cuda.Stream(dev)

    def chunked(k, two_streams):
        bounds = [(i * M // k, (i + 1) * M // k) for i in range(k)]

        def call():
            main = torch.cuda.current_stream()
            outs = []
            if two_streams:
                side.wait_stream(main)
            for t0, t1 in bounds:
                torch.mm(x2d[t0:t1], W.t(), out=qkv2d[t0:t1])
                if two_streams:
                    side.wait_stream(main)  # this chunk's GEMM is done
                    with torch.cuda.stream(side):
                        outs.append(rope_qk_norm_forward(qkv[:, t0:t1], wq, wk, cos[:, t0:t1], sin[:, t0:t1], hq,
                                                         hkv, 1e-6, after))
                else:
                    outs.append(rope_qk_norm_forward(qkv[:, t0:t1], wq, wk, cos[:, t0:t1], sin[:, t0:t1], hq, hkv,
                                                     1e-6, after))
            if two_streams:
                main.wait_stream(side)
            return outs
        return call

    calls = {"floor": lambda: torch.mm(x2d, W.t(), out=qkv2d),
             "fused": lambda: P.run_forward(plan, x, W, wq, wk, cos, sin)}
    for k in CHUNKS:
        calls[f"{k} chunks, 1 stream"] = chunked(k, False)
        calls[f"{k} chunks, 2 streams"] = chunked(k, True)
    return calls, [x, W, wq, wk, cos, sin, qkv, plan, side]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chunked_forward_probe_out")
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, shape in CONFIGS.items():
        for M in (int(t) for t in a.tokens.split(",")):
            calls, keep = providers(*shape, M, dev)
            ms = BF.time_graphs_interleaved(calls, a.reps)
            med = {n: statistics.median(v) for n, v in ms.items()}
            rows.append(dict(config=name, tokens=M, ms=med, over_floor={n: v / med["floor"] for n, v in med.items()}))
            del calls, keep
            torch.cuda.empty_cache()
            print(f"{name} {M}: " + ", ".join(f"{n} {v:.3f}" for n, v in rows[-1]["over_floor"].items()), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "chunked_forward_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    names = list(rows[0]["ms"])
    print("| config | tokens | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['config']} | {r['tokens']} | " + " | ".join(f"{r['over_floor'][n]:.3f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
