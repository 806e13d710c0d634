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
        [--hf-lora LAYERS]

``--cprofile``: also the Python profile of 200 fused steps (tottime and cumulative, fusedqkv's
functions first). ``--hf-lora LAYERS``: the host time of a whole HF step (Qwen3-0.6B shape cut to
LAYERS layers, 1 x --tokens tokens, PEFT LoRA r=16 all-linear, bf16 autocast as the HF Trainer's
``bf16=True``), PEFT alone and PEFT + ``apply_to``, the GPU asleep, and the fused step's profile.

Prints a table last; writes host_timeline.json to --out.
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
from fusedqkv.ops import training_backward, training_forward

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


def hf_lora_host(layers: int, tokens: int, cprofile: bool) -> dict:
    """Host ms per HF training step (forward + backward, no optimizer), PEFT LoRA alone and with
    apply_to, the GPU asleep so that nothing waits on it."""
    import transformers
    from peft import LoraConfig, get_peft_model

    dev = torch.device("cuda")
    out = {}
    for label in ("peft", "peft + fusedqkv"):
        cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=4096)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(dev):
            model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        if "fusedqkv" in label:
            fusedqkv.apply_to(model)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        ids = torch.randint(0, 151936, (1, tokens), device=dev)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            for p in model.parameters():
                p.grad = None

        for _ in range(5):
            step()
        got = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9 * 0.2 * 10))  # ~0.2 s a step asleep: the host never waits
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            got.append((time.perf_counter() - t0) / 10 * 1e3)
            torch.cuda.synchronize()
        out[label] = statistics.median(got)
        if cprofile and "fusedqkv" in label:
            print(profile_text(step, 10, f"HF step, {label}, {layers} layers", chunk=2))
        del model
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_timeline_out")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--hf-lora", type=int, default=0, metavar="LAYERS")
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
    hf = hf_lora_host(args.hf_lora, T, args.cprofile) if args.hf_lora else None
    with open(os.path.join(args.out, "host_timeline.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "tokens": T, "rows": rows, "hf_lora": hf}, f, indent=1)
    if hf:
        print(f"\nHF step host time (ms, GPU asleep, median of 5 x 10 steps), Qwen3-0.6B shape, {args.hf_lora} layers, "
              f"1 x {T} tokens, LoRA r=16 all-linear, bf16 autocast")
        for k, v in hf.items():
            print(f"  {k:<28s} {v:8.2f}")
    cols = list(rows)
    print(f"\nhost timeline of one training step's block, us (median of {args.calls}), T={T} | "
          f"{torch.cuda.get_device_name()}")
    print(f"{'segment':<42s}" + "".join(f"{c[:24]:>26s}" for c in cols))
    for name, _, _ in SEGMENTS:
        print(f"{name:<42s}" + "".join(f"{rows[c].get(name, float('nan')):26.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
