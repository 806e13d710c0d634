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

``--clocks`` (default): each provider's call captured in a CUDA graph, replayed back to back for
--seconds (steady load, no flush; ``timing.time_steady``) while ``nvidia-smi`` samples the SM clock
and the board power every 50 ms; providers rotated over --rounds. Prints ms per call, median clock
and power, and the energy per call: at the power limit a kernel that spends more energy per call
(more data moved per FLOP, more instructions) runs at a lower clock.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/fused_forward_profile.py --rows 1,2 --out $OUT/clocks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_families as BF  # noqa: E402
import bench_module as BMOD  # noqa: E402
import gluon_forward_probe as GP  # noqa: E402

from fusedqkv.bench import timing  # noqa: E402

PROVIDERS = ("floor", "today", *GP.GLUON)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def provider_fns(cfg, args, names):
    def make(n):
        if n == "floor":
            return GP.floor_fn(args)
        if n == "today":
            return GP.today_fn(cfg, args)
        fuse, tile = GP.GLUON[n]
        return GP.fused_fn(cfg, args, fuse, **tile)
    return {n: make(n) for n in names}


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


def clocks(rows, names, seconds, rounds, out):
    result = dict(device=torch.cuda.get_device_name(), rows=[])
    sampler = timing.ClockSampler(torch.cuda.current_device())
    for cfg_name, b, s in rows:
        cfg = BMOD.CONFIGS[cfg_name]
        fns = provider_fns(cfg, GP.make(cfg, b, s, torch.device("cuda")), names)
        steady = BF.time_graphs_steady(fns, seconds, rounds, sampler)
        row = dict(row=f"{cfg_name} {b}x{s}",
                   providers={n: dict(p, mj_per_call=p["watts"] * p["ms"]) for n, p in steady.items()})
        log(json.dumps(row))
        result["rows"].append(row)
    sampler.close()
    with open(os.path.join(out, "fused_forward_clocks.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'row':30s} {'provider':16s} {'ms/call':>8s} {'/floor':>7s} {'MHz':>6s} {'W':>6s} {'mJ/call':>8s}")
    for r in result["rows"]:
        fl = r["providers"].get("floor", {}).get("ms")
        for n, p in r["providers"].items():
            rel = p["ms"] / fl if fl else float("nan")
            print(f"{r['row']:30s} {n:16s} {p['ms']:8.4f} {rel:7.3f} {p['mhz']:6.0f} {p['watts']:6.0f} "
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
    if set(names) - set(PROVIDERS):
        ap.error(f"--providers: unknown {sorted(set(names) - set(PROVIDERS))}; expected some of {PROVIDERS}")
    if a.ncu:
        return ncu_targets(rows, names)
    os.makedirs(a.out, exist_ok=True)
    clocks(rows, names, a.seconds, a.rounds, a.out)


if __name__ == "__main__":
    main()
