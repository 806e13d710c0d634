"""Session 46 probe (issue 35): how much of a tensor a second pass finds in L2, by traversal order.

The FP8 block reads W twice (its amax pass, then its dual cast) and dQKV three times (written by the
backward stage, read by its amax pass, read by its dual cast), each pass in the same tile order, so the
L2-resident tail of one pass is the part the next pass reaches last. This times pass B alone (a graph of
flush + A + B minus one of flush + A, interleaved, medians) for B in the same order as A and in the
reverse order, with A a read (amax-like: tile maxima out) or a write (stage-like), at 32-100 MB.
Prints a table last: us of B per order and the DRAM bytes the reverse order saved (at B's forward rate)."""
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "src")
from fusedqkv.kernels.l2_flush import l2_flush_kernel  # noqa: E402


@triton.jit
def tiles_kernel(x_ptr, part_ptr, R, C, n_rb, n_cb, WRITE: tl.constexpr, REVERSE: tl.constexpr,
                 ROW_MAJOR: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    pid = tl.program_id(0)
    if REVERSE:
        pid = n_rb * n_cb - 1 - pid
    if ROW_MAJOR:  # tiles along a row block first (the order a token-block stage writes)
        pr, pc = pid // n_cb, pid % n_cb
    else:  # down a column strip first (dual_amax / dual_cast's (n_rb, n_cb) grid)
        pr, pc = pid % n_rb, pid // n_rb
    rows = pr * BR + tl.arange(0, BR)
    cols = pc * BC + tl.arange(0, BC)
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :]
    if WRITE:
        tl.store(ptrs, (rows[:, None] + cols[None, :]).to(x_ptr.dtype.element_ty))
    else:
        x = tl.load(ptrs)
        tl.store(part_ptr + pid, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0))


def main():
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    flush = torch.empty(2 * l2 // 4 * 2, dtype=torch.int32, device=dev)
    BR, BC = 128, 64
    results = []
    for R, C in ((4096, 4096), (6144, 4096), (8192, 6144)):
        x = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
        n_rb, n_cb = R // BR, C // BC
        part = torch.empty(n_rb * n_cb, device=dev)
        grid = (n_rb * n_cb,)

        def run(write_a, order_a, order_b):
            l2_flush_kernel[(triton.cdiv(flush.numel(), 4096),)](flush, flush.numel(), BLOCK=4096)
            tiles_kernel[grid](x, part, R, C, n_rb, n_cb, WRITE=write_a, REVERSE=False, ROW_MAJOR=order_a,
                               BR=BR, BC=BC)
            if order_b is not None:
                rev, row_major = order_b
                tiles_kernel[grid](x, part, R, C, n_rb, n_cb, WRITE=False, REVERSE=rev, ROW_MAJOR=row_major,
                                   BR=BR, BC=BC)

        cases = {}
        for write_a, order_a in ((False, False), (True, True)):  # W's amax pass then cast; the stage then amax
            for order_b in (None, (False, order_a), (True, order_a), (True, not order_a), (False, not order_a)):
                cases[(write_a, order_a, order_b)] = None
        graphs = {}
        for key in cases:
            for _ in range(2):
                run(*key)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run(*key)
            graphs[key] = g
        times = {k: [] for k in graphs}
        keys = list(graphs)
        for rnd in range(30):
            for i in range(len(keys)):
                k = keys[(i + rnd) % len(keys)]
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(5):
                    graphs[k].replay()
                e.record()
                e.synchronize()
                times[k].append(s.elapsed_time(e) / 5 * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        mb = R * C * 2 / 1e6
        for write_a, order_a in ((False, False), (True, True)):
            base = med[(write_a, order_a, None)]
            row = dict(shape=[R, C], mb=mb, a="write" if write_a else "read",
                       a_order="row-major" if order_a else "strips")
            for order_b in ((False, order_a), (True, order_a), (True, not order_a), (False, not order_a)):
                name = ("rev " if order_b[0] else "fwd ") + ("row-major" if order_b[1] else "strips")
                row[name] = med[(write_a, order_a, order_b)] - base
            results.append(row)
    print(f"L2 {l2 / 1e6:.0f} MB; us of pass B after pass A (flush first), medians of 30 interleaved rounds")
    print(f"{'shape':>12s} {'MB':>5s} {'A':>5s} {'A order':>9s} | {'fwd same':>9s} {'rev same':>9s} "
          f"{'rev other':>9s} {'fwd other':>9s} | {'saved MB (rev same)':>19s}")
    for r in results:
        vals = list(r.values())[4:]
        fwd = vals[0]
        saved = r["mb"] * (1 - vals[1] / fwd)
        print(f"{str(r['shape']):>12s} {r['mb']:5.0f} {r['a']:>5s} {r['a_order']:>9s} | "
              + " ".join(f"{v:9.1f}" for v in vals) + f" | {saved:19.1f}")
    if out:
        os.makedirs(out, exist_ok=True)
        json.dump(dict(l2_bytes=l2, rows=results), open(os.path.join(out, "l2_reuse.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
