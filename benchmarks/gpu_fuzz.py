"""Random-shape fuzz of fusedqkv's two entry points, for every device session (issue 15).

Each case draws batch, seq (1 to a few thousand, odd values included, decode-like batches of
one-token sequences), a head configuration (MHA, GQA, MQA, odd counts), head_dim 64/128/256/512
(512: Gemma 4's global layers), hidden size (odd ones too), fp32/bf16/fp16, and strided or
transposed inputs, then checks one of the two entry points:

* ``091``: ``fusedqkv.gqa_qkv_rope_qk_norm_backward`` against the official reference of
  SOL-ExecBench 091 (``definition.json``'s ``reference``, from ``--problem-dir`` or
  ``$FUSEDQKV_SOL_EXECBENCH``) with the official tolerance check. The reference hard-codes
  32/8 heads and head_dim 128 in four constants, used only to size the projection; with those
  constants set to the case's (and its final casts to bfloat16 made casts to the activation
  dtype) it is the same code for any head configuration and dtype, so every case runs the
  official code rather than a re-implementation. The tolerance is that of the official
  workload nearest in token count (atol 0.008-0.073, rtol 0.05, 99% of elements).
* ``train``: ``fusedqkv.gqa_qkv_rope_qk_norm`` forward and autograd backward (either norm
  position; cos/sin trainable or frozen; frozen weight or input; the block's variants of issue
  25 drawn independently: a gated q, partial rotary at half or a quarter of head_dim,
  interleaved RoPE, unweighted norms, the norm over all heads (to head_dim 256, as the block), an
  unweighted v norm, v the raw k projection: Gemma 4's ``k_eq_v``) against
  float64 autograd through a plain-PyTorch reference (``fusedqkv.module.reference_block``), by
  the three-way rule: for every output and gradient,
  max|ours - f64| <= 2 * max|eager - f64| + atol, eager being the same reference in the
  case's dtype, atol = 1e-3 (16-bit) or 1e-4 (fp32) of max|f64|.

Cases are drawn from (--seed, case index) alone, so ``--seed S --case I`` (with the same size
caps) replays one; a failing case is printed whole with that command line and as JSON
(``--case-json`` replays the JSON). Exits 1 on any crash or mismatch (after a CUDA error the
remaining cases are skipped: the context is lost). Writes ``fuzz.json`` under --out.

GPU (the device session)::

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=shared/sol-execbench python3 benchmarks/gpu_fuzz.py --cases 200 --out $OUT/fuzz

and the one-launch Hopper forward at every size (``auto`` takes it only for large token counts; the FP8
cases with bf16 activations take its FP8 build; the run counts the cases per forward path)::

    PYTHONPATH=src python3 benchmarks/gpu_fuzz.py --api train --variant plain --head-dims 128 \
        --fused-forward on --cases 120 --out $OUT/fuzz_fused

head_dim 512 alone (Gemma 4's global layers: both entry points, its variants among the draws)::

    PYTHONPATH=src FUSEDQKV_SOL_EXECBENCH=shared/sol-execbench python3 benchmarks/gpu_fuzz.py --head-dims 512 \
        --cases 40 --max-tokens 4096 --out $OUT/fuzz512

CPU (Triton's interpreter, small sizes; what tests/test_gpu_fuzz.py runs)::

    PYTHONPATH=src python3 benchmarks/gpu_fuzz.py --device cpu --backend triton --cases 6 \\
        --max-tokens 6 --max-hidden 48 --max-heads 4 --head-dims 16,64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import sys
import time
import traceback
from pathlib import Path

HEAD_CONFIGS = [(1, 1), (2, 1), (4, 4), (7, 1), (6, 3), (8, 1), (8, 8), (16, 4), (32, 8), (40, 8), (12, 12)]
HIDDEN_SIZES = [64, 96, 128, 256, 512, 1000, 1024, 2048, 4088, 4096, 33, 100]
LAYOUTS = ["contiguous", "transposed", "padded", "step2"]
DTYPE_NAMES = ["bf16", "bf16", "fp16", "fp32"]


# ----------------------------------------------------------------------------------- cases


def draw_case(seed: int, index: int, caps: dict, api=None, plain=False) -> dict:
    """Case ``index`` of seed ``seed`` under the size caps (deterministic); ``api`` forces the entry
    point (the sizes stay those of the case); ``plain`` the block's plain variant (per-head weighted
    or unweighted norms, NeoX RoPE over the whole head: what the one-launch forward covers)."""
    from fusedqkv.ops.validation import ALL_HEADS_MAX_HEAD_DIM

    rng = random.Random(f"fusedqkv-fuzz:{seed}:{index}")
    max_tokens = caps["max_tokens"]
    r = rng.random()
    if r < 0.1:  # decode-like: many one-token sequences
        seq, batch = 1, rng.randint(1, max(1, min(max_tokens, 2048)))
    elif r < 0.4:  # a handful of tokens
        seq, batch = rng.randint(1, 8), rng.randint(1, 3)
    elif r < 0.75:
        seq, batch = rng.randint(9, 700), rng.randint(1, 4)
    else:
        seq, batch = rng.randint(701, 4096), rng.randint(1, 2)
    if seq > 1 and rng.random() < 0.5:
        seq |= 1  # odd
    seq = max(1, min(seq, max_tokens))
    batch = max(1, min(batch, max_tokens // seq))
    heads = [h for h in HEAD_CONFIGS if h[0] <= caps["max_heads"]] or [(1, 1)]
    hq, hkv = rng.choice(heads)
    d = rng.choice(caps["head_dims"])
    hidden = rng.choice([h for h in HIDDEN_SIZES if h <= caps["max_hidden"]] or [caps["max_hidden"]])
    case = dict(seed=seed, index=index, api=rng.choice(["091", "train"]), batch=batch, seq=seq, num_heads=hq,
                num_kv_heads=hkv, head_dim=d, hidden=hidden, dtype=rng.choice(DTYPE_NAMES),
                layout=rng.choice(LAYOUTS), eps=rng.choice([1e-6, 1e-5]), data_seed=rng.randrange(2 ** 31))
    # both entry points' options are drawn (the same draws whichever is used: --api keeps the sizes)
    opt_091 = dict(cos_broadcast=rng.random() < 0.2, rstd_3d=rng.random() < 0.2,
                   norm_fp32=case["dtype"] != "fp32" and rng.random() < 0.2,
                   rstd_fp32=rng.random() < 0.2, out=rng.random() < 0.15)
    opt_train = dict(position=rng.choice(["after_rope", "before_rope"]), cos_grad=rng.random() < 0.5,
                     cos_broadcast=rng.random() < 0.25, frozen=rng.choice(["none", "none", "weight", "input"]),
                     norm_fp32=case["dtype"] != "fp32" and rng.random() < 0.15)
    # the block's variants (drawn after the options above: earlier seeds keep their cases' other draws)
    opt_train.update(q_gate=rng.random() < 0.2, rope_style="interleaved" if rng.random() < 0.2 else "neox",
                     rot_div=rng.choice([1, 1, 1, 2, 4]), norm_weight=rng.random() >= 0.15,
                     norm_scope="all_heads" if rng.random() < 0.15 else "head", v_norm=rng.random() < 0.2)
    opt_train.update(k_eq_v=rng.random() < 0.2)  # (drawn last: the earlier draws of a seed stay)
    fp8_draw = rng.choice([None, None, None, "rowwise", "tensorwise", "rowwise_with_gw_hp"])  # (drawn last, as above)
    if plain:
        opt_train.update(q_gate=False, rope_style="neox", rot_div=1, norm_scope="head", v_norm=False, k_eq_v=False)
    if d > ALL_HEADS_MAX_HEAD_DIM:  # (after the draws: the other cases of a seed stay as they were)
        opt_train["norm_scope"] = "head"
    # the FP8 projection (issue 35) where its GEMMs take the sizes: hidden and qkv rows multiples of 16
    rows = ((2 if opt_train["q_gate"] else 1) * hq + (1 if opt_train["k_eq_v"] else 2) * hkv) * d
    # (caps["fp8_recipes"]: the recipes the device runs; torch 2.11's CPU torch._scaled_mm takes no row scales)
    opt_train["fp8"] = fp8_draw if (caps.get("fp8", True) and hidden % 16 == 0 and rows % 16 == 0
                                    and fp8_draw in caps.get("fp8_recipes", (fp8_draw,))) else None
    case["api"] = api or case["api"]
    case.update(opt_091 if case["api"] == "091" else opt_train)
    return case


def case_line(case: dict) -> str:
    keys = ["api", "batch", "seq", "num_heads", "num_kv_heads", "head_dim", "hidden", "dtype", "layout"]
    extra = [k for k in ("position", "cos_grad", "cos_broadcast", "frozen", "rstd_3d", "norm_fp32", "rstd_fp32", "out",
                         "q_gate", "v_norm", "k_eq_v", "fp8") if case.get(k) not in (None, False, "none")]
    extra += [k for k, plain in (("rope_style", "neox"), ("norm_scope", "head"), ("rot_div", 1), ("norm_weight", True))
              if case.get(k, plain) != plain]
    return " ".join(f"{k}={case[k]}" for k in keys) + "".join(
        f" {k}" if case[k] is True else f" {k}={case[k]}" for k in extra)


# ------------------------------------------------------------------------------ inputs


def _dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class Maker:
    """Random tensors of one case in a chosen memory layout (values independent of the layout)."""

    def __init__(self, case, device):
        import torch

        self.torch = torch
        self.device = device
        self.layout = case["layout"]
        self.gen = torch.Generator(device=device).manual_seed(case["data_seed"])

    def place(self, t, layout=None):
        """``t``'s values in a chosen layout: contiguous; transposed (4-D stored [B, S, H, D], 3-D
        stored [S, B, X], 2-D stored transposed); padded (the last dim a slice of a wider row); step2
        (every other element of the last dim)."""
        torch = self.torch
        layout = layout or self.layout
        n = t.shape[-1] if t.dim() else 1
        if layout == "transposed" and t.dim() in (2, 3, 4):
            perm = {4: (0, 2, 1, 3), 3: (1, 0, 2), 2: (1, 0)}[t.dim()]  # each its own inverse
            return t.permute(*perm).contiguous().permute(*perm)
        if layout == "padded" and t.dim():
            buf = torch.zeros(*t.shape[:-1], n + 8, dtype=t.dtype, device=t.device)
            buf[..., :n] = t
            return buf[..., :n]
        if layout == "step2" and t.dim():
            buf = torch.zeros(*t.shape[:-1], 2 * n, dtype=t.dtype, device=t.device)
            buf[..., ::2] = t
            return buf[..., ::2]
        return t.contiguous()

    def randn(self, shape, dtype, scale=1.0, shift=0.0, layout=None):
        t = self.torch.randn(tuple(shape), generator=self.gen, device=self.device) * scale + shift
        return self.place(t.to(dtype), layout)


def _cos_sin(mk: Maker, b, s, d, dtype, broadcast, interleaved=False):
    """HF rotary cos/sin of width d, random positions: NeoX rotate-half (both halves equal), or
    interleaved (each frequency twice in a row, as Llama 4's freqs_cis repeated per element)."""
    torch = mk.torch
    rows = 1 if broadcast else b
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=mk.device) / d))
    pos = torch.randint(0, 8192, (rows, s), generator=mk.gen, device=mk.device).double()
    ang = pos[..., None] * inv
    emb = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat([ang] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# --------------------------------------------------------------------------- 091 entry point


def _pack_dir(problem_dir):
    from fusedqkv.bench import problem

    if problem_dir:
        return problem.pack_in(problem_dir)
    return problem.official_pack_dir()


_REFS: dict = {}


def official_reference(pack: Path, num_heads, num_kv_heads, head_dim):
    """The official ``run`` with its head constants set to the case's and its final casts to
    bfloat16 made casts to the activation dtype (else the code as published)."""
    key = (num_heads, num_kv_heads, head_dim)
    if key in _REFS:
        return _REFS[key]
    src = json.loads((pack / "definition.json").read_text())["reference"]
    subs = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "num_kv_groups": num_heads // num_kv_heads}
    for name, value in subs.items():
        src, n = re.subn(rf"^(\s+){name} = \d+\s*$", rf"\g<1>{name} = {value}", src, flags=re.M)
        if n != 1:
            raise RuntimeError(f"official reference: constant {name} not found exactly once")
    src, n = re.subn(r"\.to\(torch\.bfloat16\)", ".to(grad_query.dtype)", src)
    if n != 6:
        raise RuntimeError(f"official reference: expected 6 final casts to bfloat16, found {n}")
    ns: dict = {"__name__": "sol_execbench_091_reference_fuzz"}
    exec(compile(src, str(pack / "definition.json"), "exec"), ns)  # noqa: S102 - the oracle
    _REFS[key] = ns["run"]
    return ns["run"]


_DEFN: list = []


def _tolerance(tokens: int):
    from fusedqkv.bench import problem

    if not _DEFN:
        _DEFN.append(problem.load_definition())
    defn = _DEFN[0]
    w = min(defn.workloads, key=lambda w: (abs(math.log(max(tokens, 1)) - math.log(w.tokens)), w.index))
    return w.atol, w.rtol, w.name


def check_091(case, device, backend, pack) -> dict:
    import torch

    import fusedqkv
    from fusedqkv.bench import problem

    b, s, hq, hkv, d, h = (case[k] for k in ("batch", "seq", "num_heads", "num_kv_heads", "head_dim", "hidden"))
    dt = _dtype(case["dtype"])
    mk = Maker(case, device)
    ndt = torch.float32 if case["norm_fp32"] else dt
    rdt = torch.float32 if case["rstd_fp32"] else dt
    nqkv = (hq + 2 * hkv) * d
    gq = mk.randn((b, hq, s, d), dt)
    gk = mk.randn((b, hkv, s, d), dt)
    gv = mk.randn((b, hkv, s, d), dt)
    x = mk.randn((b, s, h), dt)
    ang = mk.randn((1 if case["cos_broadcast"] else b, s, d), torch.float32, layout="contiguous").clamp(-3, 3)
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    if case["cos_broadcast"]:  # [B, S, D] with a zero batch stride
        cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
    else:
        cos, sin = mk.place(cos), mk.place(sin)
    w = mk.randn((nqkv, h), dt, scale=1 / math.sqrt(h))
    wq = mk.randn((d,), ndt, scale=0.1, shift=1.0)
    wk = mk.randn((d,), ndt, scale=0.1, shift=1.0)
    xq = mk.randn((b, hq, s, d), dt)
    xk = mk.randn((b, hkv, s, d), dt)
    rq4 = (mk.randn((b, hq, s, 1), torch.float32, layout="contiguous").abs() + 0.1).to(rdt)
    rk4 = (mk.randn((b, hkv, s, 1), torch.float32, layout="contiguous").abs() + 0.1).to(rdt)
    rq, rk = (rq4[..., 0], rk4[..., 0]) if case["rstd_3d"] else (rq4, rk4)
    eps = case["eps"]
    args = [gq, gk, gv, x, cos, sin, w, wq, wk, xq, xk, rq, rk, eps]
    out = None
    if case["out"]:
        out = tuple(torch.full(shape, float("nan"), dtype=t, device=device)
                    for shape, t in [((b, s, h), dt), ((b, s, d), dt), ((b, s, d), dt), ((nqkv, h), dt),
                                     ((d,), ndt), ((d,), ndt)])
    got = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, out=out, backend=backend)
    if out is not None and not all(g is o for g, o in zip(got, out)):
        raise AssertionError("out=: the returned tensors are not the destinations")
    ref_fn = official_reference(pack, hq, hkv, d)
    ref = ref_fn(gq, gk, gv, x, cos, sin, w, wq, wk, xq, xk, rq4, rk4, eps)
    _sync(device)
    atol, rtol, wname = _tolerance(b * s)
    detail, ok = {}, True
    for name, g, r in zip(_OUTPUTS_091, got, ref):
        want_dt = ndt if "norm_weight" in name else dt
        c = problem.check_output(name, g, r, atol, rtol)
        good = c.passed and g.dtype == want_dt and tuple(g.shape) == tuple(r.shape)
        detail[name] = dict(passed=good, matched=round(c.matched_ratio, 5), max_abs=c.max_abs_err,
                            dtype=str(g.dtype).replace("torch.", ""), reason=c.reason)
        ok &= good
    return dict(ok=ok, tolerance=dict(atol=atol, rtol=rtol, workload=wname), outputs=detail)


_OUTPUTS_091 = ("grad_hidden_states", "grad_cos", "grad_sin", "grad_qkv_weight", "grad_q_norm_weight",
                "grad_k_norm_weight")


# ---------------------------------------------------------------------------- training API


def _reference_block(x, w, wq, wk, cos, sin, hq, hkv, eps, position, **variant):
    """The block in plain PyTorch (HF style): fusedqkv.module's reference, functionally."""
    from fusedqkv.module import reference_block

    return reference_block(x, w, wq, wk, cos, sin, hq, hkv, eps, position == "after_rope", **variant)


def _fp8_reference_projection(recipe_name):
    """``x W^T`` with the recipe's FP8 GEMMs, the operands cast by torch ops in torchao's steps
    (``ops.fp8.cast_torch``: not the Triton casts under test) and multiplied by ``torch._scaled_mm``
    as the block issues it: an autograd function (dX, dW by the recipe)."""
    import torch

    from fusedqkv.ops import fp8

    r = fp8.RECIPES[recipe_name]
    pow2 = r.round_scales_to_power_of_2

    def rows(t, cast):  # the data row-major whatever t's layout (as torchao's mm lays its operands out)
        data, inv = fp8.cast_torch(t, cast, -1, pow2)
        return data.contiguous(), inv

    def cols_t(t, cast, pad):
        data, inv = fp8.cast_torch(t, cast, 0, pow2)
        data = data.t().contiguous()
        if pad and data.shape[1] % 16:
            data = torch.nn.functional.pad(data.view(torch.uint8), (0, -data.shape[1] % 16)).view(data.dtype)
        return data, inv

    def col(inv):
        return inv if inv.dim() == 0 else inv.reshape(1, -1)

    class Fp8Projection(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x2, w):
            ctx.save_for_backward(x2, w)
            xa, xs = rows(x2, r.input)
            wa, ws = rows(w, r.weight)
            return fp8._mm(xa, xs, wa.t(), col(ws), x2.dtype, r.fast_accum[0], pow2)

        @staticmethod
        def backward(ctx, g):
            x2, w = ctx.saved_tensors
            g = g.contiguous()
            ga, gs = rows(g, r.grad_output)
            wt, ws = cols_t(w, r.weight_for_grad_input, False)
            dx = fp8._mm(ga, gs, wt.t(), ws, g.dtype, r.fast_accum[1], pow2)
            if r.grad_output_for_grad_weight.dtype is None:
                dw = (g.t().float() @ x2.float()).to(g.dtype)
            else:
                gt, gts = cols_t(g, r.grad_output_for_grad_weight, x2.is_cuda)
                xt, xts = cols_t(x2, r.input_for_grad_weight, x2.is_cuda)
                dw = fp8._mm(gt, gts if gts.dim() == 0 else gts.reshape(-1, 1), xt.t(), xts, g.dtype,
                             r.fast_accum[2], pow2)
            return dx, dw

    return Fp8Projection.apply


def _rotary_width(d: int, rot_div: int) -> int:
    """Partial rotary: head_dim / rot_div rounded down to an even size (at least 2)."""
    rot = d // rot_div
    return max(2, rot - rot % 2)


def check_train(case, device, backend, fused_forward="auto") -> dict:
    import torch

    import fusedqkv
    from fusedqkv.ops import config

    b, s, hq, hkv, d, h = (case[k] for k in ("batch", "seq", "num_heads", "num_kv_heads", "head_dim", "hidden"))
    dt = _dtype(case["dtype"])
    ndt = torch.float32 if case["norm_fp32"] else dt
    variant = dict(q_gate=case.get("q_gate", False), rope_style=case.get("rope_style", "neox"),
                   norm_scope=case.get("norm_scope", "head"), v_norm=case.get("v_norm", False),
                   k_eq_v=case.get("k_eq_v", False))
    weighted = case.get("norm_weight", True)
    rot = _rotary_width(d, case.get("rot_div", 1))
    all_heads = variant["norm_scope"] == "all_heads"
    mk = Maker(case, device)
    nqkv = ((2 * hq if variant["q_gate"] else hq) + (1 if variant["k_eq_v"] else 2) * hkv) * d
    x = mk.randn((b, s, h), dt)
    w = mk.randn((nqkv, h), dt, scale=1 / math.sqrt(h))
    wq = mk.randn((hq * d if all_heads else d,), ndt, scale=0.25, shift=1.0, layout="contiguous")
    wk = mk.randn((hkv * d if all_heads else d,), ndt, scale=0.25, shift=1.0, layout="contiguous")
    cos, sin = _cos_sin(mk, b, s, rot, dt, case["cos_broadcast"], variant["rope_style"] == "interleaved")
    if not case["cos_broadcast"]:
        cos, sin = mk.place(cos), mk.place(sin)
    shapes = [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)] + ([(b, s, hq, d)] if variant["q_gate"] else [])
    grads = [mk.randn(shape, dt) for shape in shapes]
    need = dict(x=case["frozen"] != "input", w=case["frozen"] != "weight", cs=case["cos_grad"], nw=weighted)

    def leaves(t_dtype=None):
        conv = (lambda t: t.detach().to(t_dtype)) if t_dtype is not None else (lambda t: t.detach())
        lx = conv(x).requires_grad_(need["x"])
        lw = conv(w).requires_grad_(need["w"])
        lq, lk = (conv(wq).requires_grad_(), conv(wk).requires_grad_()) if weighted else (None, None)
        lc, ls = conv(cos).requires_grad_(need["cs"]), conv(sin).requires_grad_(need["cs"])
        wrt = [t for t, n in ((lx, need["x"]), (lw, need["w"]), (lq, need["nw"]), (lk, need["nw"]),
                              (lc, need["cs"]), (ls, need["cs"])) if n]
        return (lx, lw, lq, lk, lc, ls), wrt

    names = (["q", "k", "v"] + (["gate"] if variant["q_gate"] else []) + (["grad_x"] if need["x"] else [])
             + (["grad_qkv_weight"] if need["w"] else [])
             + (["grad_q_norm_weight", "grad_k_norm_weight"] if weighted else [])
             + (["grad_cos", "grad_sin"] if need["cs"] else []))

    recipe = case.get("fp8")
    project = _fp8_reference_projection(recipe) if recipe else None

    def run(impl, t_dtype=None):
        (lx, lw, lq, lk, lc, ls), wrt = leaves(t_dtype)
        if impl == "ours":
            outs = fusedqkv.gqa_qkv_rope_qk_norm(lx, lw, lq, lk, lc, ls, num_heads=hq, num_kv_heads=hkv,
                                                 eps=case["eps"], qk_norm_position=case["position"], backend=backend,
                                                 fp8=recipe, **variant)
        elif recipe:  # the reference FP8 projection (in the activations' dtype), then the reference stage
            # in t_dtype through an identity projection (exact: one product per output)
            qkv = project(lx.reshape(b * s, h).to(dt), lw.to(dt)).view(b, s, nqkv)
            eye = torch.eye(nqkv, device=qkv.device, dtype=t_dtype or dt)
            outs = _reference_block(qkv.to(t_dtype or dt), eye, lq, lk, lc, ls, hq, hkv, case["eps"],
                                    case["position"], **variant)
        else:
            outs = _reference_block(lx, lw, lq, lk, lc, ls, hq, hkv, case["eps"], case["position"], **variant)
        go = [g.to(o.dtype) if g.dtype != o.dtype else g for g, o in zip(grads, outs)]
        gr = torch.autograd.grad(outs, wrt, go)
        return [o.detach() for o in outs] + list(gr)

    from fusedqkv.ops.training_forward import ForwardPlan

    took, one_launch = [], ForwardPlan._run_fused  # which forward ran: the one-launch kernel's calls, seen

    def seen(plan, *a, **k):
        took.append("one-launch fp8" if plan.fp8 is not None else "one-launch")
        return one_launch(plan, *a, **k)

    ForwardPlan._run_fused = seen
    try:
        # "on": the one-launch forward wherever it can run, its FP8 build for every recipe too
        with config.override(fused_forward=fused_forward,
                             **({"fused_forward_fp8": "on"} if fused_forward == "on" else {})):
            ours = run("ours")
    finally:
        ForwardPlan._run_fused = one_launch
    _sync(device)
    eager = run("eager")
    ref = run("eager", torch.float64)
    atol_rel = 1e-4 if dt == torch.float32 else 1e-3
    detail, ok = {}, True
    if len(ours) != len(names):
        return dict(ok=False, outputs={"outputs": dict(passed=False, reason=f"{len(ours)} outputs and gradients, "
                                                                           f"expected {len(names)}")})
    for n, a, e, r in zip(names, ours, eager, ref):
        if a.shape != r.shape or not bool(torch.isfinite(a).all()):
            detail[n] = dict(passed=False, reason=f"shape {tuple(a.shape)} vs {tuple(r.shape)} or non-finite")
            ok = False
            continue
        e_ours = float((a.double() - r).abs().max()) if r.numel() else 0.0
        e_eager = float((e.double() - r).abs().max()) if r.numel() else 0.0
        atol = atol_rel * (float(r.abs().max()) if r.numel() else 0.0)
        good = e_ours <= 2 * e_eager + atol
        dt_ok = a.dtype == (ndt if "norm_weight" in n else dt)
        detail[n] = dict(passed=good and dt_ok, err=e_ours, eager_err=e_eager, atol=atol,
                         dtype=str(a.dtype).replace("torch.", ""))
        ok &= good and dt_ok
    return dict(ok=ok, outputs=detail, forward=took[0] if took else "split")


# ------------------------------------------------------------------------------------- main


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _replay_command(case, args) -> str:
    parts = ["python3", "benchmarks/gpu_fuzz.py", "--seed", str(case["seed"]), "--case", str(case["index"]),
             "--device", args.device, "--max-tokens", str(args.max_tokens), "--max-hidden", str(args.max_hidden),
             "--max-heads", str(args.max_heads), "--head-dims", ",".join(map(str, args.head_dims))]
    if args.backend:
        parts += ["--backend", args.backend]
    if args.api:
        parts += ["--api", args.api]
    if args.variant != "any":
        parts += ["--variant", args.variant]
    if args.fused_forward != "auto":
        parts += ["--fused-forward", args.fused_forward]
    return " ".join(shlex.quote(p) for p in parts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", type=int, default=None, help="run only this case index (replay)")
    ap.add_argument("--case-json", default=None, help="run this case (a JSON object as printed on failure)")
    ap.add_argument("--out", default=None, help="folder for fuzz.json")
    ap.add_argument("--problem-dir", default=os.environ.get("FUSEDQKV_SOL_EXECBENCH"),
                    help="the 091 pack (or a folder holding it); default $FUSEDQKV_SOL_EXECBENCH, then shared/ beside the repo")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--backend", default=None, choices=["triton", "torch"],
                    help="default: the library's own choice (Triton on CUDA); on the CPU, triton runs the interpreter")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-hidden", type=int, default=4096)
    ap.add_argument("--max-heads", type=int, default=48)
    ap.add_argument("--head-dims", default="64,128,256,512")
    ap.add_argument("--api", choices=["091", "train"], default=None, help="every case on this entry point")
    ap.add_argument("--variant", choices=["any", "plain"], default="any",
                    help="plain: every train case the block's plain variant (what the one-launch forward covers)")
    ap.add_argument("--fused-forward", choices=["auto", "on", "off"], default="auto",
                    help="the training forward's one-launch Hopper kernel (config.fused_forward): on takes it for "
                         "every case it supports, whatever the size")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes sharing the device (default: 8 on CUDA, 1 on the CPU): the run is bound by "
                         "Triton's compiles of new specialisations, one CPU core each")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds; past it no new case starts and the run fails as incomplete (0: none)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "k/N": this process runs cases k, k+N, ...
    args = ap.parse_args(argv)
    args.head_dims = [int(v) for v in str(args.head_dims).split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.device == "cpu" and args.backend == "triton":
        # Triton kernels on the CPU: the interpreter, chosen before fusedqkv's kernels are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import fusedqkv  # noqa: F401
    except ImportError:  # a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import torch

    device = torch.device(args.device)
    caps = dict(max_tokens=args.max_tokens, max_hidden=args.max_hidden, max_heads=args.max_heads,
                head_dims=args.head_dims)
    if device.type == "cpu":
        from fusedqkv.ops import fp8

        if not fp8.cpu_scaled_mm_takes_row_scales():  # such cases raise (clearly) on this CPU: not drawn
            caps["fp8_recipes"] = [k for k in ("rowwise", "tensorwise", "rowwise_with_gw_hp")
                                   if not fp8.row_scaled_gemms(fp8.RECIPES[k])]
    if args.case_json:
        cases = [json.loads(args.case_json)]
    elif args.case is not None:
        cases = [draw_case(args.seed, args.case, caps, args.api, args.variant == "plain")]
    else:
        cases = [draw_case(args.seed, i, caps, args.api, args.variant == "plain") for i in range(args.cases)]
    pack = _pack_dir(args.problem_dir)
    if pack is None and any(c["api"] == "091" for c in cases):
        print("gpu_fuzz: the SOL-ExecBench 091 pack (definition.json) was not found: give --problem-dir or "
              "FUSEDQKV_SOL_EXECBENCH", file=sys.stderr)
        return 2
    if args.workers is None:
        args.workers = min(8, os.cpu_count() or 1) if device.type == "cuda" else 1
    if args.worker is None:
        print(f"gpu_fuzz: {len(cases)} cases, seed {args.seed}, device {device}"
              f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
              f"torch {torch.__version__}, backend {args.backend or 'default'}, reference {pack}, "
              f"{args.workers} worker(s)", flush=True)
        if args.workers > 1 and len(cases) > 1:
            return _run_workers(argv, args, cases, device, pack)
    else:
        k, n_workers = (int(v) for v in args.worker.split("/"))
        cases = cases[k::n_workers]
    results, failed, t_start = [], [], time.time()
    for n, case in enumerate(cases):
        if args.time_limit and time.time() - t_start > args.time_limit:
            print(f"gpu_fuzz: --time-limit {args.time_limit:.0f}s reached after {n} cases", flush=True)
            break
        t0 = time.time()
        rec = dict(case=case)
        try:
            res = check_091(case, device, args.backend, pack) if case["api"] == "091" else check_train(
                case, device, args.backend, args.fused_forward)
            _sync(device)
            rec.update(res)
        except Exception as e:  # noqa: BLE001 - a crash is a finding
            rec.update(ok=False, crash=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-6000:])
        rec["seconds"] = round(time.time() - t0, 3)
        if device.type == "cuda" and rec["ok"]:  # workers share the GPU: give back what a large case held
            torch.cuda.empty_cache()
        results.append(rec)
        status = "ok  " if rec["ok"] else "FAIL"
        print(f"[{n + 1:4d}/{len(cases)}] {status} {rec['seconds']:7.2f}s case {case['index']}: {case_line(case)}",
              flush=True)
        if not rec["ok"]:
            failed.append(rec)
            bad = {k: v for k, v in rec.get("outputs", {}).items() if not v.get("passed")}
            print("  FAILING CASE:", json.dumps(case, sort_keys=True))
            print("  replay:", _replay_command(case, args))
            print("  replay (json):", "python3 benchmarks/gpu_fuzz.py --case-json", shlex.quote(json.dumps(case)),
                  "--device", args.device, *(["--backend", args.backend] if args.backend else []),
                  "--fused-forward", args.fused_forward)
            if "crash" in rec:
                print("  crash:", rec["crash"])
                print("  " + rec["traceback"].replace("\n", "\n  "))
            for k, v in bad.items():
                print(f"  mismatch {k}: {json.dumps(v)}")
            if "crash" in rec and device.type == "cuda" and ("CUDA" in rec["crash"] or "Accelerator" in rec["crash"]):
                print("  a CUDA error: the context is lost, the remaining cases are skipped", flush=True)
                break
    return _report(args, device, cases, results, time.time() - t_start)


def _report(args, device, cases, results, total) -> int:
    import torch

    failed = [r for r in results if not r["ok"]]
    summary = dict(cases=len(results), requested=len(cases), failed=len(failed), seconds=round(total, 1),
                   seed=args.seed, device=str(device), torch=torch.__version__,
                   forward={p: sum(r.get("forward") == p for r in results) for p in ("split", "one-launch",
                                                                                     "one-launch fp8")})
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        pass
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fuzz.json").write_text(json.dumps(dict(summary=summary, args=vars(args), results=results), indent=1,
                                                  default=str))
    if args.worker is not None:  # the parent reports
        return 0 if not failed and len(results) == len(cases) else 1
    # short table last
    print("\napi    dtype  cases  failed")
    for api in ("091", "train"):
        for dn in ("bf16", "fp16", "fp32"):
            rs = [r for r in results if r["case"]["api"] == api and r["case"]["dtype"] == dn]
            if rs:
                print(f"{api:6s} {dn:6s} {len(rs):5d}  {sum(not r['ok'] for r in rs):6d}")
    paths = [r.get("forward") for r in results if r["case"]["api"] == "train"]
    if paths:  # the training forward's path per case (FP8 cases: the one-launch forward's FP8 build or the split path)
        fp8 = [r.get("forward") for r in results if r["case"]["api"] == "train" and r["case"].get("fp8")]
        counts = ", ".join(f"{p} {paths.count(p)}" for p in ("split", "one-launch", "one-launch fp8") if p in paths)
        print(f"train forward: {counts} (FP8 cases {len(fp8)}, one-launch {fp8.count('one-launch fp8')})")
    tokens = [r["case"]["batch"] * r["case"]["seq"] for r in results]
    if tokens:
        print(f"tokens {min(tokens)}..{max(tokens)}, seq 1: {sum(r['case']['seq'] == 1 for r in results)} cases")
    for r in failed:
        print(f"FAILED case {r['case']['index']}: {case_line(r['case'])}")
        print("  replay:", _replay_command(r["case"], args))
    print(f"RESULT gpu_fuzz {'PASS' if not failed and len(results) == len(cases) else 'FAIL'} "
          f"cases={len(results)}/{len(cases)} failed={len(failed)} seconds={total:.1f}")
    return 0 if not failed and len(results) == len(cases) else 1


def _run_workers(argv, args, cases, device, pack) -> int:
    """The cases split over ``args.workers`` processes on the same device; results merged."""
    import subprocess
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_fuzz_") as tmp:
        procs = []
        for k in range(args.workers):
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", f"{k}/{args.workers}",
                   "--out", str(Path(tmp) / str(k)), "--device", str(device), "--problem-dir", str(pack)]
            procs.append(subprocess.Popen(cmd))
        codes = [p.wait() for p in procs]
        results = []
        for k in range(args.workers):
            f = Path(tmp) / str(k) / "fuzz.json"
            if f.is_file():
                results += json.loads(f.read_text())["results"]
    results.sort(key=lambda r: r["case"]["index"])
    seen = {r["case"]["index"] for r in results}
    missing = [c for c in cases if c["index"] not in seen]
    if missing or any(c not in (0, 1) for c in codes):
        print(f"gpu_fuzz: worker exit codes {codes}; {len(missing)} cases without a result "
              f"(first: {[c['index'] for c in missing[:10]]})", flush=True)
    return _report(args, device, cases, results, time.time() - t0)


if __name__ == "__main__":
    sys.exit(main())
