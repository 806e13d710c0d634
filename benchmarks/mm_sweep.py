"""dX = dQKV . W and dW = dQKV^T . X at few tokens with the persistent TMA kernel
(``ops.projection.tma_matmul_on``) against cuBLAS, on the GPU alone (a GPU sleep queued after each
L2 flush, so no launch waits for the host; the sleep is not counted). Per pair of dX/dW
configurations: each alone, both in order on one stream, both on two streams, and chained by
programmatic dependent launch (dX lets dW launch at once; dW waits for dX at its end).

    PYTHONPATH=src python3 benchmarks/mm_sweep.py --out $OUT/mm --pairs "64/64/64/4/6/1+128/128/64/8/2/1"
    PYTHONPATH=src python3 benchmarks/mm_sweep.py --out $OUT/mm --tokens 131,512 --dw "128/128/64/8/2/2,..."

A configuration is rows/cols/K-step/warps/stages/programs-per-SM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fusedqkv.bench import timing
from fusedqkv.ops import projection
from fusedqkv.ops.rope_qk_norm import sm_count

SLEEP_NAME = "spin_kernel"


def spans(fn, flusher, reps, cycles):
    calls = [c for c in timing.profile_kernel_calls(fn, reps=reps, warmup=3, flusher=flusher,
                                                    before=lambda: torch.cuda._sleep(cycles), skip=(SLEEP_NAME,)) if c]
    s = [max(e for _, _, e in c) - min(b for _, b, _ in c) for c in calls]
    return statistics.median(s)


def closeness(a, b):
    a, b = a.float(), b.float()
    return float(((a - b).abs() <= b.abs() * 2 ** -7 + 1e-6).float().mean())


def parse(cfg):
    """rows/cols/K-step/warps/stages/programs-per-SM -> ``tma_matmul``'s config tuple."""
    return tuple(int(v) for v in cfg.split("/"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mm_out")
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--pairs", default="", help="dxcfg+dwcfg,... (cfg = rows/cols/K-step/warps/stages/programs-per-SM)")
    ap.add_argument("--dw", default="", help="dW configurations timed alone: cfg,cfg,...")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = int(150e-6 * 1.98e9)
    flusher = timing.L2Flusher(dev)
    sms = sm_count(dev)
    side = torch.cuda.Stream()
    rows = []
    for M in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device=dev).manual_seed(M)
        dq = torch.randn(M, 6144, device=dev, generator=g).bfloat16()
        w = (torch.randn(6144, 4096, device=dev, generator=g) / 64).bfloat16()
        x = torch.randn(M, 4096, device=dev, generator=g).bfloat16()
        dx, dw = torch.empty(M, 4096, device=dev, dtype=torch.bfloat16), torch.empty_like(w)
        rdx, rdw = dq @ w, dq.t() @ x
        row = {"tokens": M,
               "cublas": spans(lambda: (torch.mm(dq, w, out=dx), torch.mm(dq.t(), x, out=dw)), flusher, args.reps,
                               cycles),
               "cublas_dx": spans(lambda: torch.mm(dq, w, out=dx), flusher, args.reps, cycles),
               "cublas_dw": spans(lambda: torch.mm(dq.t(), x, out=dw), flusher, args.reps, cycles)}
        for cfg in filter(None, args.dw.split(",")):
            r = {}
            try:
                ldw = projection.tma_matmul_on(dq, x, dw, trans_a=True, config=parse(cfg), sms=sms)
                dw.fill_(float("nan"))
                ldw()
                torch.cuda.synchronize()
                r["close"] = [closeness(dw, rdw)]
                r["dw"] = spans(ldw, flusher, args.reps, cycles)
            except Exception as e:  # noqa: BLE001 -- a config that does not fit: recorded
                r["error"] = repr(e)[:300]
            row["dw " + cfg] = r
        for pair in filter(None, args.pairs.split(",")):
            cx, cw = (parse(c) for c in pair.split("+"))
            r = {}
            try:
                def mk(cfg, a, b, c, ta, **kw):
                    return projection.tma_matmul_on(a, b, c, trans_a=ta, config=cfg, sms=sms, **kw)

                def check(*launches):
                    """Run the launches once on NaN-filled outputs: fractions of dX, dW within one
                    bf16 rounding of cuBLAS's."""
                    dx.fill_(float("nan"))
                    dw.fill_(float("nan"))
                    for launch in launches:
                        launch()
                    torch.cuda.synchronize()
                    return closeness(dx, rdx), closeness(dw, rdw)

                ldx, ldw = mk(cx, dq, w, dx, False), mk(cw, dq, x, dw, True)
                r["close"] = check(ldx, ldw)
                r["dx"] = spans(ldx, flusher, args.reps, cycles)
                r["dw"] = spans(ldw, flusher, args.reps, cycles)
                r["serial"] = spans(lambda: (ldx(), ldw()), flusher, args.reps, cycles)
                ev0, ev1 = torch.cuda.Event(), torch.cuda.Event()

                def two_streams():
                    ev0.record()
                    side.wait_event(ev0)
                    with torch.cuda.stream(side):
                        ldw2()
                        ev1.record(side)
                    ldx()
                    torch.cuda.current_stream().wait_event(ev1)
                with torch.cuda.stream(side):
                    ldw2 = mk(cw, dq, x, dw, True)
                r["streams"] = spans(two_streams, flusher, args.reps, cycles)
                cdx = mk(cx, dq, w, dx, False, pdl=True, trigger=True)
                cdw = mk(cw, dq, x, dw, True, pdl=True, wait_at_end=True)
                r["close_pdl"] = check(cdx, cdw)
                r["pdl"] = spans(lambda: (cdx(), cdw()), flusher, args.reps, cycles)
            except Exception as e:  # noqa: BLE001 -- a config that does not fit: recorded
                r["error"] = repr(e)[:300]
            row[pair] = r
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "mm_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} | cold L2 | GPU-only span, median of {args.reps}, us")
    for r in rows:
        print(f"tokens {r['tokens']}: cuBLAS {r['cublas']:.1f} (dx {r['cublas_dx']:.1f}, dw {r['cublas_dw']:.1f})")
        for cfg in filter(None, args.dw.split(",")):
            v = r["dw " + cfg]
            print(f"  dW {cfg:<31s} " + (f"ERROR {v['error'][:120]}" if "error" in v else
                                           f"dw {v['dw']:6.1f}  close {v['close'][0]:.4f}"))
        for pair in filter(None, args.pairs.split(",")):
            v = r[pair]
            if "error" in v:
                print(f"  {pair:<34s} ERROR {v['error'][:120]}")
                continue
            print(f"  {pair:<34s} dx {v['dx']:6.1f} dw {v['dw']:6.1f} serial {v['serial']:6.1f} streams "
                  f"{v['streams']:6.1f} pdl {v['pdl']:6.1f}  close {min(v['close'] + v['close_pdl']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
