"""Host time of the HF/PEFT integration (issue 36 part 3, issue 34's 0.6B end-to-end target).

A Qwen3 model fine-tuned with PEFT LoRA r=16 "all-linear" (alpha 32, dropout 0, B random), two
stacks built from the same weights:

  peft            PEFT alone (HF's attention, eager)
  peft+fusedqkv   fusedqkv.apply_to(model), then get_peft_model (the README's order)

Measured per stack, interleaved round by round (the host's speed drifts), medians over rounds:

* step: forward (``labels=``, HF's loss) + ``backward()``, gradients set to None before each;
* attention forward per step: the host time spent inside the attention modules' ``forward``
  during a step (``perf_counter`` around it, a wrapper set on each attention module);
* attention forward alone: one attention layer's forward (training mode, graph built, no
  backward) on the inputs it received in a step (the KV cache left out); for the fused stack also
  with its kept decisions dropped before each call (the full checks every call, as before
  session 20), interleaved with the rest;
* (fused stack) the parts of that forward: ``projection_slots``, ``lora_operands``,
  ``slots_fp8_recipe`` (the full checks), and where the tree has it ``projection_plan`` (the
  kept decisions, fingerprint compared) and its per-call LoRA operands.

--device cpu (default): a tiny-compute Qwen3 (hidden 64, 4 heads, 2 KV heads of 16, intermediate
96, vocab 128, --layers 4, 1 x 8 tokens, fp32, one thread) where the kernels cost next to
nothing: what is left is the Python of HF, PEFT and the integration, which is the same on the GPU.
--device cuda: Qwen3-0.6B shapes (hidden 1024, 16 heads, 8 KV heads of 128, intermediate 3072,
vocab 151936, --layers 28, 1 x 512 tokens), bf16 parameters under bf16 autocast (the HF Trainer's
``bf16=True``). Each timed batch of steps sits between two ``torch.cuda.synchronize()`` (no GPU
sleep in front: HF's loss path synchronises, so the host would wait on it): a host-bound step's
wall time is its host time; the attention forward per step is host time either way.

--cprofile: the Python profile of --profile-steps steps of the fused stack, with the callers of
``Module.parameters``/``named_parameters``/``named_modules`` and ``Tensor.to``.

    PYTHONPATH=src python benchmarks/host_hf.py --out /tmp/host_hf [--cprofile]
    PYTHONPATH=src python benchmarks/host_hf.py --device cuda --out $OUT/host_hf
    PYTHONPATH=src python benchmarks/host_hf.py --device cuda --qlora nf4 --cprofile --out $OUT/host_qlora

Prints a table last; writes host_hf.json to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time

import torch

STACKS = ("peft", "peft+fusedqkv")


def model_config(device: str, layers: int) -> dict:
    if device == "cpu":
        return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)
    return dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                rms_norm_eps=1e-6, tie_word_embeddings=True)


def build(stack: str, cfg_kw: dict, device: str, dtype: torch.dtype, rank: int, seed: int, qlora=None):
    import transformers
    from peft import LoraConfig, get_peft_model

    import fusedqkv

    cfg = transformers.Qwen3Config(**cfg_kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg)
    model.to(dtype).train()
    if qlora:  # every decoder linear 4-bit before apply_to, as bench_hf --qlora (a model loaded quantized)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_hf

        bench_hf.quantize_4bit(model, qlora, dtype)
    if stack == "peft+fusedqkv":
        assert fusedqkv.apply_to(model) == cfg_kw["num_hidden_layers"]
    torch.manual_seed(seed + 7)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                             lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # random B: every adapter changes the output (as bench_hf --lora-init random)
                p.copy_(0.01 * torch.randn(p.shape, generator=g).to(p))
    return model


def attention_modules(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]


class AttentionClock:
    """``perf_counter`` around each attention module's ``forward`` (a wrapper in the instance's
    ``__dict__``, set after apply_to, which refuses a replaced forward); ``total`` seconds."""

    def __init__(self, modules: list):
        self.total = 0.0
        for m in modules:
            inner = m.forward  # bound: the class's forward

            def timed(*args, _inner=inner, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self.total += time.perf_counter() - t0

            m.forward = timed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="host_hf_out")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (cpu: 4, cuda: 28)")
    ap.add_argument("--tokens", type=int, default=None, help="sequence length, batch 1 (cpu: 8, cuda: 512)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="steps per timed batch (cpu: 20, cuda: 10)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cprofile", action="store_true", help="also the Python profile of the fused stack's steps")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--qlora", choices=("nf4", "fp4"), default=None,
                    help="QLoRA: every decoder linear bitsandbytes 4-bit (as bench_hf.py --qlora; CUDA only)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    if args.qlora and not cuda:
        ap.error("--qlora needs --device cuda (bitsandbytes' 4-bit layers quantize on their CUDA device)")
    if not cuda:
        torch.set_num_threads(1)  # the host's Python is what is measured; one core, less noise
    layers = args.layers or (28 if cuda else 4)
    tokens = args.tokens or (512 if cuda else 8)
    steps = args.steps or (10 if cuda else 20)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg_kw = model_config(args.device, layers)
    os.makedirs(args.out, exist_ok=True)

    from fusedqkv.integrations import fused_projection, peft as fpeft

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, cfg_kw["vocab_size"], (1, tokens), generator=g).to(args.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    models, clocks, captured = {}, {}, {}
    for stack in STACKS:
        model = build(stack, cfg_kw, args.device, dtype, args.rank, args.seed, args.qlora)
        attns = attention_modules(model)
        assert len(attns) == layers, len(attns)
        # the inputs of one attention layer's call, for the forward alone (without the step's KV
        # cache, which would grow with every call)
        handle = attns[0].register_forward_pre_hook(
            lambda mod, a, kw, stack=stack: captured.setdefault(stack, (a, {
                k: (None if k in ("past_key_values", "past_key_value", "cache") else v) for k, v in kw.items()})),
            with_kwargs=True)
        models[stack] = model
        clocks[stack] = AttentionClock(attns)
        step(model, ids, autocast)  # first calls: lazy inits, caches
        handle.remove()
        sync()

    def timed_steps(stack):
        model, clock = models[stack], clocks[stack]
        clock.total = 0.0
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(model, ids, autocast)
        sync()
        return (time.perf_counter() - t0) / steps, clock.total / steps

    try:  # the kept decisions (session 20); absent from older trees
        from fusedqkv.integrations.projection_plan import _PLANS
    except ImportError:
        _PLANS = None

    def attn_alone(stack, n, drop_plan=False):
        a, kw = captured[stack]
        attn = attention_modules(models[stack])[0]
        with autocast:
            attn(*a, **kw)
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                if drop_plan:  # the full checks every call, as before plans were kept
                    _PLANS.pop(attn, None)
                attn(*a, **kw)
            sync()
        return (time.perf_counter() - t0) / n

    fused_attn = attention_modules(models["peft+fusedqkv"])[0]
    spec = fused_attn._fusedqkv
    hs = captured["peft+fusedqkv"][0][0] if captured["peft+fusedqkv"][0] else captured["peft+fusedqkv"][1]["hidden_states"]

    def parts():
        with autocast:
            slots = fused_projection.projection_slots(fused_attn, spec.projs, spec.quantized)
            n_rows = sum(spec.split)
            fns = {
                "projection_slots": lambda: fused_projection.projection_slots(fused_attn, spec.projs, spec.quantized),
                "lora_operands": lambda: fpeft.lora_operands(hs, slots, spec.split, n_rows, inplace=not spec.k_eq_v),
                "slots_fp8_recipe": lambda: fused_projection.slots_fp8_recipe(fused_attn, slots,
                                                                              spec.block_kwargs.get("fp8")),
            }
            try:  # the kept decisions (session 20); absent from older trees
                from fusedqkv.integrations.projection_plan import projection_plan
            except ImportError:
                projection_plan = None
            if projection_plan is not None:
                plan = projection_plan(fused_attn, spec)
                fns["projection_plan (kept)"] = lambda: projection_plan(fused_attn, spec)
                fns["plan.lora (per call)"] = lambda: plan.lora(hs, inplace=not spec.k_eq_v)
            out = {}
            for name, fn in fns.items():
                fn()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                out[name] = (time.perf_counter() - t0) / 200
            return out

    samples = {s: {"step": [], "attn_in_step": [], "attn_alone": []} for s in STACKS}
    part_samples, dropped, recompute, per_pair = {}, [], [], []
    n_alone = 20 if cuda else 200
    for r in range(args.rounds):
        for stack in STACKS:
            per_step, in_attn = timed_steps(stack)
            samples[stack]["step"].append(per_step)
            samples[stack]["attn_in_step"].append(in_attn)
            samples[stack]["attn_alone"].append(attn_alone(stack, n_alone))
        if args.qlora:  # the same fused model with bitsandbytes dequantizing the absmax every call (A/B)
            from fusedqkv.ops import config as fconfig

            with fconfig.override(qlora_absmax="recompute"):
                recompute.append(timed_steps("peft+fusedqkv"))
        if cuda:  # the same fused model with the LoRA backward's per-pair 16-bit dA/dB products (A/B)
            from fusedqkv.ops import lora as flora

            flora.WIDE_GRAD_PRODUCTS = False
            try:
                per_pair.append(timed_steps("peft+fusedqkv"))
            finally:
                flora.WIDE_GRAD_PRODUCTS = True
        if _PLANS is not None:
            dropped.append(attn_alone("peft+fusedqkv", n_alone, drop_plan=True))
        for name, t in parts().items():
            part_samples.setdefault(name, []).append(t)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{s} step {samples[s]['step'][-1] * 1e3:.2f} ms" for s in STACKS), flush=True)

    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in samples.items()}
    part_med = {k: statistics.median(v) for k, v in part_samples.items()}

    profile = None
    if args.cprofile:
        profile = cprofile_steps(models["peft+fusedqkv"], ids, autocast, args.profile_steps, sync)
        print(profile)

    report = dict(
        device=args.device, device_name=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        torch=torch.__version__, transformers=sys.modules["transformers"].__version__,
        peft=sys.modules["peft"].__version__, python=platform.python_version(),
        config=dict(cfg_kw, tokens=tokens, dtype=str(dtype).replace("torch.", ""), autocast=cuda, rank=args.rank,
                    steps=steps, rounds=args.rounds),
        stacks={s: dict(step_ms=med[s]["step"] * 1e3, attn_in_step_ms=med[s]["attn_in_step"] * 1e3,
                        attn_forward_per_layer_us=med[s]["attn_in_step"] / layers * 1e6,
                        attn_forward_alone_us=med[s]["attn_alone"] * 1e6,
                        samples_step_ms=[t * 1e3 for t in samples[s]["step"]]) for s in STACKS},
        fused_parts_us={k: v * 1e6 for k, v in part_med.items()},
        fused_attn_forward_alone_full_checks_us=statistics.median(dropped) * 1e6 if dropped else None,
        cprofile=profile,
        qlora=args.qlora,
        fused_absmax_recompute=dict(step_ms=statistics.median(t for t, _ in recompute) * 1e3,
                                    attn_in_step_ms=statistics.median(a for _, a in recompute) * 1e3)
        if recompute else None,
        fused_per_pair_products=dict(step_ms=statistics.median(t for t, _ in per_pair) * 1e3,
                                     samples_step_ms=[t * 1e3 for t, _ in per_pair]) if per_pair else None,
    )
    with open(os.path.join(args.out, "host_hf.json"), "w") as f:
        json.dump(report, f, indent=1)

    print(f"\nhost time, {args.device} ({report['device_name']}), Qwen3 {layers} layers, hidden "
          f"{cfg_kw['hidden_size']}, 1 x {tokens} tokens, {report['config']['dtype']}"
          f"{' autocast bf16' if cuda else ''}, {'Q' if args.qlora else ''}LoRA r={args.rank} all-linear"
          f"{' ' + args.qlora if args.qlora else ''}; medians of {args.rounds} rounds")
    print(f"{'':34s}" + "".join(f"{s:>16s}" for s in STACKS) + f"{'fused/peft':>12s}")
    rows = [("step (fwd+bwd), ms", "step_ms", 1), ("attention fwd in a step, ms", "attn_in_step_ms", 1),
            ("  per attention layer, us", "attn_forward_per_layer_us", 1),
            ("attention fwd alone, us", "attn_forward_alone_us", 1)]
    for label, key, _ in rows:
        vals = [report["stacks"][s][key] for s in STACKS]
        print(f"{label:34s}" + "".join(f"{v:16.1f}" if v >= 100 else f"{v:16.2f}" for v in vals)
              + f"{vals[1] / vals[0]:12.2f}x")
    if recompute:
        r = report["fused_absmax_recompute"]
        print(f"{'step, absmax recompute, ms':34s}{'':16s}{r['step_ms']:16.2f}")
        print(f"{'attn fwd in a step, recompute, ms':34s}{'':16s}{r['attn_in_step_ms']:16.2f}")
    if per_pair:
        r = report["fused_per_pair_products"]
        print(f"{'step, per-pair dA/dB products, ms':34s}{'':16s}{r['step_ms']:16.2f}")
    if dropped:
        print(f"{'  the same, full checks each call':34s}{'':16s}{report['fused_attn_forward_alone_full_checks_us']:16.1f}")
    for name, us in report["fused_parts_us"].items():
        print(f"  fused: {name + ', us':26s}{'':16s}{us:16.1f}")
    return 0


def step(model, ids, autocast):
    # what zero_grad(set_to_none=True) does, over a list kept on the model (no parameters() walk
    # here, so that the profile's parameters() calls are all the model's own)
    params = model.__dict__.get("_host_hf_params")
    if params is None:
        params = model.__dict__["_host_hf_params"] = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def cprofile_steps(model, ids, autocast, n: int, sync) -> str:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    sync()
    pr.enable()
    for _ in range(n):
        step(model, ids, autocast)
    sync()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    s.write(f"--- cProfile, {n} steps of peft+fusedqkv \n")
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(r"fusedqkv|bitsandbytes|peft", 45)
    # (cProfile counts each resumption of a generator as a call: a loop over model.parameters()
    # shows one "call" per parameter)
    walks = {name: sum(v[1] for k, v in st.stats.items() if k[2] == name)
             for name in ("parameters", "named_parameters", "named_modules", "_named_members")}
    s.write(f"module walks in {n} steps (generator resumptions): {walks}\n")
    st.print_callers(r"\((parameters|named_parameters|named_modules|_named_members)\)")
    st.print_callers(r"method 'to' of 'torch._C.TensorBase'")
    return s.getvalue()


if __name__ == "__main__":
    sys.exit(main())
