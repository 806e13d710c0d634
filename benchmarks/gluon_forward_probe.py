"""The training forward as one Hopper launch (issue 24): the Gluon GEMM with RoPE + RMSNorm in its
epilogue (``kernels/qkv_rope_norm_gemm_sm90.py``) against the cuBLAS GEMM floor and today's
forward (planned cuBLASLt GEMM + the Triton forward stage).

Checks first, on every row and both norm positions, weighted and not, plus ragged token counts:
the fused kernel's qkv against cuBLAS's (relative error), its q/k against the torch stage run on
the fused qkv (mismatches beyond one bf16 rounding), rstd (relative), and two launches bitwise equal.
Then every provider captured as a CUDA graph (inputs and outputs kept alive), replayed call by call
in a rotating order with the L2 flushed before each; median of --reps; ratios to the floor.
Providers: ``today`` (the plan with the kernel off) and the kernel's (``GLUON``: FUSE and tile overrides):
``gluon_gemm`` (without its epilogue's norm, qkv only), ``gluon_fused`` (the kernel as the plan runs
it), ``gluon_fused_stages4`` (a 4-stage ring). ``--providers`` picks some. (Session 14's experimental
epilogues and tiles lost here in session 15 and were removed: NOTES.)

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/gluon_forward_probe.py --out $OUT/gluon

Writes --out/gluon_forward_probe.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_families as BF  # noqa: E402
import bench_module as BMOD  # noqa: E402

from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.ops import config  # noqa: E402
from fusedqkv.ops.gqa_forward import forward_outputs, forward_torch  # noqa: E402
from fusedqkv.ops.qkv_rope_norm_gemm import FusedGemmForward, call_entries  # noqa: E402
from fusedqkv.ops.training_forward import forward_plan, run_forward  # noqa: E402

ROWS = [(c, b, s) for c in BMOD.CONFIGS for b, s in ((1, 512), (1, 2048), (2, 4096))] + [
    ("091_h4096_q32_kv8", 1, 32768)]
# the kernel's providers: name -> (FUSE, tile options)
GLUON = dict(gluon_gemm=(False, {}), gluon_fused=(True, {}), gluon_fused_stages4=(True, dict(STAGES=4)))
CHECKS = [(c, b, s, nw) for c in BMOD.CONFIGS for (b, s) in ((1, 512), (2, 1000), (1, 77)) for nw in (True, False)]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make(cfg, b, s, device, dtype=torch.bfloat16, weighted=True, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + b * s)
    h, hq, hkv, d = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    n = (hq + 2 * hkv) * d
    x = torch.randn(b, s, h, generator=g).to(device, dtype)
    w = (torch.randn(n, h, generator=g) / h ** 0.5).to(device, dtype)
    wq = (1 + 0.2 * torch.randn(d, generator=g)).to(device, dtype) if weighted else None
    wk = (1 + 0.2 * torch.randn(d, generator=g)).to(device, dtype) if weighted else None
    cos, sin = BMOD.rope_cos_sin(b, s, d, dtype, device)
    return x, w, wq, wk, cos, sin


def fused_fn(cfg, args, fuse=True, **tile):
    x, w, wq, wk, cos, sin = args
    b, s, h = x.shape
    hq, hkv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    M, N = b * s, w.shape[0]
    k = FusedGemmForward(M, N, h, s, hq, hkv, d, 1e-6, cfg["qk_norm_position"] == "after_rope", wq is not None,
                         x.dtype, x.device, fuse=fuse, **tile)

    def call():
        qkv = torch.empty(b, s, N, dtype=x.dtype, device=x.device)
        q, kk, rq, rk, _ = forward_outputs(b, s, hq, hkv, d, x.dtype, x.device, False)
        k.run(call_entries((b, s, hq, hkv, d), x, w, qkv, q, kk, wq, wk, rq, rk, cos, sin))
        return q, kk, qkv, rq, rk
    return call


def today_fn(cfg, args):
    """The forward before this kernel: cuBLASLt + the forward stage."""
    x, w, wq, wk, cos, sin = args
    with config.override(fused_forward="off"):
        plan = forward_plan(x, w, wq, wk, cos, sin, cfg["num_heads"], cfg["num_kv_heads"], 1e-6,
                            cfg["qk_norm_position"], "triton")
    return lambda: run_forward(plan, x, w, wq, wk, cos, sin)


def floor_fn(args):
    x, w = args[0], args[1]
    x2 = x.view(-1, x.shape[-1])
    return lambda: torch.mm(x2, w.t())


def ulps_over_one(a, ref):
    """Elements of ``a`` further from ``ref`` than one bf16 rounding (relative 2**-7 of |ref|, or
    2**-7 absolute near zero)."""
    diff = (a.float() - ref.float()).abs()
    tol = torch.clamp(ref.float().abs(), min=1.0) * 2 ** -7
    return int((diff > tol).sum())


def check(cfg_name, b, s, weighted, device):
    cfg = BMOD.CONFIGS[cfg_name]
    args = make(cfg, b, s, device, weighted=weighted)
    x, w, wq, wk, cos, sin = args
    call = fused_fn(cfg, args)
    q, k, qkv, rq, rk = call()
    q2, k2, qkv2, rq2, rk2 = call()
    torch.cuda.synchronize()
    ref_qkv = torch.mm(x.view(-1, x.shape[-1]), w.t()).view_as(qkv)
    rel = float((qkv.float() - ref_qkv.float()).norm() / ref_qkv.float().norm())
    tq, tk, trq, trk, _ = forward_torch(qkv, wq, wk, cos, sin, cfg["num_heads"], cfg["num_kv_heads"], 1e-6,
                                        cfg["qk_norm_position"] == "after_rope")
    out = dict(row=f"{cfg_name} {b}x{s} {'w' if weighted else 'unweighted'}", qkv_rel=rel,
               q_bad=ulps_over_one(q, tq), k_bad=ulps_over_one(k, tk),
               q_maxdiff=float((q.float() - tq.float()).abs().max()),
               rstd_rel=float(max(((rq - trq).abs() / trq).max(), ((rk - trk).abs() / trk).max())),
               repeat_equal=bool(torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(qkv, qkv2)
                                 and torch.equal(rq, rq2) and torch.equal(rk, rk2)),
               finite=bool(torch.isfinite(q).all() and torch.isfinite(k).all()))
    out["ok"] = (rel < 2e-3 and out["q_bad"] == 0 and out["k_bad"] == 0 and out["rstd_rel"] < 1e-4
                 and out["repeat_equal"] and out["finite"])
    return out


def host_rows(rows, device, result, out):
    import host_costs as HC

    for cfg_name, b, s in rows:
        cfg = BMOD.CONFIGS[cfg_name]
        x, w, wq, wk, cos, sin = make(cfg, b, s, device)
        fns = {}
        for mode in ("off", "on"):
            with config.override(fused_forward=mode):
                plan = forward_plan(x, w, wq, wk, cos, sin, cfg["num_heads"], cfg["num_kv_heads"], 1e-6,
                                    cfg["qk_norm_position"], "triton")
            assert (plan.fused is not None) == (mode == "on")
            fns[mode] = (lambda p: lambda: run_forward(p, x, w, wq, wk, cos, sin))(plan)
        us = HC.interleaved_host_us(fns, n=50)
        row = dict(row=f"{cfg_name} {b}x{s}", host_us=us)
        log(json.dumps(row))
        result["rows"].append(row)
    with open(os.path.join(out, "gluon_forward_host.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'row':34s} {'stage path us':>14s} {'fused us':>9s}")
    for r in result["rows"]:
        print(f"{r['row']:34s} {r['host_us']['off']:14.1f} {r['host_us']['on']:9.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out_gluon")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default=None, help="comma-separated row indices")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--providers", default=None, help="comma-separated providers (default: today and every kernel "
                    "provider)")
    ap.add_argument("--host", action="store_true",
                    help="only the host time per planned forward call (us, the GPU kept busy behind a sleep), the "
                         "kernel's plan against cuBLASLt + the stage, interleaved")
    a = ap.parse_args(argv)
    names = ["today"] + [n for n in (a.providers.split(",") if a.providers else GLUON) if n != "today"]
    unknown = [n for n in names if n not in GLUON and n != "today"]
    if unknown:
        ap.error(f"--providers: unknown {unknown}; expected today or some of {list(GLUON)}")
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda")
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=[], rows=[])
    import triton
    result["triton"] = triton.__version__
    if not a.skip_checks:
        for c in CHECKS:
            try:
                r = check(*c, device)
            except Exception:  # noqa: BLE001
                r = dict(row=str(c), ok=False, error=traceback.format_exc()[-2000:])
            log(json.dumps(r))
            result["checks"].append(r)
    rows = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    if a.host:
        return host_rows(rows, device, result, a.out)
    flusher = timing.L2Flusher(device)
    for cfg_name, b, s in rows:
        cfg = BMOD.CONFIGS[cfg_name]
        args = make(cfg, b, s, device)
        fns = dict(floor=floor_fn(args), today=today_fn(cfg, args))
        fns.update({n: fused_fn(cfg, args, GLUON[n][0], **GLUON[n][1]) for n in names if n in GLUON})
        try:
            ms = BF.time_graphs_interleaved(fns, a.reps, flusher=flusher)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
            continue
        med = {n: statistics.median(v) for n, v in ms.items()}
        row = dict(row=f"{cfg_name} {b}x{s}", ms=med, over_floor={n: med[n] / med["floor"] for n in med})
        log(json.dumps(row))
        result["rows"].append(row)
        with open(os.path.join(a.out, "gluon_forward_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("checks:", sum(c["ok"] for c in result["checks"]), "/", len(result["checks"]), "ok")
    for c in result["checks"]:
        if not c["ok"]:
            print("  FAIL", json.dumps(c)[:600])
    print(f"{'row':34s} {'floor ms':>9s} " + " ".join(f"{n:>21s}" for n in names))
    for r in result["rows"]:
        print(f"{r['row']:34s} {r['ms']['floor']:9.4f} " + " ".join(f"{r['over_floor'][n]:21.3f}" for n in names))


if __name__ == "__main__":
    main()
