"""Where the fused forward's time goes (issue 24): hardware counters and clocks of the one-launch
forward (``kernels/qkv_rope_norm_gemm_sm90.py``) against the same kernel without its norm epilogue,
cuBLAS's GEMM (the floor) and cuBLASLt + the Triton stage (``today``).

Two modes:

``--ncu``: every provider of every row called once inside an NVTX range ``prof`` (after three
warm-up calls), for Nsight Compute to profile exactly those launches::

    ncu --clock-control none --nvtx --nvtx-include "prof/" --set full --csv --page raw \\
        python3 benchmarks/fused_forward_profile.py --ncu --rows 1,2 > $OUT/ncu.csv

The order of the profiled kernels is printed on stderr (one provider after another, in --providers'
order, row by row).

``--clocks`` (default): each provider's call captured ten times in one CUDA graph, replayed
back to back for --seconds (steady load, no flush) while ``nvidia-smi`` samples the SM clock and the
board power every 50 ms; providers interleaved over --rounds. Prints ms per call, median clock and
power, and the energy per call; a kernel that does more work per byte or per FLOP shows as more
power at the power limit, or a lower clock.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/fused_forward_profile.py --rows 1,2 --out $OUT/clocks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_module as BMOD  # noqa: E402
import gluon_forward_probe as GP  # noqa: E402

PROVIDERS = ("floor", "today", "gluon_gemm", "gluon_fused", "gluon_fused_loop")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def provider_fns(cfg, args, names):
    make = dict(floor=lambda: GP.floor_fn(args), today=lambda: GP.today_fn(cfg, args),
                gluon_gemm=lambda: GP.fused_fn(cfg, args, fuse=False), gluon_fused=lambda: GP.fused_fn(cfg, args),
                gluon_fused_loop=lambda: GP.fused_fn(cfg, args, EPILOGUE_LOOP=True))
    return {n: make[n]() for n in names}


def ncu_targets(rows, names):
    for cfg_name, b, s in rows:
        cfg = BMOD.CONFIGS[cfg_name]
        fns = provider_fns(cfg, GP.make(cfg, b, s, torch.device("cuda")), names)
        for n, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("prof")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            log(f"profiled: {cfg_name} {b}x{s} {n}")


class SmiSampler:
    """``nvidia-smi`` sampling SM clock (MHz) and board power (W) every ``ms`` in a child process."""

    def __init__(self, ms: int = 50):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", str(ms), "-i", str(torch.cuda.current_device())],
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        os.set_blocking(self.proc.stdout.fileno(), False)

    def drain(self):
        out = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                return out
            try:
                mhz, w = (float(v) for v in line.strip().split(","))
                out.append((mhz, w))
            except ValueError:
                pass

    def close(self):
        self.proc.terminate()


def clocks(rows, names, seconds, rounds, out):
    result = dict(device=torch.cuda.get_device_name(), rows=[])
    smi = SmiSampler()
    for cfg_name, b, s in rows:
        cfg = BMOD.CONFIGS[cfg_name]
        fns = provider_fns(cfg, GP.make(cfg, b, s, torch.device("cuda")), names)
        graphs = {}
        for n, fn in fns.items():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                keep = [fn() for _ in range(10)]
            graphs[n] = (g, keep)
        per = {n: dict(ms=[], mhz=[], w=[]) for n in names}
        for r in range(rounds):
            order = list(names[r % len(names):]) + list(names[:r % len(names)])
            for n in order:
                g = graphs[n][0]
                g.replay()
                torch.cuda.synchronize()
                smi.drain()
                t_end = time.time() + seconds
                calls = 0
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                while time.time() < t_end:
                    for _ in range(4):
                        g.replay()
                    calls += 40
                    torch.cuda.synchronize()
                e1.record()
                torch.cuda.synchronize()
                samples = smi.drain()[2:]  # the first samples may predate the load
                per[n]["ms"].append(e0.elapsed_time(e1) / calls)
                per[n]["mhz"] += [m for m, _ in samples]
                per[n]["w"] += [w for _, w in samples]
        row = dict(row=f"{cfg_name} {b}x{s}", providers={})
        for n in names:
            ms = statistics.median(per[n]["ms"])
            mhz = statistics.median(per[n]["mhz"]) if per[n]["mhz"] else float("nan")
            w = statistics.median(per[n]["w"]) if per[n]["w"] else float("nan")
            row["providers"][n] = dict(ms=ms, mhz=mhz, watts=w, mj_per_call=w * ms, samples=len(per[n]["mhz"]))
        log(json.dumps(row))
        result["rows"].append(row)
        del graphs
    smi.close()
    with open(os.path.join(out, "fused_forward_clocks.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'row':30s} {'provider':12s} {'ms/call':>8s} {'/floor':>7s} {'MHz':>6s} {'W':>6s} {'mJ/call':>8s}")
    for r in result["rows"]:
        fl = r["providers"].get("floor", {}).get("ms")
        for n, p in r["providers"].items():
            rel = p["ms"] / fl if fl else float("nan")
            print(f"{r['row']:30s} {n:12s} {p['ms']:8.4f} {rel:7.3f} {p['mhz']:6.0f} {p['watts']:6.0f} "
                  f"{p['mj_per_call']:8.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true", help="the NVTX-marked calls for Nsight Compute")
    ap.add_argument("--rows", default="1,2", help="gluon_forward_probe's row indices")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="out_profile")
    a = ap.parse_args(argv)
    rows = [GP.ROWS[int(i)] for i in a.rows.split(",")]
    names = tuple(a.providers.split(","))
    if a.ncu:
        return ncu_targets(rows, names)
    os.makedirs(a.out, exist_ok=True)
    clocks(rows, names, a.seconds, a.rounds, a.out)


if __name__ == "__main__":
    main()
