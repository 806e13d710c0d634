"""Where the host time of one training block's forward + backward goes, as a timeline.

``host_costs.py`` times whole calls and parts taken alone; this one stamps ``perf_counter_ns``
at the seams of one call (the GPU kept asleep so that nothing waits on it) and reports the
median of each segment over many calls:

    module call -> Function.forward entered -> left -> module returns
    -> backward() called -> Function.backward entered -> left -> backward() returns

with the planned work inside (``run_forward``, ``training_backward``) stamped too, for the
fused block and for a do-nothing ``autograd.Function`` of the same inputs and outputs (the
engine's own share). The stamps cost ~0.2 us each.

    PYTHONPATH=src python3 benchmarks/host_timeline.py --out DIR [--tokens 512] [--calls 300] [--cprofile]

``--cprofile``: also the Python profile of 400 fused steps, in chunks of 20 behind a GPU sleep each
(own and cumulative time, the costliest functions' callers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import fusedqkv
from fusedqkv import autograd as fa

_now = time.perf_counter_ns
STAMPS: dict = {}


def stamp(name: str) -> None:
    STAMPS[name] = _now()


def wrap(owner, attr: str, before: str, after: str, static: bool = False) -> None:
    fn = getattr(owner, attr)

    def wrapped(*a, **k):
        stamp(before)
        try:
            return fn(*a, **k)
        finally:
            stamp(after)

    setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


class Passthrough(torch.autograd.Function):
    """The engine's own share: the block's nine inputs, three outputs (views), nothing done."""

    @staticmethod
    def forward(ctx, x, w, wq, wk, cos, sin, bias, residual, meta):
        stamp("fwd_in")
        ctx.save_for_backward(x, w, wq, wk, cos, sin)
        out = x.view_as(x), w.view_as(w), wq.view_as(wq)
        stamp("fwd_out")
        return out

    @staticmethod
    def backward(ctx, g1, g2, g3):
        stamp("bwd_in")
        ctx.saved_tensors
        stamp("bwd_out")
        return g1, g2, g3, None, None, None, None, None, None


SEGMENTS = (("call -> Function.forward", "call", "fwd_in"), ("Function.forward body", "fwd_in", "fwd_out"),
            ("  of which run_forward", "plan_fwd_in", "plan_fwd_out"),
            ("Function.forward -> returned", "fwd_out", "returned"),
            ("backward() -> Function.backward", "returned", "bwd_in"), ("Function.backward body", "bwd_in", "bwd_out"),
            ("  of which training_backward", "plan_bwd_in", "plan_bwd_out"),
            ("Function.backward -> backward() returns", "bwd_out", "done"), ("total", "call", "done"))


def timeline(step, calls: int) -> dict:
    samples = {name: [] for name, _, _ in SEGMENTS}
    for _ in range(calls // 50):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 2e-3 * 50))  # ~2 ms of GPU sleep per call: the queue never drains
        for _ in range(50):
            STAMPS.clear()
            step()
            for name, a, b in SEGMENTS:
                if a in STAMPS and b in STAMPS:
                    samples[name].append((STAMPS[b] - STAMPS[a]) / 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items() if v}


def profile_text(step, n: int, title: str, chunk: int = 20) -> str:
    """cProfile of ``n`` calls of ``step`` in chunks of ``chunk``, each behind a GPU sleep long
    enough for it and synchronised after (so the launch queue never fills: a full queue makes a
    launch wait, and the profile would show the wait): top functions by own and cumulative time,
    and the callers of the costliest."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    for _ in range(n // chunk):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 5e-3 * chunk))
        pr.enable()
        for _ in range(chunk):
            step()
        pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    s.write(f"\n==== cProfile: {title}, {n} calls ====\n")
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_callers(8)
    return s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_timeline_out")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    wrap(fa.GQAQKVRoPEQKNormFunction, "forward", "fwd_in", "fwd_out", static=True)
    wrap(fa.GQAQKVRoPEQKNormFunction, "backward", "bwd_in", "bwd_out", static=True)
    wrap(fa, "run_forward", "plan_fwd_in", "plan_fwd_out")
    wrap(fa, "training_backward", "plan_bwd_in", "plan_bwd_out")
    torch.manual_seed(0)
    T = args.tokens
    rows = {}
    for position in ("after_rope", "before_rope"):
        block = fusedqkv.GQAQKVRoPEQKNorm(4096, 32, 8, 128, qk_norm_position=position, device=dev,
                                          dtype=torch.bfloat16)
        hs = torch.randn(1, T, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ang = torch.randn(1, T, 128, device=dev)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        grads = [torch.randn_like(t) for t in block(hs, cos, sin)]
        params = [hs, *block.parameters()]

        def fused_step():
            for t in params:
                t.grad = None
            stamp("call")
            outs = block(hs, cos, sin)
            stamp("returned")
            torch.autograd.backward(outs, grads)
            stamp("done")

        small = [torch.zeros(4, device=dev, requires_grad=True) for _ in range(4)]
        cs = [torch.zeros(4, device=dev) for _ in range(2)]
        small_grads = [torch.ones(4, device=dev) for _ in range(3)]

        def passthrough_step():
            for t in small:
                t.grad = None
            stamp("call")
            outs = Passthrough.apply(*small, *cs, None, None, (32, 8, 1e-6, True, "auto", None, None, None, ""))
            stamp("returned")
            torch.autograd.backward(outs, small_grads)
            stamp("done")

        for label, step in (("fused", fused_step), ("do-nothing Function", passthrough_step)):
            for _ in range(20):
                step()
            rows[f"{label}, {position}"] = timeline(step, args.calls)
        if args.cprofile and position == "before_rope":
            print(profile_text(fused_step, 400, f"fused fwd+bwd, {position}, T={T}"))
    with open(os.path.join(args.out, "host_timeline.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "tokens": T, "rows": rows}, f, indent=1)
    cols = list(rows)
    print(f"\nhost timeline of one training step's block, us (median of {args.calls}), T={T} | "
          f"{torch.cuda.get_device_name()}")
    print(f"{'segment':<42s}" + "".join(f"{c[:24]:>26s}" for c in cols))
    for name, _, _ in SEGMENTS:
        print(f"{name:<42s}" + "".join(f"{rows[c].get(name, float('nan')):26.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
