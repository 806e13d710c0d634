"""Where the time of one 091 backward call goes on the GPU: per-kernel durations, the idle gaps
between our launches, and the same call with the host taken out of the picture.

For each selected workload and each implementation (fusedqkv, the cuBLAS GEMM floor):
  * ``span``: first kernel start to last kernel end after an L2 flush (the official timer);
  * ``padded``: the same, with a GPU sleep queued between the flush and the call, so every
    launch of the call is queued before the GPU reaches it -- the span without host gaps;
  * per kernel of the median call: start offset, duration (kernel names shortened).
``span - padded`` is the host-bound idle time inside one call.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=... python3 benchmarks/diag_timeline.py --out $OUT [--workloads 11,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import harness, problem, timing

SLEEP_NAME = "spin_kernel"  # torch.cuda._sleep's kernel


def profile_calls(fn, flusher, reps, sleep_cycles=0):
    """Kernels of each call; with ``sleep_cycles``, a GPU sleep queued first (and dropped)."""
    before = (lambda: torch.cuda._sleep(sleep_cycles)) if sleep_cycles else None
    return [c for c in timing.profile_kernel_calls(fn, reps=reps, warmup=3, flusher=flusher, before=before,
                                                   skip=(SLEEP_NAME,)) if c]


def short(name: str) -> str:
    for k in ("rope_qk_norm_bwd", "single_launch", "tma_matmul_kernel", "nvjet", "sm90_xmma", "cutlass", "gemm",
              "Kernel"):
        if k in name:
            return k if k != "Kernel" else name[:40]
    return name[:40]


def summarize_calls(calls):
    spans = [max(e for _, _, e in c) - min(s for _, s, _ in c) for c in calls]
    med = statistics.median(spans)
    # the call closest to the median span
    i = min(range(len(calls)), key=lambda j: abs(spans[j] - med))
    c = calls[i]
    t0 = min(s for _, s, _ in c)
    kernels = [(short(n), round(s - t0, 1), round(e - s, 1)) for n, s, e in c]
    busy = sum(e - s for _, s, e in c)
    return {"span_us": med, "kernels_of_median_call": kernels, "busy_us": busy, "n_calls": len(calls)}


def apply_settings(spec: str) -> dict:
    """``mod.ATTR=value,...`` on fusedqkv.ops modules; returns the previous values."""
    import importlib

    old = {}
    for item in filter(None, spec.split(",")):
        lhs, val = item.split("=")
        mod_name, attr = lhs.rsplit(".", 1)
        mod = importlib.import_module(f"fusedqkv.ops.{mod_name}")
        old[item] = (mod, attr, getattr(mod, attr))
        cur = getattr(mod, attr)
        if isinstance(cur, tuple):
            new = tuple(int(v) for v in val.split("/"))
        elif isinstance(cur, bool):
            new = val not in ("0", "False", "false")
        else:
            new = type(cur)(val)
        setattr(mod, attr, new)
    return old


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag_timeline_out")
    ap.add_argument("--workloads", default="11,2,8,9,15,13,3,1,14,5,0")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sleep-us", type=float, default=300.0)
    ap.add_argument("--modes", default="default:",
                    help="name:mod.ATTR=value,...;name2:... -- settings of fusedqkv.ops modules per variant")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    cycles = int(args.sleep_us * 1e-6 * 1.98e9)
    defn = problem.load_definition()
    ref = problem.load_official_reference()
    flusher = timing.L2Flusher(dev)
    modes = [m.split(":", 1) for m in args.modes.split(";")]
    rows = []
    for idx in [int(x) for x in args.workloads.split(",")]:
        w = defn.workloads[idx]
        a = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        ref_out = ref(*a) if ref is not None else None
        floor = harness.IMPLEMENTATIONS["gemm_floor"].prepare(None, a, None)
        row = {"workload": w.name, "tokens": w.tokens,
               "gemm_floor": {"span": summarize_calls(profile_calls(floor, flusher, args.reps)),
                              "padded": summarize_calls(profile_calls(floor, flusher, args.reps, cycles))}}
        for name, spec in modes:
            old = apply_settings(spec)
            out = tuple(torch.empty_like(t) for t in gqa_qkv_rope_qk_norm_backward(*a))
            got = gqa_qkv_rope_qk_norm_backward(*a, out=out)
            ok = None
            if ref_out is not None:
                ok = all(c.passed for c in problem.check_outputs(list(defn.outputs), got, ref_out, w))
            fn = lambda a=a, out=out: gqa_qkv_rope_qk_norm_backward(*a, out=out)  # noqa: E731
            row[name] = {"pass": ok, "span": summarize_calls(profile_calls(fn, flusher, args.reps)),
                         "padded": summarize_calls(profile_calls(fn, flusher, args.reps, cycles))}
            for mod, attr, val in old.values():
                setattr(mod, attr, val)
        rows.append(row)
        print(f"{w.name} done", flush=True)
    with open(os.path.join(args.out, "diag_timeline.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} | cold L2 | median of {args.reps} | us | padded: a GPU sleep queued "
          f"before each call, so no host gap (sleep excluded)")
    for r in rows:
        fl = r["gemm_floor"]
        print(f"{r['workload']:<14s} {r['tokens']:5d} floor span {fl['span']['span_us']:7.1f} padded "
              f"{fl['padded']['span_us']:7.1f} | " + " ".join(f"{n}@{s:g}+{d:g}" for n, s, d in
                                                       fl["padded"]["kernels_of_median_call"]))
        for name, _ in modes:
            f = r[name]
            ks = " ".join(f"{n}@{s:g}+{d:g}" for n, s, d in f["padded"]["kernels_of_median_call"])
            print(f"   {name:<12s} {'pass' if f['pass'] else 'FAIL' if f['pass'] is False else '?':4s} span "
                  f"{f['span']['span_us']:7.1f} ({f['span']['span_us'] / fl['span']['span_us']:.2f}) padded "
                  f"{f['padded']['span_us']:7.1f} ({f['padded']['span_us'] / fl['padded']['span_us']:.2f}) | {ks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
