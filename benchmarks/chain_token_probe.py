"""Probe: the 091 call's kernels, one by one, at token counts between 128 and 256, under configurations
given as config changes (``bench_091_backward.py --variant`` syntax). GPU-only (profiler kernel times,
L2 flushed before every call, a GPU sleep queued after the flush so that no launch waits for
the host); the median duration of each kernel by its place in the call, and the span.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=... python3 benchmarks/chain_token_probe.py --out DIR \
        --tokens 128,131,256 --variant "c128:chain_max_tokens=256;chain_min_balance=0;chain_dx_above_128=128,64,64,4,6,1"

Prints a table last; writes chain_token_probe.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem, timing
from fusedqkv.ops import backward_091, config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chain_token_probe_out")
    ap.add_argument("--tokens", default="128,131,136,144,160,192,224,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:CHANGES")
    ap.add_argument("--events-loop", action="store_true",
                    help="instead: the CUDA-event clock's own loop (flush, event, call, event; no sync), with the "
                         "host's time per iteration and per call stamped, the variants in interleaved rounds")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = dict([("default", {})] + [config.parse_variant(v) for v in args.variant])
    dev = torch.device("cuda")
    defn = problem.load_definition()
    base = defn.workload(2)
    flusher = timing.L2Flusher(dev)
    if args.events_loop:
        return events_loop(args, defn, base, variants, flusher)
    rows = []
    for m in [int(t) for t in args.tokens.split(",")]:
        a = _inputs(defn, base, m)
        ref = gqa_qkv_rope_qk_norm_backward(*a)
        for name, changes in variants.items():
            out = tuple(torch.empty_like(t) for t in ref)
            with config.override(**changes):
                fn = lambda: gqa_qkv_rope_qk_norm_backward(*a, out=out)  # noqa: E731
                fn()
                path = backward_091.PLANS.last().path
                # a GPU sleep after each flush: the host queues the whole call before the GPU starts it
                # (no host gaps: GPU time alone); its kernel is dropped from the call
                calls = timing.profile_kernel_calls(fn, reps=args.reps, flusher=flusher,
                                                    before=lambda: torch.cuda._sleep(200_000), skip=("spin_kernel",))
            close = all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2) for x, y in zip(out, ref))
            n = min(len(c) for c in calls)
            kernels = []
            for i in range(n):
                names = {c[i][0] for c in calls}
                kernels.append({"name": sorted(names)[0][:40],
                                "us": statistics.median((c[i][2] - c[i][1]) for c in calls),
                                "start_us": statistics.median((c[i][1] - c[0][1]) for c in calls)})
            span = statistics.median(max(k[2] for k in c) - c[0][1] for c in calls)
            rows.append({"tokens": m, "variant": name, "path": path, "close": close, "span_us": span,
                         "kernels": kernels})
            print(f"{m} {name}: done", flush=True)
    _save(args.out, "chain_token_probe.json", rows)
    print(f"\n{torch.cuda.get_device_name()} | GPU-only, cold L2, median of {args.reps} | per kernel: duration "
          f"(start after the first kernel's start), us")
    for r in rows:
        ks = "  ".join(f"{k['name'][:22]} {k['us']:.1f} (@{k['start_us']:.1f})" for k in r["kernels"])
        print(f"{r['tokens']:5d} {r['variant']:<10s} {r['path']:>6s} {'ok' if r['close'] else 'DIFF':>4s} "
              f"span {r['span_us']:6.1f} | {ks}")
    return 0


def _inputs(defn, base, m: int) -> list:
    """091's inputs at 1 x m tokens (w02's shape otherwise), on the GPU."""
    w = dataclasses.replace(base, axes={**base.axes, "batch_size": 1, "seq_len": m})
    return list(problem.generate_inputs(defn, w, device=torch.device("cuda"), seed=m).values())


def _save(out: str, name: str, rows: list) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def events_loop(args, defn, base, variants, flusher) -> int:
    """Per variant: the events' median, and the host's time per iteration of the loop and per call
    (perf_counter, no sync inside the loop): a loop whose iterations take the host longer than the
    GPU's flush + call leaves the GPU idle before each call's first kernel, inside its events."""
    rows = []
    for m in [int(t) for t in args.tokens.split(",")]:
        a = _inputs(defn, base, m)
        ref = gqa_qkv_rope_qk_norm_backward(*a)
        outs = {k: tuple(torch.empty_like(t) for t in ref) for k in variants}
        got = {k: {"events": [], "iter_us": [], "call_us": [], "flush_us": []} for k in variants}
        for _ in range(args.rounds):
            for name, changes in variants.items():
                with config.override(**changes):
                    fn = (lambda o=outs[name]: gqa_qkv_rope_qk_norm_backward(*a, out=o))
                    for _ in range(5):
                        flusher()
                        fn()
                    torch.cuda.synchronize()
                    path = backward_091.PLANS.last().path
                    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(args.reps)]
                    fl = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(5)]
                    for fs, fe in fl:  # the flush alone, outside the loop (its events would add host time)
                        fs.record()
                        flusher()
                        fe.record()
                    torch.cuda.synchronize()
                    calls = []
                    t0 = time.perf_counter()
                    for s, e in ev:
                        flusher()
                        s.record()
                        ta = time.perf_counter()
                        fn()
                        calls.append(time.perf_counter() - ta)
                        e.record()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                g = got[name]
                g["path"] = path
                g["events"] += [s.elapsed_time(e) * 1e3 for s, e in ev]
                g["flush_us"] += [s.elapsed_time(e) * 1e3 for s, e in fl]
                g["iter_us"].append((t1 - t0) / args.reps * 1e6)
                g["call_us"] += [c * 1e6 for c in calls]
        for name, g in got.items():
            rows.append({"tokens": m, "variant": name, "path": g["path"],
                         **{k: statistics.median(g[k]) for k in ("events", "iter_us", "call_us", "flush_us")},
                         "events_p80": sorted(g["events"])[int(0.8 * (len(g["events"]) - 1))]})
        print(f"{m}: done", flush=True)
    _save(args.out, "chain_token_events_loop.json", rows)
    print(f"\n{torch.cuda.get_device_name()} | the events loop, {args.rounds} interleaved rounds of {args.reps} | us, "
          f"medians: events (p80), host per loop iteration, host per call, the flush on the GPU")
    for r in rows:
        print(f"{r['tokens']:5d} {r['variant']:<10s} {r['path']:>6s} events {r['events']:6.1f} ({r['events_p80']:6.1f}) "
              f"iter {r['iter_us']:6.1f} call {r['call_us']:6.1f} flush {r['flush_us']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
