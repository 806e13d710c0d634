"""Where the training forward's time goes at large token counts, and which forward-stage tile is
fastest: the projection GEMM (planned cuBLASLt vs torch.mm), the RoPE + RMSNorm stage at each
tile (tokens per program, heads per program, warps), and torch.compile's (Inductor's) version of
the same stage on the same projection output, each timed alone (CUDA events, L2 flushed before
every call, median).

    PYTHONPATH=src python3 benchmarks/forward_sweep.py --out $OUT/fs

Prints a table per configuration last; writes --out/forward_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fusedqkv.bench import timing
from fusedqkv.ops import config
from fusedqkv.ops import training_forward as P
from fusedqkv.ops.gqa_forward import forward_launch_config, forward_torch

CONFIGS = {  # name: (hidden, hq, hkv, D, norm position)
    "h5120_q64_kv8_before": (5120, 64, 8, 128, "before_rope"),
    "h4096_q32_kv8_after": (4096, 32, 8, 128, "after_rope"),
}
TILES = [(16, 8, 8), (16, 4, 8), (16, 1, 4), (32, 8, 8), (32, 4, 8), (32, 2, 4), (64, 8, 8), (64, 4, 8),
         (64, 2, 8), (8, 8, 4), (32, 8, 4), (16, 8, 4), (16, 4, 4), (16, 2, 4), (8, 4, 4), (8, 2, 4), (8, 1, 4),
         (32, 4, 4), (32, 1, 4), (8, 8, 2), (16, 8, 2)]


def median_call_kernels(fn, flusher, reps=10):
    """The kernels of the call of median span: (name, start us from the call's first kernel,
    duration us)."""
    calls = [c for c in timing.profile_kernel_calls(fn, reps=reps, flusher=flusher) if c]
    mid = sorted(calls, key=lambda c: c[-1][2] - c[0][1])[len(calls) // 2]
    t0 = mid[0][1]
    return [(n[:60], round(a - t0, 1), round(e - a, 1)) for n, a, e in mid]


def time_ms(fn, flusher, reps):
    """Median CUDA-event time of ``fn`` (L2 flushed before each call)."""
    return statistics.median(timing.time_cuda_events(fn, reps=reps, flusher=flusher))


def module_kernels(args, dev, flusher) -> int:
    """The kernels (name, start us, duration us) of one forward (grad enabled) of the fused module
    and of torch.compile of the plain module, as bench_module.py times them."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_module as bm
    from fusedqkv import GQAQKVRoPEQKNorm
    from fusedqkv.module import ReferenceGQAQKVRoPEQKNorm

    cfg = bm.CONFIGS[args.module]
    out = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        b, s = bm.SIZES[tokens]
        eager = ReferenceGQAQKVRoPEQKNorm(**cfg, device=dev, dtype=torch.bfloat16)
        fused = GQAQKVRoPEQKNorm(**cfg, device=dev, dtype=torch.bfloat16)
        fused.load_state_dict(eager.state_dict())
        comp = torch.compile(eager, fullgraph=True, dynamic=False)
        x = torch.randn(b, s, cfg["hidden_size"], device=dev, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = bm.rope_cos_sin(b, s, cfg["head_dim"], torch.bfloat16, dev)
        for name, mod in (("fusedqkv", fused), ("compile", comp)):
            ks = median_call_kernels(lambda: mod(x, cos, sin), flusher)
            ev = time_ms(lambda: mod(x, cos, sin), flusher, args.reps)
            out[f"{name} {tokens}"] = {"kernels": ks, "events_ms": ev}
            print(f"{name} {tokens} tokens: events {ev:.4f} ms; kernels {ks}", flush=True)
            # per call, as bench_module times it (no sync between calls): the GPU's wait between the
            # flush's end and the call's first kernel, and the call's kernel span -- a late start
            # (the host behind) and slower kernels read differently
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    flusher()
                    mod(x, cos, sin)
                flusher()
                torch.cuda.synchronize()
            evs = sorted(((e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                          if str(getattr(e, "device_type", "")).endswith("CUDA")), key=lambda e: e[1])
            waits, spans, flush_end, first, last = [], [], None, None, None
            for n, a, e in evs:
                if timing.FLUSH_KERNEL_NAME in n:
                    if flush_end is not None and first is not None:
                        waits.append(first - flush_end)
                        spans.append(last - first)
                    flush_end, first, last = e, None, None
                elif flush_end is not None:
                    first = a if first is None else first
                    last = e if last is None else max(last, e)
            out[f"{name} {tokens} wait/span"] = list(zip(waits, spans))
            print(f"  {name} {tokens}: (GPU wait after the flush us, kernel span us) per call: "
                  f"{[(round(w), round(sp)) for w, sp in zip(waits, spans)]}", flush=True)
            # per call: events and the host time of the call, with Python's GC on and off
            import gc
            import time as _time

            for gc_on in (True, False):
                (gc.enable if gc_on else gc.disable)()
                evs, hosts = [], []
                for _ in range(3):
                    mod(x, cos, sin)
                torch.cuda.synchronize()
                m0 = torch.cuda.memory_stats()
                for _ in range(args.reps):
                    flusher()
                    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    t0 = _time.perf_counter()
                    mod(x, cos, sin)
                    hosts.append((_time.perf_counter() - t0) * 1e6)
                    e.record()
                    torch.cuda.synchronize()
                    evs.append(a.elapsed_time(e))
                gc.enable()
                # device allocations inside the timed calls (a cudaMalloc/cudaFree costs the host
                # 100s of us, a cudaFree also waits for the GPU): what bimodal samples would need
                m1 = torch.cuda.memory_stats()
                allocs = {k: m1.get(k, 0) - m0.get(k, 0) for k in
                          ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
                print(f"  {name} {tokens} gc={'on' if gc_on else 'off'}: allocator over {args.reps} calls {allocs}",
                      flush=True)
                out[f"{name} {tokens} gc={gc_on} allocator"] = allocs
                pairs = sorted(zip(evs, hosts))
                print(f"  {name} {tokens} gc={'on' if gc_on else 'off'}: (events ms, host us) sorted: "
                      f"{[(round(a, 3), round(b)) for a, b in pairs]}", flush=True)
                out[f"{name} {tokens} gc={gc_on}"] = pairs
    with open(os.path.join(args.out, "module_kernels.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="forward_sweep_out")
    ap.add_argument("--tokens", default="8192,2048")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--module", default=None, help="bench_module config: only the kernels of one module forward")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    flusher = timing.L2Flusher(dev)
    if args.module:
        return module_kernels(args, dev, flusher)
    rows = []
    for name, (hidden, hq, hkv, D, pos) in CONFIGS.items():
        after = pos == "after_rope"
        for M in (int(t) for t in args.tokens.split(",")):
            torch.manual_seed(0)
            n_tot = (hq + 2 * hkv) * D
            x = torch.randn(1, M, hidden, device=dev, dtype=torch.bfloat16)
            W = torch.randn(n_tot, hidden, device=dev, dtype=torch.bfloat16) * hidden ** -0.5
            wq = torch.rand(D, device=dev, dtype=torch.bfloat16) + 0.5
            wk = torch.rand(D, device=dev, dtype=torch.bfloat16) + 0.5
            ang = torch.randn(1, M, D, device=dev)
            cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
            row = {"config": name, "tokens": M, "default_tile": forward_launch_config(M, hq, hkv, D, dev)}
            plan = P.forward_plan(x, W, wq, wk, cos, sin, hq, hkv, 1e-6, pos, "auto")
            P.run_forward(plan, x, W, wq, wk, cos, sin)
            qkv = torch.mm(x.view(M, hidden), W.t()).view(1, M, n_tot)
            out = torch.empty(1, M, n_tot, device=dev, dtype=torch.bfloat16)
            stream = torch.cuda.current_stream().cuda_stream
            if plan.lt_qkv is not None:
                row["gemm_cublaslt_ms"] = time_ms(lambda: plan.lt_qkv(x.data_ptr(), W.data_ptr(), out.data_ptr(), stream),
                                                  flusher, args.reps)
            row["gemm_torch_mm_ms"] = time_ms(lambda: torch.mm(x.view(M, hidden), W.t(), out=out.view(M, n_tot)),
                                              flusher, args.reps)
            row["whole_forward_ms"] = time_ms(lambda: P.run_forward(plan, x, W, wq, wk, cos, sin), flusher, args.reps)
            # the whole forward's kernels: start offset and duration (us) of each, median call
            row["whole_kernels"] = median_call_kernels(lambda: P.run_forward(plan, x, W, wq, wk, cos, sin), flusher)
            # the stage alone at each tile (through the plan's launch: each tile its own plan)
            q = torch.empty(1, M, hq, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            k = torch.empty(1, M, hkv, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            rq = torch.empty(1, hq, M, device=dev)
            rk = torch.empty(1, hkv, M, device=dev)
            tiles = {}
            for tile in TILES:
                with config.override(forward_tile=tile):
                    tp = P.forward_plan(x, W, wq, wk, cos, sin, hq, hkv, 1e-6, pos, "auto")
                    P.run_forward(tp, x, W, wq, wk, cos, sin)  # binds the launch
                    tensors = (qkv, wq, wk, cos, sin, q, k, rq, rk)
                    ptrs = [t.data_ptr() for t in tensors]
                    launch = tp.launch
                    assert launch.bound
                    tiles[str(tile)] = time_ms(lambda: launch.launch(None, ptrs, stream), flusher, args.reps)
            row["stage_ms_by_tile"] = tiles
            # Inductor's stage on the same input
            fn = torch.compile(lambda t: forward_torch(t, wq, wk, cos, sin, hq, hkv, 1e-6, after)[:2], dynamic=False)
            fn(qkv)
            row["stage_inductor_ms"] = time_ms(lambda: fn(qkv), flusher, args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "forward_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\nforward pieces (ms, cold L2, median) | {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"  {r['config']} {r['tokens']} kernels (name, start us, duration us): {r['whole_kernels']}")
    for r in rows:
        best = min(r["stage_ms_by_tile"].items(), key=lambda kv: kv[1])
        default = r["stage_ms_by_tile"].get(str(r["default_tile"]))
        print(f"{r['config']:<22s} {r['tokens']:6d} gemm Lt {r.get('gemm_cublaslt_ms', float('nan')):.4f} "
              f"mm {r['gemm_torch_mm_ms']:.4f} | whole {r['whole_forward_ms']:.4f} | stage default "
              f"{r['default_tile']} {default if default is None else round(default, 4)} best {best[0]} "
              f"{best[1]:.4f} | inductor stage {r['stage_inductor_ms']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
