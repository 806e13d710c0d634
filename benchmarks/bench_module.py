"""GPU benchmark of the training-ready block: fusedqkv.GQAQKVRoPEQKNorm vs the plain-PyTorch
reference module (eager) vs torch.compile of the reference module.

For each configuration and token count:
  * forward, backward and forward+backward, cold L2 (flushed before every call), median of
    --reps CUDA-event timings, the providers interleaved call by call in a rotated order
    (``timing.time_cuda_events_interleaved``). The forward runs with grad enabled (training:
    it saves what the backward needs); the backward is ``torch.autograd.grad`` of the three
    outputs with respect to hidden_states and the three parameters, after a fresh untimed
    forward;
  * peak memory of one forward+backward above what was allocated before it (inputs,
    parameters), and memory held after the forward (saved tensors + outputs);
  * on the smallest size: accuracy against a float64 reference (max |err| of fusedqkv and of
    the eager bf16 module; the three-way rule err_fused <= 2 err_eager + atol), and
    torch.compile(fullgraph=True) of fusedqkv's module checked against its eager run.

Configurations: the 091 block (hidden 4096, 32 q heads, 8 KV heads, head_dim 128, norm after
RoPE) and a 64-query/8-KV head, hidden 5120 block (Qwen3-32B-like, norm before RoPE).

    PYTHONPATH=src python3 benchmarks/bench_module.py --out /tmp/module

Prints a table last; writes JSON to --out/bench_module.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm
from fusedqkv.bench import timing
from fusedqkv.ops.internals import raise_compile_limits

CONFIGS = {
    "091_h4096_q32_kv8": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm_position="after_rope"),
    "h4096_q32_kv8_before": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                                 qk_norm_position="before_rope"),
    "h5120_q64_kv8": dict(hidden_size=5120, num_heads=64, num_kv_heads=8, head_dim=128, qk_norm_position="before_rope"),
}
SMOKE_CONFIGS = {
    "smoke_after": dict(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm_position="after_rope"),
    "smoke_before": dict(hidden_size=40, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm_position="before_rope"),
}
SIZES = {512: (1, 512), 2048: (1, 2048), 8192: (2, 4096)}  # tokens -> (batch, seq)
PROVIDERS = ("eager", "compile", "fusedqkv")
MODES = ("forward", "backward", "fwd+bwd")


def rope_cos_sin(b, s, d, dtype, device, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=device, dtype=torch.float32)[None, :].expand(b, s)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def accuracy(cfg, fused, eager, x, cos, sin, grads):
    """max |err| against float64 for fusedqkv and the eager bf16 module, outputs and gradients."""
    ref = ReferenceGQAQKVRoPEQKNorm(**cfg, device=x.device, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in eager.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    out64 = ref(x64, cos.double(), sin.double())
    g64 = torch.autograd.grad(out64, [x64, *ref.parameters()], [g.double() for g in grads])
    res = {}
    names = ["q", "k", "v", "grad_x", "grad_qkv_weight", "grad_q_norm_weight", "grad_k_norm_weight"]
    for prov, mod in (("fusedqkv", fused), ("eager", eager)):
        xx = x.detach().requires_grad_()
        out = mod(xx, cos, sin)
        gg = torch.autograd.grad(out, [xx, *mod.parameters()], grads)
        res[prov] = {n: float((a.double() - b).abs().max()) for n, a, b in zip(names, [*out, *gg], [*out64, *g64])}
    scale = {n: float(b.abs().max()) for n, b in zip(names, [*out64, *g64])}
    ok = {n: res["fusedqkv"][n] <= 2 * res["eager"][n] + 1e-3 * scale[n] for n in names}
    return {"max_abs_err": res, "ref_max_abs": scale, "three_way_ok": ok, "all_ok": all(ok.values())}


def time_cpu_interleaved(fns, reps, flusher=None, setup=None):
    """The smoke run's stand-in for ``timing.time_cuda_events_interleaved``: the same call order,
    wall clock (no timing value on the CPU)."""
    out = {name: [] for name in fns}
    for order in timing.rotated_orders(list(fns), reps):
        for name in order:
            a = (setup[name](),) if setup and name in setup else ()
            t0 = time.perf_counter()
            fns[name](*a)
            out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_module_out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", default="all")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run of the script itself on tiny shapes (no timing value)")
    ap.add_argument("--compile-dynamic", action="store_true",
                    help="one dynamic-shape compile per configuration instead of one static compile per size")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    raise_compile_limits(64)  # one static compile per size
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if args.smoke:
        dev = torch.device("cpu")
        CONFIGS.clear()
        CONFIGS.update(SMOKE_CONFIGS)
        SIZES.clear()
        SIZES.update({8: (1, 8), 12: (2, 6)})
        args.tokens = "8,12"
        args.reps = 2

        timer = time_cpu_interleaved
        mem_alloc = mem_peak = lambda: 0  # noqa: E731
        sync = reset_peak = empty_cache = lambda: None  # noqa: E731
        flusher = None
        cbackend = "aot_eager"
    else:
        cbackend = "inductor"
        dev = torch.device("cuda")
        timer = timing.time_cuda_events_interleaved
        mem_alloc, mem_peak = torch.cuda.memory_allocated, torch.cuda.max_memory_allocated
        sync, reset_peak, empty_cache = torch.cuda.synchronize, torch.cuda.reset_peak_memory_stats, torch.cuda.empty_cache
        flusher = timing.L2Flusher(dev)
    cfg_names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    rows, checks = [], {}
    for cname in cfg_names:
        cfg = CONFIGS[cname]
        eager = ReferenceGQAQKVRoPEQKNorm(**cfg, device=dev, dtype=dtype)
        with torch.no_grad():
            eager.q_norm_weight.uniform_(0.5, 1.5)
            eager.k_norm_weight.uniform_(0.5, 1.5)
        fused = GQAQKVRoPEQKNorm(**cfg, device=dev, dtype=dtype)
        fused.load_state_dict(eager.state_dict())
        compiled = {}
        for tokens in tokens_list:
            b, s = SIZES[tokens]
            x = torch.randn(b, s, cfg["hidden_size"], device=dev, dtype=dtype, requires_grad=True)
            cos, sin = rope_cos_sin(b, s, cfg["head_dim"], dtype, dev)
            with torch.no_grad():
                shapes = [o.shape for o in eager(x, cos, sin)]
            grads = [torch.randn(sh, device=dev, dtype=dtype) for sh in shapes]
            if args.compile_dynamic:
                if "dyn" not in compiled:
                    compiled["dyn"] = torch.compile(eager, fullgraph=True, dynamic=True, backend=cbackend)
                comp = compiled["dyn"]
            else:
                comp = torch.compile(eager, fullgraph=True, dynamic=False, backend=cbackend)
            mods = {"eager": eager, "compile": comp, "fusedqkv": fused}
            t0 = time.time()
            comp_out = comp(x, cos, sin)
            torch.autograd.grad(comp_out, [x, *eager.parameters()], grads)
            del comp_out
            sync()
            log(f"{cname} M={tokens}: reference compiled in {time.time() - t0:.1f}s")

            if tokens == min(tokens_list):
                acc = accuracy(cfg, fused, eager, x, cos, sin, grads)
                cf = torch.compile(GQAQKVRoPEQKNorm(**cfg, device=dev, dtype=dtype), fullgraph=True, backend=cbackend)
                cf._orig_mod.load_state_dict(fused.state_dict())
                xx = x.detach().requires_grad_()
                o1 = cf(xx, cos, sin)
                g1 = torch.autograd.grad(o1, [xx, *cf._orig_mod.parameters()], grads)
                xx2 = x.detach().requires_grad_()
                o2 = fused(xx2, cos, sin)
                g2 = torch.autograd.grad(o2, [xx2, *fused.parameters()], grads)
                acc["compiled_fusedqkv_fullgraph_equal"] = all(torch.equal(a, c) for a, c in zip([*o1, *g1], [*o2, *g2]))
                checks[cname] = acc
                log(f"{cname}: three-way ok={acc['all_ok']} compiled fusedqkv == eager fusedqkv: "
                    f"{acc['compiled_fusedqkv_fullgraph_equal']}")

            params = {k: list(m.parameters()) if k != "compile" else list(eager.parameters()) for k, m in mods.items()}
            fns, memory = {}, {}
            for prov in PROVIDERS:
                mod = mods[prov]
                inputs = [x, *params[prov]]

                def fwd(mod=mod, x=x, cos=cos, sin=sin):
                    return mod(x, cos, sin)

                def fwdbwd(mod=mod, inputs=inputs, x=x, cos=cos, sin=sin, grads=grads):
                    out = mod(x, cos, sin)
                    return torch.autograd.grad(out, inputs, grads)

                fns[prov] = (fwd, fwdbwd, inputs)
                # memory: held after the forward (saved + outputs), peak of a forward+backward
                sync()
                base = mem_alloc()
                reset_peak()
                out = fwd()
                sync()
                held = mem_alloc() - base
                del out
                sync()
                reset_peak()
                r = fwdbwd()
                sync()
                peak = mem_peak() - base
                del r
                memory[prov] = (peak, held)

            # timing: the providers interleaved call by call, the order rotated (a GEMM-heavy
            # run lowers the card's clock for tens of ms: a block of one provider's calls would
            # inherit the clock its predecessor left)
            samples = {prov: {} for prov in PROVIDERS}
            bwd = {p: (lambda o, inputs=fns[p][2], grads=grads: torch.autograd.grad(o, inputs, grads)) for p in PROVIDERS}
            for mode, calls, setup in (("forward", {p: fns[p][0] for p in PROVIDERS}, None),
                                       ("backward", bwd, {p: fns[p][0] for p in PROVIDERS}),
                                       ("fwd+bwd", {p: fns[p][1] for p in PROVIDERS}, None)):
                for p, ms in timer(calls, reps=args.reps, flusher=flusher, setup=setup).items():
                    samples[p][mode] = ms
            for prov in PROVIDERS:
                peak, held = memory[prov]
                res = {m: timing.summarize(samples[prov][m]) for m in MODES}
                rows.append({"config": cname, **cfg, "tokens": tokens, "batch": b, "seq": s, "provider": prov,
                             "ms": res, "peak_fwd_bwd_MiB": peak / 2 ** 20, "held_after_fwd_MiB": held / 2 ** 20,
                             "samples_ms": samples[prov]})
            log(f"{cname} M={tokens}: timed")
            del x, cos, sin, grads, mods, comp
            empty_cache()

    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke run)", "torch": torch.__version__, "reps": args.reps,
            "dtype": "bfloat16", "timing": "CUDA events, L2 flushed before every call, median",
            "compile": "dynamic" if args.compile_dynamic else "static per size"}
    with open(os.path.join(args.out, "bench_module.json"), "w") as f:
        json.dump({**meta, "checks": checks, "rows": rows}, f, indent=1)

    def get(c, t, p):
        return next(r for r in rows if r["config"] == c and r["tokens"] == t and r["provider"] == p)

    print(f"\n{meta['device']} | torch {meta['torch']} | bf16 | cold L2 | median of {args.reps} ms | compile: {meta['compile']}")
    for cname in cfg_names:
        acc = checks.get(cname, {})
        print(f"\n{cname} ({CONFIGS[cname]['qk_norm_position']})  three-way vs fp64: "
              f"{'ok' if acc.get('all_ok') else 'FAIL'}  compile(fullgraph) of fusedqkv == eager: "
              f"{acc.get('compiled_fusedqkv_fullgraph_equal')}")
        print(f"{'tokens':>6s} {'mode':<8s} {'eager':>8s} {'compile':>8s} {'fused':>8s} {'vs eager':>8s} {'vs comp':>8s}")
        for tokens in tokens_list:
            for mode in MODES:
                t = {p: get(cname, tokens, p)["ms"][mode]["median"] for p in PROVIDERS}
                print(f"{tokens:6d} {mode:<8s} {t['eager']:8.4f} {t['compile']:8.4f} {t['fusedqkv']:8.4f} "
                      f"{t['eager'] / t['fusedqkv']:7.2f}x {t['compile'] / t['fusedqkv']:7.2f}x")
        print(f"{'tokens':>6s} {'peak MiB fwd+bwd: eager':>24s} {'compile':>8s} {'fused':>8s} | held after fwd: "
              f"{'eager':>7s} {'compile':>8s} {'fused':>7s}")
        for tokens in tokens_list:
            r = {p: get(cname, tokens, p) for p in PROVIDERS}
            print(f"{tokens:6d} {r['eager']['peak_fwd_bwd_MiB']:24.1f} {r['compile']['peak_fwd_bwd_MiB']:8.1f} "
                  f"{r['fusedqkv']['peak_fwd_bwd_MiB']:8.1f} | {'':15s} {r['eager']['held_after_fwd_MiB']:7.1f} "
                  f"{r['compile']['held_after_fwd_MiB']:8.1f} {r['fusedqkv']['held_after_fwd_MiB']:7.1f}")
    fb = [(get(c, t, "compile")["ms"]["fwd+bwd"]["median"] / get(c, t, "fusedqkv")["ms"]["fwd+bwd"]["median"])
          for c in cfg_names for t in tokens_list]
    mem = [get(c, t, "fusedqkv")["peak_fwd_bwd_MiB"] <= get(c, t, "eager")["peak_fwd_bwd_MiB"]
           for c in cfg_names for t in tokens_list]
    geo = math.exp(sum(math.log(v) for v in fb) / len(fb))
    print(f"\nfwd+bwd faster than torch.compile: {sum(v > 1 for v in fb)}/{len(fb)} rows (geomean {geo:.2f}x) | "
          f"peak <= eager: {sum(mem)}/{len(mem)} | accuracy ok: {all(c['all_ok'] for c in checks.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
