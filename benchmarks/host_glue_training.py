"""The training block's host glue, phase by phase: one fwd+bwd of ``GQAQKVRoPEQKNorm`` through
autograd, stamped at its seams, next to a do-nothing ``autograd.Function`` of the same signature
in the same rounds (issue 36).

    # CPU, no GPU: the plans built under the Triton interpreter, then their launches and cuBLASLt
    # products replaced by no-ops (as host_glue_091.py does for 091): what is left is the Python and
    # torch ops of the glue
    PYTHONPATH=src python3 benchmarks/host_glue_training.py [--against ../main/src] [--cprofile]
    # on the device: real launches and products, each chunk of calls behind a GPU sleep
    PYTHONPATH=src python3 benchmarks/host_glue_training.py --device cuda --out $OUT/glue [--against DIR]

Phases (median over stamped calls, us):

    module call -> forward()               nn.Module.__call__
    forward() -> Function.forward          the functional entry: checks, plan lookup, meta, apply
      of which the forward plan lookup
    Function.forward body                  of which run_forward (outputs, launches); the rest: ctx work
    Function.forward -> module returns     autograd's output wrapping and saving (C++), __call__'s return
    backward() -> Function.backward        the engine (on CUDA: the hand-off to its device thread)
    Function.backward body                 of which training_backward (lookup, outputs, launches)
    Function.backward -> backward() returns   gradient checks, AccumulateGrad, the engine's end

Rows: the fused block (and with ``--against SRC``, the fusedqkv of another tree, e.g. the base of a
change, loaded under another name, interleaved round by round with this one), the do-nothing Function
saving what ours saves (7 tensors) and saving nothing: the difference is ``save_for_backward``'s cost.
Then whole fwd+bwd steps without stamps (median of rounds of N calls), each as a ratio to the
do-nothing Function of the same rounds. ``--cprofile``: the Python profile of the fused steps.

The CPU run differs from the device's where the device does more: the engine runs the backward on
the calling thread (CUDA: a hand-off to its device thread), the stream lookup and capture check are
trivial, and no launch or product costs anything. On the device the steps run in chunks behind a
GPU sleep long enough that the launch queue neither drains nor fills.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_thread  # noqa: E402


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=None, help="tokens (batch 1); default 128 on CPU, 512 on CUDA")
    ap.add_argument("--hidden", type=int, default=None, help="default 512 on CPU, 4096 on CUDA")
    ap.add_argument("--position", default="after_rope", choices=("after_rope", "before_rope"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="calls per round and row")
    ap.add_argument("--against", default=None, help="a src dir holding another tree's fusedqkv/, timed beside this one")
    ap.add_argument("--cprofile", action="store_true")
    engine_thread.add_flag(ap)
    ap.add_argument("--cprofile-diff", action="store_true",
                    help="profile the fused step and the planned work alone; print each function's own time per "
                         "step in both, largest difference first (what autograd's context makes slower)")
    ap.add_argument("--out", default=None, help="directory for host_glue_training.json")
    return ap.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

_now = time.perf_counter_ns
STAMPS: dict = {}


def stamp(name: str) -> None:
    STAMPS[name] = _now()


SEGMENTS = (
    ("module call -> forward()", "call", "mod_fwd"),
    ("forward() -> Function.forward", "mod_fwd", "fwd_in"),
    ("  of which the forward plan lookup", "lookup_in", "lookup_out"),
    ("Function.forward body", "fwd_in", "fwd_out"),
    ("  of which run_forward", "run_in", "run_out"),
    ("Function.forward -> module returns", "fwd_out", "returned"),
    ("backward() -> Function.backward", "returned", "bwd_in"),
    ("Function.backward body", "bwd_in", "bwd_out"),
    ("  of which training_backward", "tb_in", "tb_out"),
    ("Function.backward -> backward() returns", "bwd_out", "done"),
    ("total", "call", "done"),
)


# ------------------------------------------------------------------------------ the packages


def load_other(src: str, name: str = "fusedqkv_ab"):
    """``src``/fusedqkv imported as ``name`` (a copy in a temporary directory, its custom ops renamed so
    that both trees register theirs)."""
    tmp = tempfile.mkdtemp(prefix="host_glue_")
    dst = os.path.join(tmp, name)
    shutil.copytree(os.path.join(src, "fusedqkv"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    for root, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(root, f)
                with open(p) as fh:
                    text = fh.read()
                with open(p, "w") as fh:
                    fh.write(text.replace('"fusedqkv::', f'"{name}::'))
    sys.path.insert(0, tmp)
    return importlib.import_module(name)


def _noop(*a):
    return None


class Fused:
    """One tree's block, its step, and its stamps (installed only while the timeline runs)."""

    def __init__(self, label: str, pkg, dev, T: int, hidden: int, position: str):
        self.label, self.pkg = label, pkg
        ops = importlib.import_module(pkg.__name__ + ".ops.training_forward"), \
            importlib.import_module(pkg.__name__ + ".ops.training_backward")
        self.tf, self.tb = ops
        self.fa = importlib.import_module(pkg.__name__ + ".autograd")
        if dev.type == "cpu":  # the Triton path under the interpreter (the module's "auto" is torch on the CPU)
            for mod in ops:
                pick = mod.pick_backend
                mod.pick_backend = lambda device, backend, pick=pick: pick(device, backend or "triton")
        torch.manual_seed(0)
        dt = torch.bfloat16
        self.block = pkg.GQAQKVRoPEQKNorm(hidden, 32, 8, 128, qk_norm_position=position, device=dev, dtype=dt)
        self.hs = torch.randn(1, T, hidden, device=dev, dtype=dt, requires_grad=True)
        ang = torch.randn(1, T, 128, device=dev)
        self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)
        outs = self.block(self.hs, self.cos, self.sin)
        self.grads = [torch.randn_like(o) for o in outs]
        self.params = [self.hs, *self.block.parameters()]
        torch.autograd.backward(outs, self.grads)  # the plans (under the interpreter: computed once)
        if dev.type == "cpu":
            self._noop_launches()
        for _ in range(3):  # the plans' gathers made, kept buffers grown
            self.reset()
            self.step()
        self._saved = None

    def _noop_launches(self) -> None:
        fplan, bplan = self.tf.PLANS.last(), self.tb.PLANS.last()
        launches = [fplan.launch] + list(bplan.stage.launches())
        for launch in launches:
            launch._raw = _noop  # "bound": later calls pass addresses
        fplan.lt_qkv = _noop
        bplan.lt_dx = _noop if bplan.need_x else None
        bplan.lt_dw = _noop if bplan.need_w else None

    def reset(self) -> None:  # a training step's zero_grad(set_to_none=True): outside the timed span
        for t in self.params:
            t.grad = None

    def step(self) -> None:
        torch.autograd.backward(self.block(self.hs, self.cos, self.sin), self.grads)

    def stamped_step(self) -> None:
        stamp("call")
        outs = self.block(self.hs, self.cos, self.sin)
        stamp("returned")
        torch.autograd.backward(outs, self.grads)
        stamp("done")

    # the stamps: wrappers set for the timeline, the originals back for the plain steps
    def _targets(self):
        fn = self.fa.GQAQKVRoPEQKNormFunction
        out = [(fn, "forward", "fwd_in", "fwd_out", True), (fn, "backward", "bwd_in", "bwd_out", True)]
        for attr, a, b in (("forward_plan", "lookup_in", "lookup_out"), ("run_forward", "run_in", "run_out"),
                           ("training_backward", "tb_in", "tb_out")):
            if hasattr(self.fa, attr):
                out.append((self.fa, attr, a, b, False))
        return out

    def install(self) -> None:
        self._saved = []
        for owner, attr, a, b, static in self._targets():
            orig = owner.__dict__[attr]
            fn = orig.__func__ if isinstance(orig, staticmethod) else orig

            def wrapped(*args, _fn=fn, _a=a, _b=b, **kw):
                stamp(_a)
                try:
                    return _fn(*args, **kw)
                finally:
                    stamp(_b)

            self._saved.append((owner, attr, orig))
            setattr(owner, attr, staticmethod(wrapped) if static else wrapped)
        block = self.block
        fwd = type(block).forward

        def module_forward(*args, **kw):
            stamp("mod_fwd")
            return fwd(block, *args, **kw)

        block.forward = module_forward  # an instance attribute: Module.__call__ calls it

    def uninstall(self) -> None:
        for owner, attr, orig in self._saved:
            setattr(owner, attr, orig)
        del self.block.forward


class DoNothing:
    """A Function of the block's signature -- (x, W, wq, wk, cos, sin, bias, residual, meta) ->
    three 4-D outputs; gradients for the four parameters -- that does nothing but views (outputs as
    4-D views of the inputs, gradients viewed back), on small stand-ins of the inputs' ranks (4-D
    outputs matter: ``torch.autograd.backward`` compares each output's shape with its gradient's in
    Python, per dimension); ``save``: save seven tensors, as ours does, or none."""

    def __init__(self, label: str, dev, save: bool):
        self.label = label

        class Passthrough(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, wq, wk, cos, sin, bias, residual, meta):
                stamp("fwd_in")
                if save:
                    ctx.save_for_backward(x, w, wq, wk, cos, sin, x.view_as(x))
                out = x.view(1, 1, 1, 4), w.view(1, 1, 1, 4), wq.view(1, 1, 1, 4)
                ctx.meta = meta
                stamp("fwd_out")
                return out

            @staticmethod
            def backward(ctx, g1, g2, g3):
                stamp("bwd_in")
                if save:
                    ctx.saved_tensors
                out = g1.view(1, 1, 4), g2.view(1, 4), g3.view(4), g3.view(4)
                stamp("bwd_out")
                return *out, None, None, None, None, None

        self.fn = Passthrough
        self.small = [torch.zeros(shape, device=dev, requires_grad=True) for shape in ((1, 1, 4), (1, 4), (4,), (4,))]
        self.cs = [torch.zeros(1, 1, 4, device=dev) for _ in range(2)]
        self.grads = [torch.ones(1, 1, 1, 4, device=dev) for _ in range(3)]
        self.meta = (32, 8, 1e-6, True, "auto", None, None, None, "", False, False)

    def reset(self) -> None:
        for t in self.small:
            t.grad = None

    def step(self) -> None:
        torch.autograd.backward(self.fn.apply(*self.small, *self.cs, None, None, self.meta), self.grads)

    def stamped_step(self) -> None:
        stamp("call")
        stamp("mod_fwd")
        outs = self.fn.apply(*self.small, *self.cs, None, None, self.meta)
        stamp("returned")
        torch.autograd.backward(outs, self.grads)
        stamp("done")

    def install(self) -> None:
        pass

    def uninstall(self) -> None:
        pass


class Planned:
    """host_costs' "planned forward + backward, no autograd": ``run_forward`` of the kept forward plan
    and ``training_backward`` (its lookup included), no autograd, no module."""

    def __init__(self, fused: Fused, position: str):
        self.label = "planned work, no autograd"
        tf, tb, blk = fused.tf, fused.tb, fused.block
        hs, T = fused.hs, fused.hs.shape[1]
        self.cos, self.sin = fused.cos.expand(1, T, 128), fused.sin.expand(1, T, 128)
        w = (blk.qkv_weight, blk.q_norm_weight, blk.k_norm_weight)
        self.plan = tf.forward_plan(hs, w[0], *w[1:], self.cos, self.sin, 32, 8, blk.eps, position, "auto")
        after = position == "after_rope"
        with torch.no_grad():
            qkv = tf.run_forward(self.plan, hs, *w, self.cos, self.sin)[2]

        @torch.no_grad()  # as inside autograd's backward
        def step(stamp=lambda name: None):
            stamp("run_in")
            tf.run_forward(self.plan, hs, *w, self.cos, self.sin)
            stamp("run_out")
            stamp("tb_in")
            tb.training_backward(*fused.grads, hs, w[0], qkv, *w[1:], self.cos, self.sin, 32, 8, blk.eps, after,
                                 True, True, False, "auto")
            stamp("tb_out")

        self.step = step

    def reset(self) -> None:
        pass

    def stamped_step(self) -> None:
        stamp("call")
        self.step(stamp)
        stamp("done")

    def install(self) -> None:
        pass

    def uninstall(self) -> None:
        pass


class TwoMM(Planned):
    """Issue 36's yardstick (CUDA only): two ``torch.mm`` (out=) of the backward's products, dX = dQKV W
    and dW = dQKV^T X."""

    def __init__(self, fused: Fused):
        self.label = "two torch.mm (out=)"
        w = fused.block.qkv_weight.detach()
        x = fused.hs.detach().reshape(-1, w.shape[1])
        dq = torch.randn(x.shape[0], w.shape[0], device=w.device, dtype=w.dtype)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        self.step = lambda stamp=None: (torch.mm(dq, w, out=dx), torch.mm(dq.t(), x, out=dw))


# ------------------------------------------------------------------------------ timing


class Runner:
    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def before_chunk(self, n: int) -> None:
        if self.cuda:  # ~2 ms of GPU sleep a call: the launch queue neither drains nor fills
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9 * 2e-3 * n))

    def after(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def timeline(rows: list, runner: Runner, rounds: int, calls: int) -> dict:
    """Per row, the median of each segment over every stamped call, rows interleaved round by round."""
    samples = {r.label: {name: [] for name, _, _ in SEGMENTS} for r in rows}
    chunk = min(calls, 20)
    for _ in range(rounds):
        for r in rows:
            r.install()
            try:
                for _ in range(calls // chunk):
                    runner.before_chunk(chunk)
                    for _ in range(chunk):
                        STAMPS.clear()
                        r.reset()
                        r.stamped_step()
                        for name, a, b in SEGMENTS:
                            if a in STAMPS and b in STAMPS:
                                samples[r.label][name].append((STAMPS[b] - STAMPS[a]) / 1e3)
                runner.after()
            finally:
                r.uninstall()
    return {label: {name: statistics.median(v) for name, v in seg.items() if v} for label, seg in samples.items()}


def steps(rows: list, runner: Runner, rounds: int, calls: int) -> dict:
    """Per row, the median time of an unstamped step over every call (rows interleaved round by round;
    per call, not per batch: a shared host's preemptions put milliseconds into 1 % of the calls)."""
    got = {r.label: [] for r in rows}
    chunk = min(calls, 20)
    for _ in range(rounds):
        for r in rows:
            step, reset, out = r.step, r.reset, got[r.label]
            for _ in range(calls // chunk):
                runner.before_chunk(chunk)
                for _ in range(chunk):
                    reset()
                    t0 = _now()
                    step()
                    out.append(_now() - t0)
            runner.after()
    return {label: statistics.median(v) / 1e3 for label, v in got.items()}


def _profiled(row, runner: Runner, n: int):
    """A cProfile.Profile of ``n`` steps of ``row`` (on Python >= 3.12 it sees every thread: sys.monitoring,
    the autograd engine's device thread included)."""
    import cProfile

    pr = cProfile.Profile()
    chunk = 20
    for _ in range(n // chunk):
        runner.before_chunk(chunk)
        pr.enable()
        for _ in range(chunk):
            row.reset()
            row.step()
        pr.disable()
    runner.after()
    return pr


def profile(row, runner: Runner, n: int) -> str:
    import io
    import pstats

    s = io.StringIO()
    st = pstats.Stats(_profiled(row, runner, n), stream=s)
    s.write(f"\n==== cProfile: {row.label}, {n} fwd+bwd steps ====\n")
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(40)
    return s.getvalue()


def _own_times(row, runner: Runner, n: int) -> dict:
    """Each function's own time (cProfile's tottime), us per step, and its calls per step, over ``n`` steps."""
    import pstats

    pr = _profiled(row, runner, n)
    out = {}
    for (fname, line, func), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
        _add(out, f"{os.path.basename(fname)}:{line}({func})" if fname != "~" else func, tt * 1e6 / n, nc / n)
    return out


def _add(acc: dict, key: str, t: float, calls: float) -> None:
    t0, c0 = acc.get(key, (0.0, 0.0))
    acc[key] = (t0 + t, c0 + calls)


def profile_diff(a, b, runner: Runner, n: int, top: int = 30) -> str:
    """Own time per step of each function in row ``a`` and row ``b``, profiled alternately (two halves
    each), largest difference first."""
    ta, tb = {}, {}
    for _ in range(2):
        for row, acc in ((a, ta), (b, tb)):
            for k, (t, c) in _own_times(row, runner, n // 2).items():
                _add(acc, k, t / 2, c / 2)
    keys = sorted(set(ta) | set(tb), key=lambda k: -abs(ta.get(k, (0, 0))[0] - tb.get(k, (0, 0))[0]))
    lines = [f"\n==== cProfile own time per step, us (calls per step): '{a.label}' vs '{b.label}', "
             f"{n} steps each ====",
             f"{'function':<70s}{a.label[:24]:>26s}{b.label[:24]:>26s}{'diff':>9s}"]
    for k in keys[:top]:
        (x, cx), (y, cy) = ta.get(k, (0.0, 0.0)), tb.get(k, (0.0, 0.0))
        lines.append(f"{k[:70]:<70s}{x:17.1f} ({cx:5.1f}){y:17.1f} ({cy:5.1f}){x - y:9.1f}")
    lines.append(f"{'total':<70s}{sum(v[0] for v in ta.values()):26.1f}{sum(v[0] for v in tb.values()):26.1f}")
    return "\n".join(lines)


def main() -> int:
    args = ARGS
    dev = torch.device(args.device)
    engine_thread.apply(args.backward_on_caller)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    T = args.tokens or (128 if dev.type == "cpu" else 512)
    hidden = args.hidden or (512 if dev.type == "cpu" else 4096)
    import fusedqkv

    rows = [Fused("fused (this tree)", fusedqkv, dev, T, hidden, args.position)]
    if args.against:
        rows.append(Fused(f"fused ({args.against})", load_other(args.against), dev, T, hidden, args.position))
    refs = [DoNothing("do-nothing Function, saves 7", dev, True), DoNothing("do-nothing Function, saves 0", dev, False),
            Planned(rows[0], args.position)]
    if dev.type == "cuda":
        refs.append(TwoMM(rows[0]))
    everyone = rows + refs
    runner = Runner(dev)
    for r in everyone:  # warm
        for _ in range(20):
            r.reset()
            r.step()
    runner.after()
    tl = timeline(everyone, runner, args.rounds, args.calls)
    whole = steps(everyone, runner, args.rounds, args.calls)
    ref = whole[refs[0].label]
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU, launches and products no-ops"
    print(f"\ntraining block fwd+bwd, host time by phase, us (median of {args.rounds} x {args.calls} stamped "
          f"calls), 32/8 heads of 128, hidden {hidden}, {T} tokens, {args.position} | {where}"
          + (f" | {engine_thread.LABEL}" if args.backward_on_caller else ""))
    cols = [r.label for r in everyone]
    print(f"{'phase':<42s}" + "".join(f"{c[:30]:>32s}" for c in cols))
    for name, _, _ in SEGMENTS:
        print(f"{name:<42s}" + "".join(f"{tl[c][name]:32.1f}" if name in tl[c] else f"{'-':>32s}" for c in cols))
    print(f"\nwhole fwd+bwd steps, no stamps (median of {args.rounds} x {args.calls} calls), us and / "
          f"'{refs[0].label}' of the same rounds")
    for c in cols:
        print(f"  {c:<44s} {whole[c]:8.1f}  {whole[c] / ref:5.2f}x")
    if dev.type == "cuda":  # issue 36's ratio, from the same rounds (medians per call, the zero_grad outside:
        # host_costs.py's training_ratios, means of 50 calls with the zero_grad inside, are the measure)
        mm = whole["two torch.mm (out=)"]
        bound = 12.0 if T <= 512 else 15.0
        for r in rows:
            ratio = whole[r.label] / mm
            print(f"  {r.label}: fwd+bwd / two torch.mm = {ratio:.2f}x (issue 36 bounds host_costs.py's ratio by "
                  f"{bound:.0f}x)")
    if args.cprofile:
        print(profile(rows[0], runner, 2000 if dev.type == "cpu" else 400))
    if args.cprofile_diff:
        print(profile_diff(rows[0], refs[2], runner, 2000 if dev.type == "cpu" else 400))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_glue_training.json"), "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "tokens": T, "hidden": hidden,
                       "position": args.position, "backward_on_caller": args.backward_on_caller,
                       "rounds": args.rounds, "calls": args.calls, "timeline": tl,
                       "steps_us": whole, "reference": refs[0].label}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
