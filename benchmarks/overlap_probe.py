"""Can a memory-bound stage hide behind a cuBLAS GEMM on this card? (issue 24, backward)

Times, as CUDA graphs replayed interleaved with the L2 flushed before each (median of --reps):
``gemm`` (the backward's dX product at the 091 shape: dQKV [T, 6144] . W [6144, 4096]),
``stage`` (a memory-bound kernel of ours: the forward stage over qkv [T, 6144], ~180 MB at 8192
tokens) and ``copy`` (a device copy of 79 MB at 8192 tokens: 157 MB moved), then each pair one after the other on one stream
(``seq``) and forked onto two streams (``conc``). Overlap = (gemm + other - conc) / other: 1 when
the other kernel hides fully behind the GEMM, 0 when the two run back to back.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/overlap_probe.py --out $OUT/overlap
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fusedqkv.bench import timing
from fusedqkv.ops.gqa_forward import rope_qk_norm_forward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="overlap_out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    a = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, hidden = 32, 8, 128, 4096
    n = (hq + 2 * hkv) * d
    rows = []
    for T in a.tokens:
        g = torch.Generator(device=dev).manual_seed(0)
        dqkv = torch.randn(T, n, generator=g, device=dev, dtype=dt)
        w = torch.randn(n, hidden, generator=g, device=dev, dtype=dt)
        dx = torch.empty(T, hidden, device=dev, dtype=dt)
        qkv = torch.randn(1, T, n, generator=g, device=dev, dtype=dt)
        wq = torch.ones(d, device=dev, dtype=dt)
        ang = torch.randn(1, T, d, generator=g, device=dev)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        src = torch.empty(75 * 2 ** 20 // 2 * T // 8192, device=dev, dtype=dt)  # 79 MB at 8192 tokens
        dst = torch.empty_like(src)
        kept = []

        def gemm():
            torch.mm(dqkv, w, out=dx)

        def stage():
            kept.append(rope_qk_norm_forward(qkv, wq, wq, cos, sin, hq, hkv, 1e-6, True))

        def copy():
            dst.copy_(src)

        def graph(fn_a, fn_b=None, fork=False):
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
            for _ in range(2):  # warm-up outside the capture
                fn_a()
                if fn_b:
                    fn_b()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                if fork:
                    cur = torch.cuda.current_stream()
                    s1.wait_stream(cur)
                    s2.wait_stream(cur)
                    with torch.cuda.stream(s1):
                        fn_a()
                    with torch.cuda.stream(s2):
                        fn_b()
                    cur.wait_stream(s1)
                    cur.wait_stream(s2)
                else:
                    fn_a()
                    if fn_b:
                        fn_b()
            return gr

        graphs = {"gemm": graph(gemm), "stage": graph(stage), "copy": graph(copy),
                  "seq_stage": graph(gemm, stage), "conc_stage": graph(gemm, stage, True),
                  "seq_copy": graph(gemm, copy), "conc_copy": graph(gemm, copy, True)}
        ms = timing.time_cuda_events_interleaved({k: v.replay for k, v in graphs.items()}, a.reps)
        med = {k: statistics.median(v) for k, v in ms.items()}
        row = dict(tokens=T, ms=med)
        for other in ("stage", "copy"):
            row[f"overlap_{other}"] = (med["gemm"] + med[other] - med[f"conc_{other}"]) / med[other]
        rows.append(row)
        del graphs, kept
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap_probe.json").write_text(json.dumps(dict(rows=rows), indent=1))
    print(f"{'tokens':>6} {'gemm':>7} {'stage':>7} {'copy':>7} {'seq_st':>7} {'conc_st':>8} {'ovl_st':>7} "
          f"{'seq_cp':>7} {'conc_cp':>8} {'ovl_cp':>7}")
    for r in rows:
        m = r["ms"]
        print(f"{r['tokens']:6d} {m['gemm']:7.3f} {m['stage']:7.3f} {m['copy']:7.3f} {m['seq_stage']:7.3f} "
              f"{m['conc_stage']:8.3f} {r['overlap_stage']:7.2f} {m['seq_copy']:7.3f} {m['conc_copy']:8.3f} "
              f"{r['overlap_copy']:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
