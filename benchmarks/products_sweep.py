"""The two products of the 091 backward at few tokens: one Triton launch through TMA
descriptors (``ops.projection.products_triton``) against cuBLAS (``torch.mm`` x 2), on the
GPU alone -- a GPU sleep is queued after each L2 flush so that no launch waits for the host
("padded" spans; the sleep is not counted). Several tile configurations, each checked
against cuBLAS (fraction within one bf16 rounding, fraction bit-equal).

    PYTHONPATH=src python3 benchmarks/products_sweep.py --out $OUT/products [--tokens 128,512]
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
from fusedqkv.ops.rope_qk_norm import sm_count, ticket_buffer

SLEEP_NAME = "spin_kernel"
CONFIGS = {
    "A": {},
    "bm128": {"P_BM": 128},
    "bnw256": {"P_BNW": 256},
    "w4": {"P_WARPS": 4},
    "pps4": {"P_PROGRAMS_PER_SM": 4},
    "pps1": {"P_PROGRAMS_PER_SM": 1},
    "sw2": {"P_STAGES_W": 2},
    "bk128": {"P_BK": 128, "P_STAGES_X": 3},
    "r128": {"P_MAXNREG": 128},
    "r128pps4": {"P_MAXNREG": 128, "P_PROGRAMS_PER_SM": 4},
}


def spans(fn, flusher, reps, cycles):
    calls = [c for c in timing.profile_kernel_calls(fn, reps=reps, warmup=3, flusher=flusher,
                                                    before=lambda: torch.cuda._sleep(cycles), skip=(SLEEP_NAME,)) if c]
    s = [max(e for _, _, e in c) - min(b for _, b, _ in c) for c in calls]
    return statistics.median(s), [(n[:24], round(e - b, 1)) for n, b, e in calls[len(calls) // 2]]


def closeness(a, b):
    a, b = a.float(), b.float()
    return (float(((a - b).abs() <= b.abs() * 2 ** -7 + 1e-6).float().mean()), float((a == b).float().mean()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="products_out")
    ap.add_argument("--tokens", default="128,131,256,512,586,1024")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="names from CONFIGS, or name:P_ATTR=value/P_ATTR=value (ints)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", action="store_true", help="also time each config's dX and dW parts alone")
    ap.add_argument("--nqkv", type=int, default=6144)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = int(150e-6 * 1.98e9)
    flusher = timing.L2Flusher(dev)
    sms = sm_count(dev)
    projection.PRODUCTS_MAX_TOKENS = 1 << 30
    names = []
    for c in args.configs.split(","):
        if ":" in c:
            name, spec = c.split(":", 1)
            CONFIGS[name] = {k: int(v) for k, v in (kv.split("=") for kv in spec.split("/"))}
            c = name
        names.append(c)
    rows = []
    for M in [int(t) for t in args.tokens.split(",")]:
        g = torch.Generator(device=dev).manual_seed(M)
        dq = torch.randn(M, args.nqkv, device=dev, generator=g).bfloat16()
        w = (torch.randn(args.nqkv, args.hidden, device=dev, generator=g) / 64).bfloat16()
        x = torch.randn(M, args.hidden, device=dev, generator=g).bfloat16()
        dx, dw = torch.empty(M, args.hidden, device=dev, dtype=torch.bfloat16), torch.empty_like(w)
        rdx, rdw = dq @ w, dq.t() @ x

        def cublas():
            torch.mm(dq, w, out=dx)
            torch.mm(dq.t(), x, out=dw)

        row = {"tokens": M, "cublas": spans(cublas, flusher, args.reps, cycles)}
        for part in ("dx", "dw"):
            f = (lambda: torch.mm(dq, w, out=dx)) if part == "dx" else (lambda: torch.mm(dq.t(), x, out=dw))
            row[f"cublas_{part}"] = spans(f, flusher, args.reps, cycles)
        for name in names:
            old = {k: getattr(projection, k) for k in CONFIGS[name]}
            for k, v in CONFIGS[name].items():
                setattr(projection, k, v)
            try:
                tick = ticket_buffer(dev, projection.products_plan(M, args.nqkv, args.hidden, sms)[2], slot="sweep")
                fn = lambda: projection.products_triton(dq, w, x, dx, dw, tick, sms)  # noqa: E731
                dx.fill_(float("nan"))
                dw.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row[name] = {"dx_close": closeness(dx, rdx), "dw_close": closeness(dw, rdw),
                             "plan": projection.products_plan(M, args.nqkv, args.hidden, sms),
                             "padded": spans(fn, flusher, args.reps, cycles)}
                if args.parts:
                    for part in ("dx", "dw"):
                        f = lambda part=part: projection.products_triton(dq, w, x, dx, dw, tick, sms,  # noqa: E731
                                                                         do_dx=part == "dx", do_dw=part == "dw")
                        row[name][f"{part}_only"] = spans(f, flusher, args.reps, cycles)
            except Exception as e:  # a config that does not compile or fit: recorded, not fatal
                row[name] = {"error": repr(e)[:300]}
            for k, v in old.items():
                setattr(projection, k, v)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "products_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} | cold L2 | GPU-only span, median of {args.reps}, us")
    print(f"{'tokens':>6s} {'cuBLAS':>7s} {'(dx':>6s} {'dw)':>6s} " +
          " ".join(f"{n:>16s}" for n in names) + "   min close dx/dw    [cells: both (dx-only/dw-only)]")
    for r in rows:
        cells = []
        worst = 1.0
        for n in names:
            v = r[n]
            if "error" in v:
                cells.append(f"{'ERR':>16s}")
            else:
                parts = (f"({v['dx_only'][0]:.0f}/{v['dw_only'][0]:.0f})" if "dx_only" in v else "")
                cells.append(f"{v['padded'][0]:6.1f}{parts:>10s}")
                worst = min(worst, v["dx_close"][0], v["dw_close"][0])
        print(f"{r['tokens']:6d} {r['cublas'][0]:7.1f} {r['cublas_dx'][0]:6.1f} {r['cublas_dw'][0]:6.1f} "
              + " ".join(cells) + f"   {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
