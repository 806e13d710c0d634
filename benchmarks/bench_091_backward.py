"""GPU benchmark of SOL-ExecBench 091 backward: fusedqkv vs the eager reference vs the GEMM floor.

One run, all 16 workloads, on the GPU:
  * correctness of fusedqkv against the official reference with the official policy
    (matched ratio per output; grad_cos/grad_sin bit-equality rate), and determinism
    (two calls bitwise identical);
  * cold-L2 timing (L2 flushed before every iteration), median of --reps, by CUDA events
    and by kernel span (the official timer), each taken in --rounds interleaved rounds, of:
    fusedqkv (destination passing), the official eager reference, and the floor of the two
    cuBLAS GEMMs alone (dQKV precomputed);
  * with --tune: the RoPE/QK-norm stage alone under several launch configurations.

Needs the official pack: FUSEDQKV_SOL_EXECBENCH=<folder holding 091_.../definition.json>.
Prints a table last; writes JSON to --out.

    PYTHONPATH=src python benchmarks/bench_091_backward.py --out /tmp/b091 [--tune]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import harness, problem, timing
from fusedqkv.ops import backward_091, config


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_091_out")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="kernel-span samples taken in this many interleaved rounds")
    ap.add_argument("--workloads", default="all")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--diag", action="store_true", help="torch backend on the GPU vs the kernel; host time per call")
    ap.add_argument("--no-span", action="store_true", help="skip the profiler kernel-span timing")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:CHANGES",
                    help="also time fusedqkv under config.override(**parse_changes(CHANGES)) as 'fusedqkv:NAME', "
                         "in the same interleaved rounds (e.g. 'dx128:chain_dx_above_128=128,64,64,4,6,1;"
                         "chain_min_balance=0'); repeatable")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    defn = problem.load_definition()
    try:
        ref = problem.load_official_reference()
    except ValueError as e:  # FUSEDQKV_SOL_EXECBENCH set to a folder without the pack
        print(e, file=sys.stderr)
        return 2
    if ref is None:
        print("official pack not found: set FUSEDQKV_SOL_EXECBENCH", file=sys.stderr)
        return 2
    wls = defn.workloads if args.workloads == "all" else [defn.workload(k) for k in args.workloads.split(",")]
    variants = {}
    for v in args.variant:
        try:
            name, changes = config.parse_variant(v)
        except ValueError as e:
            ap.error(f"--variant: {e}")
        variants["fusedqkv:" + name] = changes
    flusher = timing.L2Flusher(dev)
    names = list(defn.outputs)
    rows = []
    for w in wls:
        inp = problem.generate_inputs(defn, w, device=dev, seed=w.index)
        a = list(inp.values())
        ref_out = ref(*a)
        out = tuple(torch.empty_like(t) for t in ref_out)
        got = gqa_qkv_rope_qk_norm_backward(*a, out=out)
        checks = problem.check_outputs(names, got, ref_out, w)
        again = gqa_qkv_rope_qk_norm_backward(*a)
        deterministic = all(torch.equal(x, y) for x, y in zip(got, again))
        bit_cos = float((got[1] == ref_out[1]).float().mean())
        bit_sin = float((got[2] == ref_out[2]).float().mean())

        M = w.tokens
        impls = {
            "fusedqkv": lambda: gqa_qkv_rope_qk_norm_backward(*a, out=out),
            "eager": lambda: ref(*a),
            # the two products alone, on a precomputed dQKV (the harness's bound)
            "gemm_floor": harness.IMPLEMENTATIONS["gemm_floor"].prepare(None, a, ref_out),
        }
        row = {"workload": w.name, "tokens": M, "checks": [c.to_json() for c in checks],
               "passed": all(c.passed for c in checks), "min_matched": min(c.matched_ratio for c in checks),
               "bit_equal_grad_cos": bit_cos, "bit_equal_grad_sin": bit_sin, "deterministic": deterministic,
               "path": backward_091.PLANS.last().path, "events_ms": {}, "span_ms": {}, "variants": {}}
        contexts = {}
        for name, changes in variants.items():
            v_out = tuple(torch.empty_like(t) for t in ref_out)
            with config.override(**changes):
                v_got = gqa_qkv_rope_qk_norm_backward(*a, out=v_out)
                v_path = backward_091.PLANS.last().path
                v_again = gqa_qkv_rope_qk_norm_backward(*a)
            v_checks = problem.check_outputs(names, v_got, ref_out, w)
            row["variants"][name] = {"changes": {k: list(x) if isinstance(x, tuple) else x for k, x in changes.items()},
                                     "path": v_path, "passed": all(c.passed for c in v_checks),
                                     "deterministic": all(torch.equal(x, y) for x, y in zip(v_got, v_again))}
            impls[name] = (lambda o=v_out: gqa_qkv_rope_qk_norm_backward(*a, out=o))
            contexts[name] = (lambda c=changes: config.override(**c))
        # both clocks in blocks of one implementation's calls (the evaluator's structure: no sync
        # inside a block, so the host runs ahead of the GPU as in a loop of calls), the blocks in
        # --rounds interleaved rounds (fused, eager, floor, fused, ...): a drift of the host or the
        # card's clocks falls on every implementation alike. Not call by call: after a call of the
        # eager reference (~1 ms of launches) the GPU has drained, and a small workload's events
        # would time our host latency, not a loop's steady state.
        clocks = {"events_ms": timing.time_cuda_events}
        if not args.no_span:
            clocks["span_ms"] = timing.time_kernel_span
        samples = {c: {k: [] for k in impls} for c in clocks}
        per_round = -(-args.reps // args.rounds)
        for _ in range(args.rounds):
            for c, timer in clocks.items():
                for k, fn in impls.items():
                    # a variant's config is entered around its block of calls, not inside the timed call
                    with (contexts[k]() if k in contexts else contextlib.nullcontext()):
                        samples[c][k] += timer(fn, reps=per_round, flusher=flusher)
        for c in clocks:
            row[c] = {k: timing.summarize(v) for k, v in samples[c].items()}

        if args.tune:
            # the whole op (kernel span, the official timer) under several stage tiles
            tune = {}
            for fused in (True, False):
                for bt, hb, gs in ((1, 8, 8), (2, 4, 8), (4, 2, 8), (1, 8, 0), (4, 2, 0), (8, 1, 0)):
                    with config.override(fused_finish=fused, stage_tile=(bt, hb, 0, 3, gs)):
                        tune[f"{'F' if fused else 'K'}_T{bt}_g{hb}" + (f"_G{gs}" if gs else "")] = timing.summarize(
                            timing.time_kernel_span(impls["fusedqkv"], reps=max(20, args.reps // 2),
                                                    flusher=flusher))["median"]
            row["tune_ms"] = tune
        if args.diag:
            tb = gqa_qkv_rope_qk_norm_backward(*a, backend="torch")
            row["diag_torch_backend_on_gpu"] = [c.to_json() for c in problem.check_outputs(names, tb, ref_out, w)]
            row["diag_torch_vs_triton_bitequal"] = [float((x == y).float().mean()) for x, y in zip(tb, got)]
            torch.cuda.synchronize()
            import time as _t
            t0 = _t.perf_counter()
            for _ in range(50):
                gqa_qkv_rope_qk_norm_backward(*a, out=out)
            row["diag_host_us_per_call"] = (_t.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
        rows.append(row)
        print(f"{w.name}: done", flush=True)

    with open(os.path.join(args.out, "bench_091.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                   "rows": rows}, f, indent=1)

    if args.tune:
        keys = list(rows[0]["tune_ms"])
        print("\nlaunch-config tuning (median ms, kernel span of the whole op):")
        print("config         " + " ".join(f"{r['tokens']:>7d}" for r in rows) + "   geomean")
        for k in keys:
            vals = [r["tune_ms"][k] for r in rows]
            print(f"{k:<14s} " + " ".join(f"{v:7.4f}" for v in vals) + f"   {geomean(vals):.4f}")
    if args.diag:
        for r in rows[:4]:
            print(r["workload"], "torch-on-gpu matched:", [round(c["matched_ratio"], 4) for c in r["diag_torch_backend_on_gpu"]],
                  "bit-eq torch/triton:", [round(x, 4) for x in r["diag_torch_vs_triton_bitequal"]],
                  f"host {r['diag_host_us_per_call']:.1f} us/call")

    clocks = ["events_ms"] + ([] if args.no_span else ["span_ms"])
    print(f"\n{torch.cuda.get_device_name()} | cold L2 | median of {args.reps} | span = first kernel start to last "
          f"kernel end (the official clock), events = CUDA events around the call (the user's clock)")
    print(f"{'workload':<16s} {'M':>6s} {'pass':>4s} {'minmatch':>8s} {'bitcos':>6s} {'det':>3s} "
          + " ".join(f"{c[:-3] + ' fused':>12s} {'floor':>8s} {'/floor':>7s} {'speedup':>8s}" for c in clocks))
    ratios = {c: [] for c in clocks}
    speedups = {c: [] for c in clocks}
    for r in rows:
        cells = []
        for c in clocks:
            t = {k: r[c][k]["median"] for k in r[c]}
            q, sp = t["fusedqkv"] / t["gemm_floor"], t["eager"] / t["fusedqkv"]
            ratios[c].append(q)
            speedups[c].append(sp)
            cells.append(f"{t['fusedqkv']:12.4f} {t['gemm_floor']:8.4f} {q:7.3f} {sp:7.2f}x")
        print(f"{r['workload']:<16s} {r['tokens']:6d} {'yes' if r['passed'] else 'NO':>4s} {r['min_matched']:8.5f} "
              f"{r['bit_equal_grad_cos']:6.4f} {'y' if r['deterministic'] else 'N':>3s} " + " ".join(cells))
    print(f"passed {sum(r['passed'] for r in rows)}/{len(rows)} | deterministic {sum(r['deterministic'] for r in rows)}"
          f"/{len(rows)}")
    for c in clocks:
        print(f"{c[:-3]:>6s}: geomean fused/floor {geomean(ratios[c]):.3f} (max {max(ratios[c]):.3f}) | geomean "
              f"speedup {geomean(speedups[c]):.2f}x | faster than eager {sum(x > 1 for x in speedups[c])}/{len(rows)}")
    if variants:
        print(f"\nvariants (median ms; /floor and /default within the same rounds): default = fusedqkv as configured")
        print(f"{'workload':<16s} {'variant':<22s} {'path':>7s} {'pass':>4s} {'det':>3s} "
              + " ".join(f"{c[:-3]:>8s} {'/floor':>7s} {'/default':>8s}" for c in clocks))
        for r in rows:
            for name in ["fusedqkv"] + list(variants):
                v = r["variants"].get(name, {"path": r["path"], "passed": r["passed"], "deterministic": r["deterministic"]})
                cells = []
                for c in clocks:
                    t = r[c][name]["median"]
                    cells.append(f"{t:8.4f} {t / r[c]['gemm_floor']['median']:7.3f} {t / r[c]['fusedqkv']['median']:8.3f}")
                print(f"{r['workload']:<16s} {name[len('fusedqkv:'):] or 'default':<22s} {v['path']:>7s} "
                      f"{'yes' if v['passed'] else 'NO':>4s} {'y' if v['deterministic'] else 'N':>3s} " + " ".join(cells))
    ok = all(r["passed"] and all(v["passed"] for v in r["variants"].values()) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
