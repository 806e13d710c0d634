"""Host time per call (us): what a call costs the CPU, the GPU kept out of the way.

N back-to-back calls are timed with ``perf_counter`` behind a GPU sleep long enough that no
launch ever waits for the GPU (so the number is the host's work alone: validation or plan
lookup, allocations, launches). Rows:

* the 091 backward (``gqa_qkv_rope_qk_norm_backward``) at the given workloads, with and
  without ``out=``, and two plain ``torch.mm`` of the same products for scale; the three also
  interleaved round by round, so issue 36's 091 ratios (out= <= 1.5x, allocating <= 2.3x two
  ``torch.mm``) come from the same rounds ("[same rounds]" rows, a table at the end);
* the training block (``GQAQKVRoPEQKNorm``) forward alone and forward + backward
  (``torch.autograd.backward`` on the three outputs), HunyuanImage-3 heads, at each of
  --train-tokens; its parts (the planned work without autograd, a do-nothing ``autograd.Function``)
  and two ``torch.mm`` of the backward's products, all four interleaved round by round, so issue
  36's ratio (training fwd+bwd / two ``torch.mm``) comes from the same rounds, with a fifth: the
  same fwd+bwd under ``torch.autograd.set_multithreading_enabled(False)`` (the engine's hand-off to
  its device thread left out); and the
  cost per block inside a step of 8 blocks (one ``backward()``: the engine's per-call cost,
  paid once per step by a model, is shared), next to a do-nothing Function's.

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=... python3 benchmarks/host_costs.py --out DIR \
        [--workloads 11,2,15,3] [--cprofile]

Each bound launch of the 091 call is timed through the driver (ctypes, the default where the gate
allows) and through Triton's C launcher, interleaved ("[A/B: ...]" rows); the whole calls take the
process's mode: FUSEDQKV_RAW_LAUNCH=triton runs them all through Triton's launcher.

Prints a table last; writes host_costs.json to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

import fusedqkv
from fusedqkv import gqa_qkv_rope_qk_norm_backward
from fusedqkv.bench import problem
from fusedqkv.ops import config, cublaslt, internals
from fusedqkv.ops import backward_091, training_backward, training_forward
from fusedqkv.ops.device import current_stream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_thread  # noqa: E402


def host_us(fn, n=100, reps=7):
    """Median over reps of the mean host time of n calls, behind a GPU sleep (the queue never drains)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 1e-3 * n * 1.0))  # ~1 ms of GPU sleep per call at ~2 GHz
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def interleaved_host_us(fns: dict, n=100, rounds=9, contexts=None) -> dict:
    """``host_us`` of several callables, one sample each in turn per round (the host's speed
    drifts): the median per name. ``contexts[name]()`` (optional) is entered around that name's
    sample, outside the timed calls."""
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            with (contexts[k]() if contexts and k in contexts else contextlib.nullcontext()):
                f()
                got[k].append(host_us(f, n=n, reps=1))
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_costs_out")
    ap.add_argument("--workloads", default="11,2,15,3", help="091 workloads (128, 131, 512, 1571 tokens)")
    ap.add_argument("--train-tokens", default="128,131,512,1571",
                    help="the training block's token counts (issue 36's rows), comma-separated")
    ap.add_argument("--cprofile", action="store_true", help="also the Python profile of 200 calls (091, out=)")
    ap.add_argument("--config", default="", metavar="CHANGES",
                    help="run everything under config.override(**config.parse_changes(CHANGES)), "
                         "e.g. 'chain_dx_above_128=128,64,64,4,6,1;chain_min_balance=0'")
    engine_thread.add_flag(ap)
    args = ap.parse_args()
    engine_thread.apply(args.backward_on_caller)
    if args.config:
        changes = config.parse_changes(args.config)
        print(f"config changes: {changes}", flush=True)
        # entered for the process's life (never left): every plan below is built under it
        config.override(**changes).__enter__()
    os.makedirs(args.out, exist_ok=True)
    train_tokens = [int(t) for t in args.train_tokens.split(",") if t.strip()]
    if not train_tokens or min(train_tokens) < 1:
        ap.error(f"--train-tokens: positive token counts, comma-separated; got {args.train_tokens!r}")
    training_ratios: list = []
    ratios_091: list = []  # the 091 call (out= and allocating) / two torch.mm, in the same rounds
    defn = problem.load_definition()
    dev = torch.device("cuda")
    rows = []
    for wi in (int(x) for x in args.workloads.split(",") if x.strip()):
        w = defn.workloads[wi]
        a = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        out = tuple(torch.empty_like(t) for t in gqa_qkv_rope_qk_norm_backward(*a))
        M = w.tokens
        dq = torch.empty(M, a[6].shape[0], device=dev, dtype=a[0].dtype)
        x = a[3].reshape(M, -1)
        dx = out[0].view(M, -1)
        cases = {
            "091 call, out=": lambda: gqa_qkv_rope_qk_norm_backward(*a, out=out),
            "091 call": lambda: gqa_qkv_rope_qk_norm_backward(*a),
            "two torch.mm (out=)": lambda: (torch.mm(dq, a[6], out=dx), torch.mm(dq.t(), x, out=out[3])),
        }
        # the parts of one planned call (out=): lookup, addresses, each bound launch alone
        launch_ab: dict = {}  # k -> (kernel, through the driver (ctypes), through Triton's C launcher)

        gqa_qkv_rope_qk_norm_backward(*a, out=out)
        p = backward_091.PLANS.last()
        tensors13 = list(a[:13]) + list(out)
        scal = backward_091._scalars(a[13], out, None)
        cases["  plan lookup (guards)"] = lambda: backward_091.PLANS.lookup(tensors13, scal, None)
        cases["  19 data_ptr()"] = lambda: [t.data_ptr() for t in tensors13]
        cases["  torch.empty(dqkv)"] = lambda: torch.empty(p.dqkv_shape, dtype=p.dtype, device=dev)
        if getattr(p, "_gather", None) is not None or getattr(p, "_ready", False):  # this tree or an older one
            named = dict(zip(backward_091.INPUT_NAMES, a[:13]))
            named.update(zip(backward_091.OUTPUT_NAMES, out))
            named.update(p.stage.call_inputs(current_stream(dev)),
                         dqkv=torch.empty(p.dqkv_shape, dtype=p.dtype, device=dev))
            ptrs = p.table.addresses({name: t.data_ptr() for name, t in named.items()})
            stream = current_stream(dev)
            for k, bl in enumerate(p.launches):
                cases[f"  bound launch {k} ({bl.fn.__name__[:18]})"] = (
                    lambda bl=bl: bl.launch(None, ptrs, stream))
                via_triton = getattr(bl._raw, "triton", None)  # bound to the driver launch: its old path too
                if via_triton is not None:
                    def old_path(bl=bl, via_triton=via_triton):
                        if bl._descs:
                            bl.encode(ptrs)
                        via_triton(ptrs, stream)

                    launch_ab[k] = (bl.fn.__name__[:18], cases[f"  bound launch {k} ({bl.fn.__name__[:18]})"],
                                    old_path)
            if p.lt_dx is not None:
                cases["  ctypes call, no arguments"] = cublaslt._find_library().cublasLtGetVersion
                cases["  planned cuBLASLt dX"] = lambda: p.lt_dx(dq.data_ptr(), a[6].data_ptr(), out[0].data_ptr(),
                                                                  stream)
                cases["  torch.mm dX (out=)"] = lambda: torch.mm(dq, a[6], out=dx)
        # allocating the six outputs (the call without out=), three ways
        specs = [(shape, dt) for _, shape, dt in p.out_specs]
        likes = (a[3], a[4], a[5], a[6], a[7], a[8])  # hidden_states, cos, sin, W, wq, wk: the outputs' dtypes
        cases["  6 torch.empty (outputs)"] = lambda: [torch.empty(sh, dtype=dt, device=dev) for sh, dt in specs]
        if all(t.dtype == dt for t, (_, dt) in zip(likes, specs)):
            cases["  6 new_empty (outputs)"] = lambda: [t.new_empty(sh) for t, (sh, _) in zip(likes, specs)]
        pieces = []
        for sh, dt in specs:
            n = math.prod(sh) * dt.itemsize
            pieces += [n, -n % 256]
        cases["  1 empty + split + 6 views"] = lambda: [
            piece.view(dt).view(sh) for piece, (sh, dt) in
            zip(torch.empty(sum(pieces), dtype=torch.uint8, device=dev).split_with_sizes(pieces)[::2], specs)]
        for name, fn in cases.items():
            fn()
            rows.append({"case": name, "workload": w.name, "tokens": M, "host_us": host_us(fn)})
            print(f"{w.name:<14s} {name:<22s} {rows[-1]['host_us']:8.1f} us", flush=True)
        # A/B, interleaved rep by rep (the host's speed drifts): the call with out= and the call that
        # allocates its outputs; then the products as planned cuBLASLt calls vs torch.mm
        fn = cases["091 call, out="]
        ab = interleaved_host_us({"091 call, out= [A/B vs allocating]": fn, "091 call [A/B vs out=]": cases["091 call"]})
        ab.update(interleaved_host_us(
            {"091 call, out= [A/B: cuBLASLt]": fn, "091 call, out= [A/B: torch.mm]": fn},
            contexts={"091 call, out= [A/B: cuBLASLt]": lambda: config.override(cublaslt=True),
                      "091 call, out= [A/B: torch.mm]": lambda: config.override(cublaslt=False)}))
        # issue 36's 091 rows: the call with out=, the allocating call and two torch.mm in the same rounds
        same = interleaved_host_us({"091 call, out= [same rounds]": fn, "091 call [same rounds]": cases["091 call"],
                                    "two torch.mm (out=) [same rounds]": cases["two torch.mm (out=)"]})
        ab.update(same)
        mm_us = same["two torch.mm (out=) [same rounds]"]
        out_r, alloc_r = same["091 call, out= [same rounds]"] / mm_us, same["091 call [same rounds]"] / mm_us
        ratios_091.append(dict(workload=w.name, tokens=M, out_us=same["091 call, out= [same rounds]"],
                               alloc_us=same["091 call [same rounds]"], two_mm_us=mm_us, out_ratio=out_r,
                               alloc_ratio=alloc_r, ok=out_r <= 1.5 and alloc_r <= 2.3))
        for k, (kernel, driver, triton_launcher) in launch_ab.items():  # issue 36: the two raw launch paths
            ab.update(interleaved_host_us({f"  bound launch {k} ({kernel}) [A/B: ctypes]": driver,
                                           f"  bound launch {k} ({kernel}) [A/B: Triton's launcher]": triton_launcher}))
        for label, us in ab.items():
            rows.append({"case": label, "workload": w.name, "tokens": M, "host_us": us})
            print(f"{w.name:<14s} {label:<22s} {us:8.1f} us", flush=True)
        if args.cprofile and wi == int(args.workloads.split(",")[0]):
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                gqa_qkv_rope_qk_norm_backward(*a, out=out)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(16)
            print(s.getvalue())
    # the training block: HunyuanImage-3 heads, bf16, at each --train-tokens
    torch.manual_seed(0)
    for T, position in ((T, position) for T in train_tokens for position in ("after_rope", "before_rope")):
        block = fusedqkv.GQAQKVRoPEQKNorm(4096, 32, 8, 128, qk_norm_position=position, device=dev,
                                          dtype=torch.bfloat16)
        hs = torch.randn(1, T, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ang = torch.randn(1, T, 128, device=dev)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        q, k, v = block(hs, cos, sin)
        grads = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))

        def fwd():
            with torch.no_grad():
                block(hs, cos, sin)

        params = [hs, *block.parameters()]

        def fwd_bwd():  # a training step's share: gradients set to None first (optimizer.zero_grad)
            for t in params:
                t.grad = None
            torch.autograd.backward(block(hs, cos, sin), grads)

        # the parts: the planned forward and backward alone (no autograd), and autograd's share
        after = position == "after_rope"
        cos_e, sin_e = cos.expand(1, T, 128), sin.expand(1, T, 128)
        W, wq, wk = block.qkv_weight, block.q_norm_weight, block.k_norm_weight
        fplan = training_forward.forward_plan(hs, W, wq, wk, cos_e, sin_e, 32, 8, block.eps, position, "auto")
        qkv_saved = training_forward.run_forward(fplan, hs, W, wq, wk, cos_e, sin_e)[2]

        def plan_fwd():
            training_forward.run_forward(fplan, hs, W, wq, wk, cos_e, sin_e)

        @torch.no_grad()  # as inside autograd's backward
        def plan_bwd():
            training_backward.training_backward(*grads, hs, W, qkv_saved, wq, wk, cos_e, sin_e, 32, 8, block.eps,
                                                after, True, True, False, "auto")

        class Passthrough(torch.autograd.Function):  # autograd's own share: a Function that does nothing
            @staticmethod
            def forward(ctx, x, w1, w2, w3):
                return x.view_as(x), w1.view_as(w1), w2.view_as(w2)

            @staticmethod
            def backward(ctx, g1, g2, g3):
                return g1, g2, g3, None

        small = [torch.zeros(4, device=dev, requires_grad=True) for _ in range(4)]
        small_grads = [torch.ones(4, device=dev) for _ in range(3)]

        def autograd_only():
            for t in small:
                t.grad = None
            torch.autograd.backward(Passthrough.apply(*small), small_grads)

        for name, fn in (("  planned forward alone", plan_fwd), ("  planned backward alone", plan_bwd),
                         ("  autograd alone (a Function doing nothing)", autograd_only)):
            fn()
            rows.append({"case": f"{name} {position}", "workload": f"T{T}", "tokens": T, "host_us": host_us(fn, n=50)})
            print(f"T{T:<13d} {name + ' ' + position:<40s} {rows[-1]['host_us']:8.1f} us", flush=True)
        # A/B/C/D interleaved rep by rep (the host's speed drifts): the whole step, autograd's own
        # share, the planned work without autograd, and the yardstick of issue 36's ratio: two
        # torch.mm (out=) of the backward's products at these tokens, as the 091 rows' (dX = dQKV W,
        # dW = dQKV^T x)
        dq_mm = torch.randn(T, W.shape[0], device=dev, dtype=torch.bfloat16)
        x_mm, dx_mm, dw_mm = hs.detach().reshape(T, -1), torch.empty_like(hs).reshape(T, -1), torch.empty_like(W)
        two_mm = "  two torch.mm (out=) [A/B/C/D]"
        on_caller = "  training forward+backward, backward on the calling thread [A/B/C/D]"

        def fwd_bwd_on_caller():  # the engine's hand-off to its device thread left out (NOTES, session 27)
            with torch.autograd.set_multithreading_enabled(False):
                fwd_bwd()

        abc = {"training forward+backward [A/B/C/D]": fwd_bwd,
               on_caller: fwd_bwd_on_caller,
               "  autograd alone [A/B/C/D]": autograd_only,
               "  planned forward + backward, no autograd [A/B/C/D]": lambda: (plan_fwd(), plan_bwd()),
               two_mm: lambda: (torch.mm(dq_mm, W.detach(), out=dx_mm), torch.mm(dq_mm.t(), x_mm, out=dw_mm))}
        got = interleaved_host_us(abc, n=50)
        for k, us in got.items():
            rows.append({"case": f"{k} {position}", "workload": f"T{T}", "tokens": T, "host_us": us})
            print(f"T{T:<13d} {k + ' ' + position:<40s} {us:8.1f} us", flush=True)
        ratio = got["training forward+backward [A/B/C/D]"] / got[two_mm]
        bound = 12.0 if T <= 512 else 15.0  # issue 36
        ratio_on_caller = got[on_caller] / got[two_mm]
        training_ratios.append(dict(tokens=T, position=position, fwd_bwd_us=got["training forward+backward [A/B/C/D]"],
                                    two_mm_us=got[two_mm], ratio=ratio, bound=bound, ok=ratio <= bound,
                                    fwd_bwd_on_caller_us=got[on_caller], ratio_on_caller=ratio_on_caller))
        print(f"T{T:<13d} training fwd+bwd / two torch.mm (same rounds) {position}: {ratio:.2f}x (<= {bound:.0f}x: "
              f"{'met' if ratio <= bound else 'NOT met'}); backward on the calling thread {ratio_on_caller:.2f}x",
              flush=True)
        if T != train_tokens[-1] and T != 512:
            continue  # the per-block and single-shot rows: at 512 tokens (and the last) only
        # per block inside a step of several: one backward() for N blocks, so the autograd engine's
        # fixed cost per backward call (a model pays it once per step, not per layer) is shared;
        # marginal = (T(N blocks) - T(1 block)) / (N - 1), ours and a do-nothing Function's
        n_blocks = 8
        stack = [block] + [fusedqkv.GQAQKVRoPEQKNorm(4096, 32, 8, 128, qk_norm_position=position, device=dev,
                                                     dtype=torch.bfloat16) for _ in range(n_blocks - 1)]
        stack_params = [hs] + [p_ for b_ in stack for p_ in b_.parameters()]
        pass_inputs = [[torch.zeros(4, device=dev, requires_grad=True) for _ in range(4)] for _ in range(n_blocks)]

        def step_of(n):
            def run():
                for t in stack_params:
                    t.grad = None
                outs = [o for b_ in stack[:n] for o in b_(hs, cos, sin)]
                torch.autograd.backward(outs, list(grads) * n)
            return run

        def pass_step_of(n):
            def run():
                for ins in pass_inputs[:n]:
                    for t in ins:
                        t.grad = None
                outs = [o for ins in pass_inputs[:n] for o in Passthrough.apply(*ins)]
                torch.autograd.backward(outs, small_grads * n)
            return run

        for label, make in (("fusedqkv", step_of), ("do-nothing Function", pass_step_of)):
            t = interleaved_host_us({"one": make(1), "many": make(n_blocks)}, n=8, rounds=7)
            marginal = (t["many"] - t["one"]) / (n_blocks - 1)
            name = f"training fwd+bwd per block, {n_blocks} blocks a step (marginal) [{label}]"
            rows.append({"case": f"{name} {position}", "workload": f"T{T}", "tokens": T, "host_us": marginal,
                         "one_block_us": t["one"], "n_blocks_us": t["many"]})
            print(f"T{T:<13d} {name + ' ' + position:<40s} {marginal:8.1f} us", flush=True)
        for name, fn, variant in (("training forward (no_grad)", fwd, True),
                                  ("training forward+backward", fwd_bwd, True),
                                  ("training forward+backward [torch.mm]", fwd_bwd, False)):
            with config.override(cublaslt=variant):
                fn()
                m0 = (training_forward.PLANS.misses, training_backward.PLANS.misses)
                for _ in range(5):
                    fn()
                print(f"plan-cache misses in 5 calls: forward {training_forward.PLANS.misses - m0[0]}, "
                      f"backward {training_backward.PLANS.misses - m0[1]}")
                if args.cprofile and position == "after_rope":
                    import cProfile
                    import io
                    import pstats

                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(100):
                        fn()
                    pr.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
                    print(s.getvalue())
                rows.append({"case": f"{name} {position}", "workload": f"T{T}", "tokens": T,
                             "host_us": host_us(fn, n=50)})
                print(f"T{T:<13d} {name + ' ' + position:<40s} {rows[-1]['host_us']:8.1f} us", flush=True)
    fast_path = internals.fast_path_info()
    with open(os.path.join(args.out, "host_costs.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fast_path": fast_path,
                   "backward_on_caller": args.backward_on_caller, "config": args.config, "rows": rows, "training_ratios": training_ratios,
                   "ratios_091": ratios_091}, f, indent=1)
    print(f"\nhost time per call (us, median of 7 x N calls, GPU never waited on) | {torch.cuda.get_device_name()} | "
          f"{engine_thread.LABEL + ' | ' if args.backward_on_caller else ''}"
          f"raw launches: {fast_path['launch']} ({fast_path['driver_launches']} of {fast_path['bound_launches']} "
          f"bound through the driver)")
    for r in rows:
        print(f"  {r['workload']:<14s} {r['tokens']:6d} {r['case']:<45s} {r['host_us']:8.1f}")
    if ratios_091:
        print("\n091 / two torch.mm, interleaved in the same rounds (issue 36: out= <= 1.5x, allocating <= 2.3x)")
    for r in ratios_091:
        print(f"  {r['workload']:<14s} {r['tokens']:6d}  out= {r['out_us']:7.1f} / {r['two_mm_us']:6.1f} us = "
              f"{r['out_ratio']:5.2f}x   allocating {r['alloc_us']:7.1f} us = {r['alloc_ratio']:5.2f}x  "
              f"{'met' if r['ok'] else 'NOT met'}")
    print("\ntraining fwd+bwd / two torch.mm, interleaved in the same rounds (issue 36: <= 12x at <= 512 tokens, "
          "<= 15x above)")
    for r in training_ratios:
        print(f"  T{r['tokens']:<6d} {r['position']:<12s} {r['fwd_bwd_us']:8.1f} / {r['two_mm_us']:6.1f} us = "
              f"{r['ratio']:5.2f}x  {'met' if r['ok'] else 'NOT met':<8s}  backward on the calling thread "
              f"{r['fwd_bwd_on_caller_us']:8.1f} us = {r['ratio_on_caller']:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
