"""Probe (issue 35): the FP8 cast kernels' launch configurations at the block's operand shapes, each
kernel timed alone as a CUDA graph, interleaved in rotated order with the L2 flushed before each
call; effective DRAM rate (bytes the kernel must move / time). Every configuration's outputs are
compared bitwise with the library's launch (the configurations change tiling, never the math).

Kernels (rowwise recipe, per fwd+bwd of the block):
  dual_amax   W's and dQKV's row and column amax partials (one read)
  dual_cast   W's and dQKV's two casts (one read, two fp8 writes, one transposed)
  colamax     x's forward cast with its column partials (rowwise_cast_colamax_kernel)
  cast_t      dW's cast of x, per column, transposed (cast_kernel, amaxes kept from the forward)
  rowwise     dQKV's per-row cast (rowwise_with_gw_hp's dX; rowwise_cast_kernel)

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/cast_tuning.py --out $OUT/casts
Prints a table last; writes --out/cast_tuning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_families import time_graphs_interleaved  # noqa: E402

from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.kernels import fp8_cast as K  # noqa: E402
from fusedqkv.ops import fp8  # noqa: E402

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
SHAPES = {  # name -> (x [M, K], W [N, K], dQKV [M, N])
    "091_8192": (8192, 4096, 6144),
    "091_32768": (32768, 4096, 6144),
    "h5120_8192": (8192, 5120, 10240),
}
TILES = [(128, 64, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8), (64, 64, 2), (128, 64, 8), (256, 128, 8),
         (32, 256, 4), (128, 256, 8)]
COLAMAX = [(1, 16, 8), (1, 16, 16), (2, 16, 8), (2, 16, 16), (4, 16, 16), (1, 32, 8), (2, 32, 16), (1, 8, 8),
           (4, 32, 16)]
ROWWISE = [(1, 8), (1, 16), (2, 16), (1, 4)]


def dual_amax(t, br, bc, w):
    R, C = t.shape
    cpart = torch.empty((-(-R // br), C), dtype=torch.float32, device=t.device)
    rpart = torch.empty((-(-C // bc), R), dtype=torch.float32, device=t.device)

    def call():
        K.dual_amax_kernel[(cpart.shape[0], rpart.shape[0])](t, rpart, cpart, R, C, t.stride(0), rpart.shape[0],
                                                              ROW_PART=True, BR=br, BC=bc, num_warps=w)
    return call, lambda: (rpart.amax(0), cpart.amax(0)), t.numel() * t.element_size()


def dual_cast(t, br, bc, w):
    R, C = t.shape
    a = t.float().abs()
    rs = (FMAX / a.amax(1).clamp_min(1e-12).double()).float()
    cs = (FMAX / a.amax(0).clamp_min(1e-12).double()).float()
    rs = (rs.view(torch.int32) & 0x7F800000).view(torch.float32).contiguous()
    cs = (cs.view(torch.int32) & 0x7F800000).view(torch.float32).contiguous()
    yr = torch.empty((R, C), dtype=E4M3, device=t.device)
    yt = torch.empty((C, R), dtype=E4M3, device=t.device)
    ri, ci, tam = torch.empty((R, 1), device=t.device), torch.empty((1, C), device=t.device), a.amax().reshape(1)

    def call():
        K.dual_cast_kernel[(-(-R // br), -(-C // bc))](t, yr, yt, rs, cs, tam, ri, ci, R, R, C, t.stride(0),
                                                        ROW_PER=True, COL_PER=True, FP8_MAX_R=FMAX, FP8_MAX_C=FMAX,
                                                        POW2=True, BR=br, BC=bc, num_warps=w)
    return call, lambda: (yr.view(torch.uint8), yt.view(torch.uint8)), t.numel() * (t.element_size() + 2)


def cast_t(t, br, bc, w):
    R, C = t.shape
    _, _, part = fp8._rowwise_colamax_triton(t, fp8.Cast(E4M3), True)
    part = fp8._part_triton(part)
    y = torch.empty((C, R), dtype=E4M3, device=t.device)
    inv = torch.empty((1, C), device=t.device)

    def call():
        K.cast_kernel[(-(-R // br), -(-C // bc))](t, y, part, inv, R, R, C, t.stride(0), part.shape[0],
                                                  PER_COLUMN=True, TRANSPOSE=True, FP8_MAX=FMAX, POW2=True, BR=br,
                                                  BC=bc, BP=64, num_warps=w)
    return call, lambda: (y.view(torch.uint8), inv), t.numel() * (t.element_size() + 1)


def colamax(t, rows, part_rows, w):
    R, C = t.shape
    block = 1 << (C - 1).bit_length()
    y = torch.empty((R, C), dtype=E4M3, device=t.device)
    inv = torch.empty((R, 1), device=t.device)
    part = torch.empty((-(-R // part_rows), C), dtype=t.dtype, device=t.device)

    def call():
        K.rowwise_cast_colamax_kernel[(part.shape[0],)](t, y, inv, part, R, C, t.stride(0), y.stride(0), FP8_MAX=FMAX,
                                                        POW2=True, PART_ROWS=part_rows, ROWS=rows, BLOCK_C=block,
                                                        WHOLE_ROW=True, num_warps=w)
    return call, lambda: (y.view(torch.uint8), inv, part.float().amax(0)), t.numel() * (t.element_size() + 1)


def rowwise(t, rows, w):
    R, C = t.shape
    block = 1 << (C - 1).bit_length()
    y = torch.empty((R, C), dtype=E4M3, device=t.device)
    inv = torch.empty((R, 1), device=t.device)

    def call():
        K.rowwise_cast_kernel[(-(-R // rows),)](t, y, inv, R, C, t.stride(0), y.stride(0), FP8_MAX=FMAX, POW2=True,
                                                ROWS=rows, BLOCK_C=block, WHOLE_ROW=True, num_warps=w)
    return call, lambda: (y.view(torch.uint8), inv), t.numel() * (t.element_size() + 1)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def dump(out: str, results: list) -> None:
    with open(os.path.join(out, "cast_tuning.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    flusher = timing.L2Flusher(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    results, table = [], []
    for sname in args.shapes.split(","):
        M, Kd, N = SHAPES[sname]
        x = torch.randn((M, Kd), device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn((N, Kd), device=dev, generator=g) * 0.02).to(torch.bfloat16)
        d = (torch.randn((M, N), device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        groups = [("dual_amax/W", [(c, dual_amax(w, *c)) for c in TILES]),
                  ("dual_amax/dQKV", [(c, dual_amax(d, *c)) for c in TILES]),
                  ("dual_cast/W", [(c, dual_cast(w, *c)) for c in TILES]),
                  ("dual_cast/dQKV", [(c, dual_cast(d, *c)) for c in TILES]),
                  ("cast_t/x", [(c, cast_t(x, *c)) for c in TILES]),
                  ("colamax/x", [(c, colamax(x, *c)) for c in COLAMAX]),
                  *([("rowwise/dQKV", [(c, rowwise(d, *c)) for c in ROWWISE])] if N <= fp8._WHOLE_ROW_MAX else [])]
        for gname, cfgs in groups:
            fns, ref, ok = {}, None, {}
            for c, (call, outs, nbytes) in cfgs:
                call()
                torch.cuda.synchronize()
                o = outs()
                ref = o if ref is None else ref
                ok[c] = same(o, ref)
                fns[c] = call
            ms = time_graphs_interleaved(fns, args.reps, 3, flusher)
            base = statistics.median(ms[cfgs[0][0]])
            for c, (_, _, nbytes) in cfgs:
                med = statistics.median(ms[c])
                row = dict(shape=sname, kernel=gname, config=list(c), us=med * 1e3, tbps=nbytes / (med * 1e-3) / 1e12,
                           over_default=med / base, bitwise=ok[c])
                results.append(row)
            best = min(cfgs, key=lambda cc: statistics.median(ms[cc[0]]))[0]
            bmed = statistics.median(ms[best])
            table.append(f"{sname:<11} {gname:<15} default {cfgs[0][0]} {base * 1e3:7.1f} us  "
                         f"best {best} {bmed * 1e3:7.1f} us ({bmed / base:.3f}x, "
                         f"{cfgs[0][1][2] / (bmed * 1e-3) / 1e12:.2f} TB/s)  bitwise {all(ok.values())}")
            print(table[-1], flush=True)
            dump(args.out, results)  # after each group: a run cut short keeps what it measured
        del x, w, d
        torch.cuda.empty_cache()
    dump(args.out, results)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
