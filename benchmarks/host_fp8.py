"""Host time of the eager FP8 training block against its GPU time (issue 35's host lead, session 43).

One fwd+bwd of ``GQAQKVRoPEQKNorm(fp8=...)`` through autograd, 091's heads (hidden 4096, 32/8 heads of
128), at each --tokens: the host's time per call behind a GPU sleep (the queue never drains, so the
number is the host's work alone) and the GPU's time per call (CUDA events over back-to-back calls),
each recipe beside bf16, interleaved round by round. A call whose host time is above its GPU time is
host-bound outside CUDA graphs. Then, per recipe at the first --tokens: Triton JIT launches
(``JITFunction.run``) per fwd+bwd, and the Python profile of the fp8 calls (own time; fusedqkv's functions by cumulative time).

    PYTHONPATH=src python3 benchmarks/host_fp8.py --out DIR [--tokens 512,2048,8192] [--against SRC]

``--against SRC``: another tree's fusedqkv (e.g. the change's base), loaded under its own name
(``host_glue_training.load_other``) and timed in the same rounds. Prints a table last; writes host_fp8.json to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

RECIPES = ("bf16", "rowwise", "rowwise_with_gw_hp", "tensorwise")


def host_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 3e-3 * n))  # ~3 ms of GPU sleep per call: the host never waits
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def gpu_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9 * 3e-3 * n))  # the queue filled ahead, so the events time the GPU alone
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--against", default=None)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import fusedqkv

    trees = {"head": fusedqkv}
    if args.against:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from host_glue_training import load_other  # (its custom ops renamed: both trees register theirs)

        trees["base"] = load_other(args.against)
    dev = torch.device("cuda")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        torch.manual_seed(0)
        hs = torch.randn(1, T, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ang = torch.randn(1, T, 128, device=dev)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        fns = {}
        for tree, mod in trees.items():
            for r in RECIPES:
                torch.manual_seed(1)
                block = mod.GQAQKVRoPEQKNorm(4096, 32, 8, 128, device=dev, dtype=torch.bfloat16,
                                             fp8=None if r == "bf16" else r)
                q, k, v = block(hs, cos, sin)
                grads = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
                params = [hs, *block.parameters()]

                def step(block=block, params=params, grads=grads):
                    for p in params:
                        p.grad = None
                    torch.autograd.backward(block(hs, cos, sin), grads)

                for _ in range(3):
                    step()
                fns[(tree, r)] = step
        got = {key: {"host": [], "gpu": []} for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                got[key]["host"].append(host_us(fn, args.calls))
                got[key]["gpu"].append(gpu_us(fn, args.calls))
        for (tree, r), v in got.items():
            h, g = statistics.median(v["host"]), statistics.median(v["gpu"])
            rows.append(dict(tokens=T, tree=tree, recipe=r, host_us=h, gpu_us=g, host_over_gpu=h / g))
            print(f"T{T:<6d} {tree:<5s} {r:<20s} host {h:8.1f} us  gpu {g:8.1f} us  host/gpu {h / g:5.2f}", flush=True)
        if T != int(args.tokens.split(",")[0]):
            continue
        from triton.runtime.jit import JITFunction

        for r in RECIPES[1:]:
            fn = fns[("head", r)]
            n_jit = [0]
            orig = JITFunction.run

            def counting(self, *a, **kw):
                n_jit[0] += 1
                return orig(self, *a, **kw)

            JITFunction.run = counting
            try:
                fn()
                torch.cuda.synchronize()
            finally:
                JITFunction.run = orig
            pr = cProfile.Profile()
            torch.cuda._sleep(int(2e9 * 3e-3 * 50))
            pr.enable()
            for _ in range(50):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("fusedqkv", 24)
            print(f"\n== T{T} {r}: Triton JIT launches per fwd+bwd: {n_jit[0]}\n{s.getvalue()}", flush=True)
            rows.append(dict(tokens=T, tree="head", recipe=r, jit_launches=n_jit[0]))
    with open(os.path.join(args.out, "host_fp8.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\nfwd+bwd host / GPU time per call (us; medians of {args.rounds} rounds of {args.calls}) | "
          f"{torch.cuda.get_device_name()}")
    for r in rows:
        if "host_us" in r:
            print(f"  T{r['tokens']:<6d} {r['tree']:<5s} {r['recipe']:<20s} host {r['host_us']:8.1f}  gpu "
                  f"{r['gpu_us']:8.1f}  host/gpu {r['host_over_gpu']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
