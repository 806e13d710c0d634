"""GPU benchmark of SOL-ExecBench 091 backward: fusedqkv vs the eager reference vs the GEMM floor.

One run, all 16 workloads, on the GPU:
  * correctness of fusedqkv against the official reference with the official policy
    (matched ratio per output; grad_cos/grad_sin bit-equality rate), and determinism
    (two calls bitwise identical);
  * cold-L2 timing (L2 flushed before every iteration), median of --reps, by CUDA events
    and by kernel span (the official timer; taken in --rounds interleaved rounds), of:
    fusedqkv (destination passing), the official eager reference, and the floor of the two
    cuBLAS GEMMs alone (dQKV precomputed);
  * with --tune: the RoPE/QK-norm stage alone under several launch configurations.

Needs the official pack: FUSEDQKV_SOL_EXECBENCH=<folder holding 091_.../definition.json>.
Prints a table last; writes JSON to --out.

    PYTHONPATH=src python benchmarks/bench_091_backward.py --out /tmp/b091 [--tune]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import harness, problem, timing
from fusedqkv.ops import rope_qk_norm as stage
from fusedqkv.ops import single_launch


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
    ap.add_argument("--paths", action="store_true",
                    help="also time (and check) the single launch and the three launches on every workload "
                         "of at most --paths-max-tokens tokens")
    ap.add_argument("--paths-max-tokens", type=int, default=2200)
    ap.add_argument("--paths-list", default="single_launch,three_launches")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    defn = problem.load_definition()
    ref = problem.load_official_reference()
    if ref is None:
        print("official pack not found: set FUSEDQKV_SOL_EXECBENCH", file=sys.stderr)
        return 2
    wls = defn.workloads if args.workloads == "all" else [defn.workload(k) for k in args.workloads.split(",")]
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
               "events_ms": {}, "span_ms": {}}
        for k, fn in impls.items():
            row["events_ms"][k] = timing.summarize(timing.time_cuda_events(fn, reps=args.reps, flusher=flusher))
        if not args.no_span:
            # interleaved rounds (fused, eager, floor, fused, ...): a drift of the card's clocks
            # or of the host during the run falls on every implementation alike, not on one
            spans = {k: [] for k in impls}
            per_round = -(-args.reps // args.rounds)
            for _ in range(args.rounds):
                for k, fn in impls.items():
                    spans[k] += timing.time_kernel_span(fn, reps=per_round, flusher=flusher)
            for k in impls:
                row["span_ms"][k] = timing.summarize(spans[k])

        if args.paths and M <= args.paths_max_tokens:
            orig = single_launch.MAX_TOKENS
            row["paths"] = {}
            variants = {"single_launch": 1 << 30, "three_launches": 0}
            for pname in args.paths_list.split(","):
                single_launch.MAX_TOKENS = variants[pname]
                o2 = tuple(torch.empty_like(t) for t in ref_out)
                g2 = gqa_qkv_rope_qk_norm_backward(*a, out=o2)
                c2 = problem.check_outputs(names, g2, ref_out, w)
                again2 = gqa_qkv_rope_qk_norm_backward(*a)
                row["paths"][pname] = {
                    "passed": all(c.passed for c in c2), "min_matched": min(c.matched_ratio for c in c2),
                    "deterministic": all(torch.equal(x, y) for x, y in zip(g2, again2)),
                    "span_ms": timing.summarize(timing.time_kernel_span(
                        lambda o2=o2: gqa_qkv_rope_qk_norm_backward(*a, out=o2), reps=args.reps, flusher=flusher)),
                }
            single_launch.MAX_TOKENS = orig

        if args.tune:
            # the whole op (kernel span, the official timer) under several launch configurations
            tune = {}
            orig_cfg = stage._launch_config
            orig_fused = stage.FUSED_FINISH
            for fused in (True, False):
                stage.FUSED_FINISH = fused
                for bt, hb, gs in ((1, 8, 8), (2, 4, 8), (4, 2, 8), (1, 8, 0), (4, 2, 0), (8, 1, 0)):
                    nw = stage._warps_for(bt * hb, a[0].shape[-1], 4)
                    stage._launch_config = lambda *_a, c=(bt, hb, nw, stage.PREFETCH, gs): c
                    tune[f"{'F' if fused else 'K'}_T{bt}_g{hb}_w{nw}" + (f"_G{gs}" if gs else "")] = timing.summarize(
                        timing.time_kernel_span(impls["fusedqkv"], reps=max(20, args.reps // 2),
                                                flusher=flusher))["median"]
            stage._launch_config = orig_cfg
            stage.FUSED_FINISH = orig_fused
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

    if args.paths:
        print("\nlaunch paths (kernel span, median ms; pass = official check, det = deterministic; /floor)")
        for r in rows:
            if "paths" in r:
                floor = r["span_ms"]["gemm_floor"]["median"] if r["span_ms"] else float("nan")
                cells = [f"{k} {p['span_ms']['median']:.4f} {p['span_ms']['median'] / floor:.3f} "
                         f"{'pass' if p['passed'] else 'FAIL'} {'det' if p['deterministic'] else 'NONDET'}"
                         for k, p in r["paths"].items()]
                print(f"{r['workload']:<16s} {r['tokens']:6d} floor {floor:.4f} | " + " | ".join(cells))
    src = "span_ms" if not args.no_span else "events_ms"
    print(f"\n{torch.cuda.get_device_name()} | cold L2 | median of {args.reps} | times from {src} (events in JSON)")
    print(f"{'workload':<16s} {'M':>6s} {'pass':>4s} {'minmatch':>8s} {'bitcos':>6s} {'det':>3s} "
          f"{'fused ms':>9s} {'eager ms':>9s} {'floor ms':>9s} {'speedup':>8s} {'/floor':>7s}")
    sp, fl = [], []
    for r in rows:
        t = {k: r[src][k]["median"] for k in r[src]}
        s, q = t["eager"] / t["fusedqkv"], t["fusedqkv"] / t["gemm_floor"]
        sp.append(s)
        fl.append(q)
        print(f"{r['workload']:<16s} {r['tokens']:6d} {'yes' if r['passed'] else 'NO':>4s} {r['min_matched']:8.5f} "
              f"{r['bit_equal_grad_cos']:6.4f} {'y' if r['deterministic'] else 'N':>3s} {t['fusedqkv']:9.4f} "
              f"{t['eager']:9.4f} {t['gemm_floor']:9.4f} {s:7.2f}x {q:7.3f}")
    print(f"passed {sum(r['passed'] for r in rows)}/{len(rows)} | faster than eager {sum(x > 1 for x in sp)}/{len(sp)} | "
          f"geomean speedup {geomean(sp):.2f}x | geomean fused/floor {geomean(fl):.3f}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
