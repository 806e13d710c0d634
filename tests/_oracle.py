"""Test helpers: a plain-PyTorch oracle of the 091 backward for any head configuration,
the official reference with its head constants substituted, and an input generator.

The official reference (``definition.json``) hard-codes 32 query heads, 8 KV heads
and head_dim 128. ``oracle_backward`` follows its semantics step by step -- the same
operations in the same order and dtypes, so the same low-precision rounding points --
for arbitrary head counts, its two GEMMs in fp32 rounded once (``_product``).
``official_reference_for`` executes the official source with the constants replaced;
``test_properties`` checks the two agree: bitwise, the GEMMs within one rounding.
"""

from __future__ import annotations

import json
import re

import torch
from torch import nn

from fusedqkv.bench import problem
from _gemm_audit import counted_oracle

OUTPUT_NAMES = ("grad_hidden_states", "grad_cos", "grad_sin", "grad_qkv_weight",
                "grad_q_norm_weight", "grad_k_norm_weight")


def _rms_norm_backward(g, x, w, r):
    """fp32 throughout, rounded once to the gradient's dtype (as the reference)."""
    dt = g.dtype
    g, x, w, r = g.float(), x.float(), w.float(), r.float()
    grad_w = (g * (x * r)).sum(dim=(0, 1, 2))
    direct = g * w * r
    grad_r = (g * w * x).sum(dim=-1, keepdim=True)
    dx = direct + grad_r * (-r.pow(3) * x / x.shape[-1])
    return dx.to(dt), grad_w.to(dt)


def _rope_backward(g, x_rot, cos, sin):
    """In the activation dtype, op by op (each op rounds, as the reference)."""
    h = g.shape[-1] // 2
    gx = g * cos + torch.cat((g[..., h:], -g[..., :h]), dim=-1) * sin
    x_orig = x_rot * cos + torch.cat((-x_rot[..., h:], x_rot[..., :h]), dim=-1) * sin
    gcos = (g * x_orig).sum(dim=1)
    gsin = (g * torch.cat((-x_orig[..., h:], x_orig[..., :h]), dim=-1)).sum(dim=1)
    return gx, gcos, gsin


def _product(a, b):
    """The reference's GEMM rounding point -- an fp32 sum rounded once to the operands' dtype --
    taken as torch's fp32 product of the widened operands: what the CPU path computes
    (fusedqkv.ops.host_gemm), independently of how this host's half-precision GEMM orders its sum
    (torch's CPU bf16 GEMM is scalar, and slow, without AVX-512 BF16)."""
    return torch.mm(a.float(), b.float()).to(a.dtype)


@torch.no_grad()
def oracle_backward(grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight,
                    q_norm_weight, k_norm_weight, query_pre_norm, key_pre_norm, q_rstd, k_rstd, eps,
                    out_dtype=None):
    """The 091 reference's semantics for any (num_heads, num_kv_heads, head_dim).

    Outputs are cast to ``out_dtype`` (default: the activation dtype; the official
    reference casts to bfloat16, which is the same thing for 091's bf16 inputs).
    """
    out_dtype = out_dtype or grad_query.dtype
    b, hq, s, d = grad_query.shape
    hkv = grad_key.shape[1]
    hidden = hidden_states.shape[-1]
    qkv = (hq + 2 * hkv) * d
    gqn, gwq = _rms_norm_backward(grad_query, query_pre_norm, q_norm_weight, q_rstd)
    gkn, gwk = _rms_norm_backward(grad_key, key_pre_norm, k_norm_weight, k_rstd)
    c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    gq, gcq, gsq = _rope_backward(gqn, query_pre_norm, c, sn)
    gk, gck, gsk = _rope_backward(gkn, key_pre_norm, c, sn)
    gcos, gsin = gcq + gck, gsq + gsk
    dqkv = torch.cat([gq.transpose(1, 2).reshape(b, s, hq * d), gk.transpose(1, 2).reshape(b, s, hkv * d),
                      grad_value.transpose(1, 2).reshape(b, s, hkv * d)], dim=-1).reshape(-1, qkv)
    gx = _product(dqkv, qkv_weight).reshape(b, s, hidden)
    gw = _product(dqkv.t(), hidden_states.reshape(-1, hidden))
    return tuple(t.to(out_dtype) for t in (gx, gcos, gsin, gw, gwq, gwk))


def official_reference_for(num_heads: int, num_kv_heads: int, head_dim: int):
    """The official ``run`` with its head constants substituted, or None without the pack."""
    pack = problem.official_pack_dir()
    if pack is None:
        return None
    src = json.loads((pack / "definition.json").read_text())["reference"]
    subs = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "num_kv_groups": num_heads // num_kv_heads}
    for name, value in subs.items():
        src, n = re.subn(rf"^(\s+){name} = \d+\s*$", rf"\g<1>{name} = {value}", src, flags=re.M)
        assert n == 1, f"constant {name} not found exactly once in the official reference"
    ns: dict = {"__name__": "sol_execbench_reference_generalised"}
    exec(compile(src, "definition.json[reference]", "exec"), ns)  # noqa: S102 - the oracle
    return counted_oracle(ns["run"])


def make_inputs(batch, heads, kv_heads, seq, head_dim, hidden=32, dtype=torch.bfloat16, seed=0,
                rstd_3d=False, norm_dtype=None):
    """The 14 inputs of the 091 backward (official generation heuristics, small sizes)."""
    g = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=g).to(dtype)

    ang = torch.randn(batch, seq, head_dim, generator=g).clamp(-3, 3)
    qkv = (heads + 2 * kv_heads) * head_dim
    nd = norm_dtype or dtype
    rshape_q = (batch, heads, seq) if rstd_3d else (batch, heads, seq, 1)
    rshape_k = (batch, kv_heads, seq) if rstd_3d else (batch, kv_heads, seq, 1)
    return [
        rn(batch, heads, seq, head_dim), rn(batch, kv_heads, seq, head_dim), rn(batch, kv_heads, seq, head_dim),
        rn(batch, seq, hidden), ang.cos().to(dtype), ang.sin().to(dtype),
        (torch.randn(qkv, hidden, generator=g) / hidden ** 0.5).to(dtype),
        (1 + 0.1 * torch.randn(head_dim, generator=g)).to(nd), (1 + 0.1 * torch.randn(head_dim, generator=g)).to(nd),
        rn(batch, heads, seq, head_dim), rn(batch, kv_heads, seq, head_dim),
        (torch.randn(*rshape_q, generator=g).abs() + 0.1).to(dtype),
        (torch.randn(*rshape_k, generator=g).abs() + 0.1).to(dtype), 1e-6,
    ]


NORM_GRADS = ("grad_q_norm_weight", "grad_k_norm_weight")


def assert_matches_oracle(got, ref, label=""):
    """Shapes and dtypes equal. grad_hidden_states, grad_cos, grad_sin and
    grad_qkv_weight bitwise: the reference's rounding points are reproduced and, on the
    CPU, the GEMMs are the same library call on identical operands. The norm-weight
    gradients are fp32 sums over batch*heads*seq whose order differs between the
    kernel's per-program partials and torch's reduction: within one ulp of the result
    dtype plus fp32 noise."""
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert g.shape == r.shape, (label, name, g.shape, r.shape)
        assert g.dtype == r.dtype, (label, name, g.dtype, r.dtype)
        if name in NORM_GRADS:
            g32, r32 = g.float(), r.float()
            ulp = torch.finfo(r.dtype).eps
            tol = ulp * r32.abs() + 1e-5 * (float(r32.abs().max()) if r.numel() else 0.0) + 1e-30
            bad = (g32 - r32).abs() > tol
            assert not bool(bad.any()), (label, name, int(bad.sum()), float((g32 - r32).abs().max()))
        else:
            assert torch.equal(g, r), (label, name, float((g.float() - r.float()).abs().max()) if g.numel() else 0)


class TinyAttention(nn.Module):
    """A block, attention and an output projection: what torch.compile tests trace."""

    def __init__(self, block):
        super().__init__()
        self.blk = block
        self.o = nn.Linear(block.num_heads * block.head_dim, block.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        q, k, v = self.blk(x, cos, sin)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
