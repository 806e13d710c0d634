"""GPU benchmark of PEFT LoRA on q/k/v inside the fused block (issue 34), forward+backward with
the base weights frozen, on the nine rows of bench_module.py (its three block configurations at
512, 2048 and 8192 tokens). Providers, each from the same weights and adapters:

  peft_eager    PEFT's lora.Linear for q_proj, k_proj and v_proj (its own forward: base GEMM +
                lora_B(lora_A(x)) * scaling) and HF's RMSNorm and RoPE in eager PyTorch
  peft_compile  torch.compile of the same function (inductor, one static compile per size)
  fusedqkv      fusedqkv.integrations.peft.lora_operands over the same PEFT layers: the adapters
                inside the op (gqa_qkv_rope_qk_norm(qkv_lora=...)): one A GEMM, qkv += s U_p B_p^T
                in place before the stage, dX += dU A in place, dA/dB from the op's backward
                (the plan's choice: on the H200 the adapters' U and B as more inner columns of the
                one-launch Hopper forward where it runs, ``config.fused_forward``)
  fused_split   the same with config.fused_forward="off": the base GEMM, qkv += s U_p B_p^T in place
                (cuBLAS), then the forward stage (session 17's path; the A/B of the one above)
  fused_gemm    the same with config.fused_forward="on": the adapters inside the one-launch forward
                at every size (where the plan's rule would not take it too)
  fused_pairs   fusedqkv with config.lora_block="off": one forward and one dU product per adapter
                instead of one over the block-diagonal B (ops/lora.LoRAUpdate.block_pays; the A/B of
                session 22's change)
  fused_block   the same with config.lora_block="on": the products over the block at every size
                (where the rule keeps one per adapter: 8192 tokens)
  fused_residual  (--residual) session 16's path: lora_residual (R = U B_rows^T, B laid out per call,
                through autograd) into gqa_qkv_rope_qk_norm(qkv_residual=R)
  floor         the GEMMs alone through cuBLAS: base forward x W^T, base dX = dQKV W, and the
                LoRA GEMMs (U = x A^T, qkv += U_p B_p^T, dU_p = dQKV_p B_p, dB_p = dQKV_p^T U_p,
                dA = dU^T x, dX += dU A)

Each fwd+bwd call is ``torch.autograd.grad`` of q, k, v (fixed output gradients) with respect to
hidden_states and the six adapter matrices; every provider is captured as a CUDA graph (inputs and
outputs kept alive), the graphs replayed call by call in rotated order with the L2 flushed before
each (bench_families.time_graphs_interleaved). The outputs and gradients of fusedqkv and
peft_compile are checked against peft_eager's (bf16: within the three-way rule against float64 is
bench_module's job; here max |diff| relative to max |ref|, reported).

Done criteria per row (issue 34): fusedqkv <= 0.5x peft_eager, < peft_compile, <= 1.10x floor.

``--qlora nf4`` (or ``fp4``): QLoRA (issue 34 step 3). q/k/v are bitsandbytes 4-bit layers
(double quantisation, compute dtype bf16) quantized from the same weights, under PEFT's
``lora.bnb.Linear4bit``; the providers then are

  peft_eager    PEFT QLoRA as it runs unfused (bitsandbytes' matmul_4bit: dequantize + GEMM per
                projection, forward and backward) and HF's RMSNorm and RoPE
  peft_compile  torch.compile of that (reported as failed where it does not compile or capture)
  fusedqkv      fusedqkv.integrations.qlora: the three dequantized into one workspace, the fused
                path, dequantized again in the backward (qkv_weight_source)
  fused_dense   fusedqkv's LoRA path on the dense weight the 4-bit ones dequantize to (fusedqkv
                minus this: what the two dequantizations cost)
  floor         the dense GEMM floor above (no dequantization)

and a row "pays" where fusedqkv is faster than peft_eager and than peft_compile (where it runs):
the issue's rule is that a fused QLoRA path that does not pay on the H200 raises instead.

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_lora.py --out $OUT/lora
    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_lora.py --qlora nf4 --out $OUT/qlora
    PYTHONPATH=src TRITON_INTERPRET=1 python3 benchmarks/bench_lora.py --smoke --out /tmp/lora   # CPU check

Needs peft (and bitsandbytes for --qlora; carried as wheels on the device). Prints a table last;
writes --out/bench_lora.json (--qlora: bench_qlora.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_families import time_providers  # noqa: E402
from bench_module import CONFIGS, SIZES, rope_cos_sin  # noqa: E402

from fusedqkv import gqa_qkv_rope_qk_norm  # noqa: E402
from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.integrations.peft import lora_operands, lora_residual  # noqa: E402
from fusedqkv.integrations import qlora as fq_qlora  # noqa: E402
from fusedqkv.ops import config  # noqa: E402
from fusedqkv.ops.internals import raise_compile_limits  # noqa: E402

PROVIDERS = ("peft_eager", "peft_compile", "fusedqkv", "fused_split", "fused_gemm", "fused_pairs", "fused_block",
             "floor")
QLORA_PROVIDERS = ("peft_eager", "peft_compile", "fusedqkv", "fused_dense", "floor")
# named with --configs only (not in "all"): the Qwen3-0.6B attention input of bench_hf's 28-layer LoRA/QLoRA rows
EXTRA_CONFIGS = {"qwen3_0.6b_h1024_q16_kv8": dict(hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                                                  qk_norm_position="before_rope")}
SMOKE_CONFIGS = {"smoke": dict(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm_position="before_rope")}
EPS = 1e-6


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_norm(t, w):
    """HF's Qwen3RMSNorm: fp32 statistics, weight times the input-dtype result."""
    t32 = t.float()
    t32 = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + EPS)
    return w * t32.to(t.dtype)


def hf_rope(t, cos, sin):
    h = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., h:], t[..., :h]), -1) * sin


class Row:
    """One configuration at one size: the frozen base weights, PEFT LoRA layers over them and the
    inputs, shared by every provider."""

    def __init__(self, cfg, b, s, rank, device, dtype, seed=0, quant_type=None):
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear as LoraLinear

        torch.manual_seed(seed)
        self.cfg, self.b, self.s = cfg, b, s
        hidden, hq, hkv, d = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.split = (hq * d, hkv * d, hkv * d)
        self.n = sum(self.split)
        self.w = (torch.randn(self.n, hidden, device=device, dtype=dtype) / hidden ** 0.5).requires_grad_(False)
        self.loras = []
        self.bases4 = []  # --qlora: the bitsandbytes layers
        start = 0
        for name, rows in zip(("q_proj", "k_proj", "v_proj"), self.split):
            if quant_type is not None:
                base, lora = self._qlora_layer(self.w[start:start + rows], quant_type, rank, device, dtype)
                self.bases4.append(base)
                self.loras.append((name, lora))
                start += rows
                continue
            base = nn.Linear(hidden, rows, bias=False, device=device, dtype=dtype)
            base.weight = nn.Parameter(self.w[start:start + rows], requires_grad=False)  # a view: one weight
            config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, init_lora_weights=False)
            lora = LoraLinear(base, "default", config, r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                              init_lora_weights=False)
            lora.to(device=device, dtype=dtype)
            self.loras.append((name, lora))
            start += rows
        if self.bases4:  # the dense weight the 4-bit ones dequantize to: fused_dense's and the floor's
            self.source = fq_qlora.DequantizedQKV(self.bases4, dtype, device)
            self.w = self.source().clone()
        self.adapters = [p for _, lo in self.loras for p in (lo.lora_A["default"].weight, lo.lora_B["default"].weight)]
        self.wq = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
        self.wk = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
        self.x = torch.randn(b, s, hidden, device=device, dtype=dtype, requires_grad=True)
        self.cos, self.sin = rope_cos_sin(b, s, d, dtype, device)
        self.gq = torch.randn(b, hq, s, d, device=device, dtype=dtype)
        self.gk = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
        self.gv = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
        self.slots = [(name, None, lo) for name, lo in self.loras]

    @staticmethod
    def _qlora_layer(w, quant_type, rank, device, dtype):
        """A bitsandbytes 4-bit layer quantized from ``w`` (double quantisation, compute dtype
        ``dtype``, as BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True) builds
        it) under PEFT's QLoRA layer."""
        import bitsandbytes as bnb
        from peft import LoraConfig
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

        rows, hidden = w.shape
        base = bnb.nn.Linear4bit(hidden, rows, bias=False, compute_dtype=dtype, quant_type=quant_type,
                                 compress_statistics=True)
        base.weight = bnb.nn.Params4bit(w.detach().cpu(), requires_grad=False, quant_type=quant_type,
                                        compress_statistics=True)
        base = base.to(device)  # quantizes
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, init_lora_weights=False)
        lora = LoraLinear4bit(base, "default", config, r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                              init_lora_weights=False)
        for mod in (lora.lora_A, lora.lora_B):
            mod.to(device=device, dtype=dtype)
        return base, lora

    def peft_qkv(self, x):
        cfg, b, s = self.cfg, self.b, self.s
        hq, hkv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        q, k, v = (lo(x) for _, lo in self.loras)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k = k.view(b, s, hkv, d).transpose(1, 2)
        v = v.view(b, s, hkv, d).transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        if cfg["qk_norm_position"] == "before_rope":
            return hf_rope(hf_norm(q, self.wq), cos, sin), hf_rope(hf_norm(k, self.wk), cos, sin), v
        return hf_norm(hf_rope(q, cos, sin), self.wq), hf_norm(hf_rope(k, cos, sin), self.wk), v

    def fused_qkv(self, x):
        cfg = self.cfg
        residual, lora = lora_operands(x, self.slots, self.split, self.n)
        return gqa_qkv_rope_qk_norm(x, self.w, self.wq, self.wk, self.cos, self.sin, num_heads=cfg["num_heads"],
                                    num_kv_heads=cfg["num_kv_heads"], eps=EPS,
                                    qk_norm_position=cfg["qk_norm_position"], qkv_residual=residual, qkv_lora=lora)

    def fused_residual_qkv(self, x):
        cfg = self.cfg
        residual = lora_residual(x, self.slots, self.split, self.n)
        return gqa_qkv_rope_qk_norm(x, self.w, self.wq, self.wk, self.cos, self.sin, num_heads=cfg["num_heads"],
                                    num_kv_heads=cfg["num_kv_heads"], eps=EPS,
                                    qk_norm_position=cfg["qk_norm_position"], qkv_residual=residual)

    def fused_qlora_qkv(self, x):
        cfg = self.cfg
        residual, lora = lora_operands(x, self.slots, self.split, self.n)
        return gqa_qkv_rope_qk_norm(x, self.source(), self.wq, self.wk, self.cos, self.sin, num_heads=cfg["num_heads"],
                                    num_kv_heads=cfg["num_kv_heads"], eps=EPS,
                                    qk_norm_position=cfg["qk_norm_position"], qkv_residual=residual, qkv_lora=lora,
                                    qkv_weight_source=self.source)

    def fwd_bwd(self, qkv_fn):
        def call():
            q, k, v = qkv_fn(self.x)
            return torch.autograd.grad((q, k, v), [self.x, *self.adapters], (self.gq, self.gk, self.gv))
        return call

    def floor(self):
        """The GEMMs of a LoRA forward+backward with the base frozen, through cuBLAS."""
        x2 = self.x.detach().reshape(-1, self.x.shape[-1])
        m = x2.shape[0]
        a_cat = torch.cat([lo.lora_A["default"].weight.detach() for _, lo in self.loras])
        bs = [lo.lora_B["default"].weight.detach() * lo.scaling["default"] for _, lo in self.loras]
        qkv = torch.empty(m, self.n, device=x2.device, dtype=x2.dtype)
        dqkv = torch.randn(m, self.n, device=x2.device, dtype=x2.dtype)
        dx = torch.empty_like(x2)
        r = a_cat.shape[0] // 3
        cols = [0, self.split[0], self.split[0] + self.split[1], self.n]

        def call():
            torch.mm(x2, self.w.t(), out=qkv)
            u = x2 @ a_cat.t()
            du = []
            for i, bp in enumerate(bs):
                qkv[:, cols[i]:cols[i + 1]].addmm_(u[:, i * r:(i + 1) * r], bp.t())
                du.append(dqkv[:, cols[i]:cols[i + 1]] @ bp)
                dqkv[:, cols[i]:cols[i + 1]].t() @ u[:, i * r:(i + 1) * r]  # dB_p
            du = torch.cat(du, 1)
            du.t() @ x2  # dA
            torch.mm(dqkv, self.w, out=dx)
            dx.addmm_(du, a_cat)
            return qkv, dx
        return call


def under(fn, **changes):
    """``fn`` called under ``config.override(**changes)`` (the plans it finds are that config's)."""
    def call():
        with config.override(**changes):
            return fn()
    return call


def max_rel(got, want) -> float:
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def capturable(fns: dict) -> dict:
    """{name: error}: the providers that fail a graph capture (each tried alone; the rest are timed)."""
    from bench_families import capture_graph

    bad = {}
    for name, fn in fns.items():
        try:
            capture_graph(fn)
        except Exception as e:  # noqa: BLE001 - reported in the table, not timed
            bad[name] = f"{type(e).__name__}: {str(e)[:160]}"
        torch.cuda.synchronize()
    return bad


def run_qlora(args, device, dtype, configs, sizes, backend, flusher, names) -> int:
    rows = []
    for cname in names:
        for tokens in (int(t) for t in args.tokens.split(",")):
            b, s = sizes[tokens]
            row = Row(configs[cname], b, s, args.rank, device, dtype, quant_type=args.qlora)
            fused = row.fwd_bwd(row.fused_qlora_qkv)
            fns = {"peft_eager": row.fwd_bwd(row.peft_qkv), "fusedqkv": fused,
                   "fused_split": under(fused, fused_forward="off"), "fused_gemm": under(fused, fused_forward="on"),
                   "fused_block": under(fused, lora_block="on"), "fused_dense": row.fwd_bwd(row.fused_qkv),
                   "floor": row.floor()}
            failed = {}
            try:
                compiled = torch.compile(row.peft_qkv, backend=backend)
                fns["peft_compile"] = row.fwd_bwd(compiled)
                fns["peft_compile"]()
            except Exception as e:  # noqa: BLE001 - PEFT QLoRA may not compile: reported
                fns.pop("peft_compile", None)
                failed["peft_compile"] = f"compile: {type(e).__name__}: {str(e)[:160]}"
            ref = fns["peft_eager"]()
            check = {p: max_rel(fns[p](), ref) for p in ("peft_compile", "fusedqkv", "fused_dense") if p in fns}
            if device.type == "cuda":
                failed.update(capturable(fns))
            ms = time_providers({p: fn for p, fn in fns.items() if p not in failed}, args.reps, flusher)
            med = {p: statistics.median(v) for p, v in ms.items()}
            ratio = {f"fused_over_{p}": med["fusedqkv"] / med[p] for p in ("peft_eager", "peft_compile", "fused_dense",
                                                                          "floor") if p in med}
            r = dict(config=cname, tokens=tokens, batch=b, seq=s, rank=args.rank, quant_type=args.qlora, ms=med,
                     failed=failed, max_rel_vs_eager=check, **ratio)
            r["pays"] = "fusedqkv" in med and all(med["fusedqkv"] < med[p] for p in ("peft_eager", "peft_compile")
                                                 if p in med)
            rows.append(r)
            log(f"qlora {args.qlora} {cname} {tokens}: " + ", ".join(f"{p} {med[p]:.3f} ms" for p in med)
                + "".join(f"; {p} failed: {e}" for p, e in failed.items()))
            del row, fns, ref
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    with open(os.path.join(args.out, "bench_qlora.json"), "w") as f:
        json.dump(dict(env=env, rows=rows, criteria="pays: fusedqkv < peft_eager and < peft_compile (where it runs)"),
                  f, indent=1)
    fmt = lambda v: f"{v:8.3f}" if v is not None else f"{'failed':>8}"  # noqa: E731
    print(f"QLoRA {args.qlora} r={args.rank}, fwd+bwd, ms (median): fusedqkv (dequant + fused) vs PEFT QLoRA")
    print(f"{'config':<22} {'tokens':>6} {'eager':>8} {'compile':>8} {'fused':>8} {'f_split':>8} {'f_gemm':>8} "
          f"{'f_block':>8} {'f_dense':>8} {'floor':>8} {'f/eager':>7} {'f/comp':>7} {'f/dense':>7} {'err':>8} pays")
    for r in rows:
        m = r["ms"]
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        print(f"{r['config']:<22} {r['tokens']:>6} {fmt(m.get('peft_eager'))} {fmt(m.get('peft_compile'))} "
              f"{fmt(m.get('fusedqkv'))} {fmt(m.get('fused_split'))} {fmt(m.get('fused_gemm'))} "
              f"{fmt(m.get('fused_block'))} {fmt(m.get('fused_dense'))} {fmt(m.get('floor'))} "
              f"{g('fused_over_peft_eager'):7.3f} {g('fused_over_peft_compile'):7.3f} {g('fused_over_fused_dense'):7.3f} "
              f"{r['max_rel_vs_eager'].get('fusedqkv', float('nan')):8.1e} {r['pays']}")
    return 0 if all(r["pays"] for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--configs", default="all")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--smoke", action="store_true", help="CPU run of the script's logic (no timing value)")
    ap.add_argument("--qlora", choices=("nf4", "fp4"), help="QLoRA: q/k/v as bitsandbytes 4-bit layers")
    ap.add_argument("--residual", action="store_true", help="also session 16's residual path (fused_residual)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    raise_compile_limits(64)
    if args.smoke:
        device, dtype, configs, sizes = torch.device("cpu"), torch.float32, SMOKE_CONFIGS, {8: (1, 8), 12: (2, 6)}
        args.tokens, args.reps, backend = "8,12", 2, "aot_eager"
    else:
        device, dtype, configs, sizes, backend = torch.device("cuda"), torch.bfloat16, CONFIGS, SIZES, "inductor"
    flusher = timing.L2Flusher(device) if device.type == "cuda" else None
    names = list(configs) if args.configs == "all" else args.configs.split(",")
    if not args.smoke:
        configs = {**configs, **EXTRA_CONFIGS}
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; expected 'all' or names of {', '.join(configs)}")
    if args.qlora:
        return run_qlora(args, device, dtype, configs, sizes, backend, flusher, names)
    rows = []
    for cname in names:
        for tokens in (int(t) for t in args.tokens.split(",")):
            b, s = sizes[tokens]
            row = Row(configs[cname], b, s, args.rank, device, dtype)
            compiled = torch.compile(row.peft_qkv, backend=backend)
            fused = row.fwd_bwd(row.fused_qkv)
            fns = {"peft_eager": row.fwd_bwd(row.peft_qkv), "peft_compile": row.fwd_bwd(compiled), "fusedqkv": fused,
                   "fused_split": under(fused, fused_forward="off"), "fused_gemm": under(fused, fused_forward="on"),
                   "fused_pairs": under(fused, lora_block="off"), "fused_block": under(fused, lora_block="on"),
                   "floor": row.floor()}
            if args.residual:
                fns["fused_residual"] = row.fwd_bwd(row.fused_residual_qkv)
            ref = fns["peft_eager"]()
            check = {p: max_rel(fns[p](), ref) for p in fns if p not in ("peft_eager", "floor")}
            ms = time_providers(fns, args.reps, flusher)
            med = {p: statistics.median(v) for p, v in ms.items()}
            r = dict(config=cname, tokens=tokens, batch=b, seq=s, rank=args.rank, ms=med, max_rel_vs_eager=check,
                     fused_over_eager=med["fusedqkv"] / med["peft_eager"],
                     fused_over_compile=med["fusedqkv"] / med["peft_compile"],
                     fused_over_floor=med["fusedqkv"] / med["floor"],
                     split_over_floor=med["fused_split"] / med["floor"],
                     gemm_over_floor=med["fused_gemm"] / med["floor"],
                     pairs_over_floor=med["fused_pairs"] / med["floor"], block_over_floor=med["fused_block"] / med["floor"])
            if args.residual:
                r["residual_over_floor"] = med["fused_residual"] / med["floor"]
            r["pass"] = (r["fused_over_eager"] <= 0.5 and r["fused_over_compile"] < 1.0 and r["fused_over_floor"] <= 1.10)
            rows.append(r)
            log(f"{cname} {tokens}: " + ", ".join(f"{p} {med[p]:.3f} ms" for p in med))
            del row, compiled, fns, ref
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    with open(os.path.join(args.out, "bench_lora.json"), "w") as f:
        json.dump(dict(env=env, rows=rows, criteria="fused/eager <= 0.5, fused < compile, fused/floor <= 1.10"), f,
                  indent=1)
    print(f"{'config':<22} {'tokens':>6} {'eager':>8} {'compile':>8} {'fused':>8} {'f_split':>8} {'f_gemm':>8} "
          f"{'floor':>8} {'f/eager':>7} {'f/comp':>7} {'f/floor':>7} {'s/floor':>7} {'g/floor':>7} {'p/floor':>7} "
          f"{'b/floor':>7} {'err':>8} "
          f"{'err_g':>8} pass")
    for r in rows:
        m = r["ms"]
        print(f"{r['config']:<22} {r['tokens']:>6} {m['peft_eager']:8.3f} {m['peft_compile']:8.3f} "
              f"{m['fusedqkv']:8.3f} {m['fused_split']:8.3f} {m['fused_gemm']:8.3f} {m['floor']:8.3f} "
              f"{r['fused_over_eager']:7.3f} {r['fused_over_compile']:7.3f} {r['fused_over_floor']:7.3f} "
              f"{r['split_over_floor']:7.3f} {r['gemm_over_floor']:7.3f} {r['pairs_over_floor']:7.3f} "
              f"{r['block_over_floor']:7.3f} "
              f"{r['max_rel_vs_eager']['fusedqkv']:8.1e} "
              f"{r['max_rel_vs_eager']['fused_gemm']:8.1e} {r['pass']}")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
