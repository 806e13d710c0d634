"""GPU probe of the FP8 cast kernels' launch shapes at the block's small token counts (issue 35).

At 512 and 2048 tokens the rowwise recipe's casts cost as much as its GEMMs (session 26, call 1: x's
rowwise cast with column partials ran at ~1 TB/s with 128 programs at 2048 tokens, 32 at 512). This
times, per shape, the kernels as fp8.py launches them and alternatives, each call after an L2 flush,
CUDA events, the variants interleaved call by call in rotated order; every variant's output is
checked bitwise against the current launch's first.

  colamax  x's per-row cast storing column partials (rowwise_cast_colamax_kernel) plus the partials'
           tile reduction (tile_amax_kernel): rows per partial, partials' dtype; "pr16_f32" is session 25's
           launch, "plan" what fp8._rowwise_colamax_triton launches now
  dual     W's / dQKV's amax pass + finish + cast pass (dual_amax, dual_finish, dual_cast): tiles, warps

    PYTHONPATH=src python3 benchmarks/fp8_cast_probe.py --out $OUT/castprobe
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/fp8_cast_probe.py --smoke --out /tmp/castprobe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from fusedqkv.ops import fp8
from fusedqkv.ops.fp8 import E4M3, next_pow2, triton_cdiv


def colamax(x, part_rows, part_dtype, warps=None):
    from fusedqkv.kernels.fp8_cast import rowwise_cast_colamax_kernel, tile_amax_kernel

    R, C = x.shape
    block = next_pow2(C)
    rows = 1 if C > 2048 else max(1, 2048 // block)
    part_rows = max(part_rows, rows)
    warps = warps or (8 if block >= 4096 else 4)
    y = torch.empty((R, C), dtype=E4M3, device=x.device)
    inv = torch.empty((R, 1), dtype=torch.float32, device=x.device)
    part = torch.empty((triton_cdiv(R, part_rows), C), dtype=part_dtype, device=x.device)
    fmax = torch.finfo(E4M3).max
    rowwise_cast_colamax_kernel[(part.shape[0],)](x, y, inv, part, R, C, x.stride(0), y.stride(0), FP8_MAX=fmax,
                                                  POW2=False, PART_ROWS=part_rows, ROWS=rows, BLOCK_C=block,
                                                  WHOLE_ROW=True, num_warps=warps)
    br, bc = fp8._BR, fp8._BC
    red = torch.empty((triton_cdiv(part.shape[0], br), C), dtype=torch.float32, device=x.device)
    tile_amax_kernel[(red.shape[0], triton_cdiv(C, bc))](part, red, part.shape[0], C, C, BR=br, BC=bc, num_warps=4)
    return y, inv, red.amax(0)


def colamax_plan(x):
    """What fp8.input_cast_keeping_amax launches now (rows per partial by fp8.colamax_part_rows)."""
    y, inv, part = fp8._rowwise_colamax_triton(x, fp8.Cast(E4M3), False)
    return y, inv, fp8._part_triton(part).amax(0)


def dual(t, br, bc, warps):
    from fusedqkv.kernels.fp8_cast import dual_amax_kernel, dual_cast_kernel, dual_finish_kernel

    R, C = t.shape
    dev = t.device
    n_rb, n_cb = triton_cdiv(R, br), triton_cdiv(C, bc)
    cpart = torch.empty((n_rb, C), dtype=torch.float32, device=dev)
    rpart = torch.empty((n_cb, R), dtype=torch.float32, device=dev)
    dual_amax_kernel[(n_rb, n_cb)](t, rpart, cpart, R, C, t.stride(0), n_cb, ROW_PART=True, BR=br, BC=bc,
                                   num_warps=warps)
    f32 = dict(dtype=torch.float32, device=dev)
    r_inv, c_inv, r_scale, c_scale = (torch.empty((R, 1), **f32), torch.empty((1, C), **f32),
                                      torch.empty((R,), **f32), torch.empty((C,), **f32))
    fmax = torch.finfo(E4M3).max
    n_row_prog = triton_cdiv(R, fp8._FB)
    dual_finish_kernel[(n_row_prog + triton_cdiv(C, fp8._FB),)](
        rpart, cpart, r_scale, r_inv, c_scale, c_inv, R, C, n_cb, n_rb, n_row_prog, ROW_PER=True, COL_PER=True,
        FP8_MAX_R=fmax, FP8_MAX_C=fmax, POW2=False, FB=fp8._FB, BP=fp8._FP, FBC=fp8._FB, BPC=fp8._FP, num_warps=4)
    yr = torch.empty((R, C), dtype=E4M3, device=dev)
    yt = torch.empty((C, R), dtype=E4M3, device=dev)
    dual_cast_kernel[(triton_cdiv(R, br), n_cb)](
        t, yr, yt, r_scale, c_scale, cpart, r_inv, c_inv, R, R, C, t.stride(0), ROW_PER=True, COL_PER=True,
        FP8_MAX_R=fmax, FP8_MAX_C=fmax, POW2=False, BR=br, BC=bc, num_warps=warps)
    return yr, r_inv, yt, c_inv


def same(a, b) -> bool:
    return all(torch.equal(u.view(torch.uint8) if u.dtype == E4M3 else u, v.view(torch.uint8) if v.dtype == E4M3 else v)
               for u, v in zip(a, b))


def time_interleaved(fns: dict, flush, reps: int) -> dict:
    names = list(fns)
    if not torch.cuda.is_available():  # --smoke: the calls run, no timing
        for n in names:
            fns[n]()
        return {n: float("nan") for n in names}
    times = {n: [] for n in names}
    for _ in range(3):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    for i in range(reps):
        order = names[i % len(names):] + names[:i % len(names)]
        ev = []
        for n in order:
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[n]()
            e.record()
            ev.append((n, s, e))
        torch.cuda.synchronize()
        for n, s, e in ev:
            times[n].append(s.elapsed_time(e) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        col_shapes, dual_shapes, reps = [(40, 64)], [(40, 64)], 1
        flush = lambda: None  # noqa: E731
    else:
        from fusedqkv.bench.timing import L2Flusher

        col_shapes = [(512, 4096), (2048, 4096), (8192, 4096), (512, 5120), (2048, 5120), (32768, 4096)]
        dual_shapes = [(6144, 4096), (10240, 5120), (2048, 6144), (512, 6144)]
        reps = args.reps
        flush = L2Flusher(dev)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows_out = []
    for R, C in col_shapes:
        x = torch.randn((R, C), generator=gen).to(dev, torch.bfloat16)
        variants = {"pr16_f32": (16, torch.float32)}
        for pr in (8, 4, 2, 1):
            variants[f"pr{pr}_bf16"] = (pr, torch.bfloat16)
        variants["pr4_f32"] = (4, torch.float32)
        ref = colamax(x, 16, torch.float32)  # session 25's launch
        ok = {n: same(colamax(x, *v), ref) for n, v in variants.items()}
        ok["plan"] = same(colamax_plan(x), ref)
        fns = {n: (lambda v=v: colamax(x, *v)) for n, v in variants.items()}
        fns["plan"] = lambda: colamax_plan(x)
        t = time_interleaved(fns, flush, reps)
        for n in fns:
            rows_out.append(dict(kind="colamax", shape=[R, C], variant=n, us=t[n], same=ok[n],
                                 gbps=(R * C * 3) / t[n] / 1e3))
    for R, C in dual_shapes:
        t_ = torch.randn((R, C), generator=gen).to(dev, torch.bfloat16)
        variants = {"128x64w4": (128, 64, 4), "64x128w4": (64, 128, 4), "128x128w8": (128, 128, 8),
                    "64x64w4": (64, 64, 4), "32x128w4": (32, 128, 4), "128x128w4": (128, 128, 4)}
        ref = dual(t_, 128, 64, 4)
        ok = {n: same(dual(t_, *v), ref) for n, v in variants.items()}
        t = time_interleaved({n: (lambda v=v: dual(t_, *v)) for n, v in variants.items()}, flush, reps)
        for n in variants:
            rows_out.append(dict(kind="dual", shape=[R, C], variant=n, us=t[n], same=ok[n],
                                 gbps=(R * C * 2 * 2 + R * C * 2) / t[n] / 1e3))
    with open(os.path.join(args.out, "fp8_cast_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=rows_out), f,
                  indent=1)
    print(f"{'kind':8} {'shape':>12} {'variant':>10} {'us':>8} {'GB/s':>7} same")
    for r in rows_out:
        print(f"{r['kind']:8} {'x'.join(map(str, r['shape'])):>12} {r['variant']:>10} {r['us']:8.1f} "
              f"{r['gbps']:7.0f} {r['same']}")


if __name__ == "__main__":
    main()
