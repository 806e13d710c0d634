"""The block's variants of issue 25 -- gated q, partial rotary, interleaved RoPE, unweighted norms,
the norm over all heads, an unweighted v norm -- alone and combined, both norm positions:

* the two stages (the forward stage and the training-mode backward stage, Triton interpreter and
  torch backend) against autograd through ``module.reference_block`` in float64, the projection
  the identity (so dQKV is the gradient w.r.t. its input), and the two backends against each other;
* the torch backend's backward against its forward by ``torch.autograd.gradcheck`` in float64
  (cos/sin included);
* the training API and the modules (fp32, every gradient including cos/sin) against
  ``reference_block`` in float64, both backends; one torch.compile(fullgraph=True) run and the
  custom ops' opcheck with the variants' flags;
* clear errors for impossible combinations;
* head_dim 512 (Gemma 4's global layers; issue 38): the stages (both layouts), the gradcheck (fast
  mode) and the training API on the variants Gemma 4 uses, at a few tokens and heads.
"""

import pytest
import torch

import fusedqkv
from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm, gqa_qkv_rope_qk_norm
from fusedqkv.module import reference_block
from fusedqkv.ops.gqa_forward import Variant, forward_torch, heads_of, rope_qk_norm_forward
from fusedqkv.ops.rope_qk_norm import backward_torch, rope_qk_norm_backward

# name -> Variant fields (rot as a divisor of head_dim)
VARIANTS = {
    "unweighted": dict(norm_weight=False),
    "partial": dict(rot=4),
    "interleaved": dict(interleaved=True),
    "partial_interleaved": dict(rot=2, interleaved=True),
    "gate": dict(q_gate=True),
    "v_norm": dict(v_norm=True),
    "all_heads": dict(all_heads=True),
    "gate_partial_v_norm": dict(q_gate=True, rot=4, v_norm=True),
    "all_heads_unweighted_partial": dict(all_heads=True, norm_weight=False, rot=2),
    "everything": dict(all_heads=True, q_gate=True, interleaved=True, v_norm=True, rot=2),
}
# v the raw k projection (Gemma 4's global layers): the training API's (the stages see v's columns as k's)
K_EQ_V_VARIANTS = {
    "k_eq_v": dict(k_eq_v=True, v_norm=True),
    "k_eq_v_gate_partial": dict(k_eq_v=True, q_gate=True, rot=4),
    "k_eq_v_all_heads": dict(k_eq_v=True, all_heads=True, v_norm=True, interleaved=True),
}
B, S, HQ, HKV, D = 2, 3, 4, 2, 16


def make_variant(name: str, d: int = D) -> Variant:
    kw = dict(VARIANTS[name] if name in VARIANTS else K_EQ_V_VARIANTS[name])
    if "rot" in kw:
        kw["rot"] = d // kw["rot"]
    return Variant(**kw)


def api_options(v: Variant) -> dict:
    return dict(q_gate=v.q_gate, rope_style="interleaved" if v.interleaved else "neox",
                norm_scope="all_heads" if v.all_heads else "head", v_norm=v.v_norm, k_eq_v=v.k_eq_v)


def _stage_inputs(v: Variant, seed: int, b=B, s=S, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    nq = 2 * hq if v.q_gate else hq
    n = (nq + 2 * hkv) * d
    rot = v.rotary(d)
    x = torch.randn(b, s, n, generator=g, dtype=torch.float64)
    ang = torch.randn(b, s, rot, generator=g, dtype=torch.float64)  # independent angles: no symmetry to lean on
    cos, sin = ang.cos(), ang.sin()
    wq = wk = None
    if v.norm_weight:
        wq = 1 + 0.2 * torch.randn(hq * d if v.all_heads else d, generator=g, dtype=torch.float64)
        wk = 1 + 0.2 * torch.randn(hkv * d if v.all_heads else d, generator=g, dtype=torch.float64)
    return x, wq, wk, cos, sin, g


def _rel(a, r):
    a, r = a.detach().double(), r.detach().double()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))


def _check_stages(v: Variant, after_rope: bool, seed: int, b=B, s=S, hq=HQ, hkv=HKV, d=D):
    """Both stages on both backends against autograd through ``reference_block`` in float64 (the
    projection the identity), and the backends against each other."""
    x, wq, wk, cos, sin, g = _stage_inputs(v, seed, b, s, hq, hkv, d)
    leaves = [t.clone().requires_grad_() for t in (x, cos, sin)] + [
        t.clone().requires_grad_() for t in (wq, wk) if t is not None]
    lx, lcos, lsin = leaves[:3]
    lwq, lwk = leaves[3:] if v.norm_weight else (None, None)
    eye = torch.eye(x.shape[-1], dtype=torch.float64)  # the projection as the identity: its output is x
    outs = reference_block(lx, eye, lwq, lwk, lcos, lsin, hq, hkv, 1e-6, after_rope, **api_options(v))
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    want = torch.autograd.grad(outs, leaves, grads)  # dQKV, grad_cos, grad_sin[, grad_wq, grad_wk]

    f = lambda t: None if t is None else t.detach().float()  # noqa: E731
    results = {}
    for backend in ("torch", "triton"):
        q, k, _, _, vn = rope_qk_norm_forward(f(x), f(wq), f(wk), f(cos), f(sin), hq, hkv, 1e-6, after_rope, v,
                                              backend)
        got_fwd = [q, k] + ([vn] if v.v_norm else [])
        for a, r in zip(got_fwd, outs):
            assert _rel(a, r.detach()) < 1e-5, (backend, "forward")
        xq, xk, xv, _ = heads_of(f(x), hq, hkv, d, v.q_gate)
        dqkv = torch.empty(b * s, x.shape[-1])
        gcos, gsin = torch.empty(b, s, v.rotary(d)), torch.empty(b, s, v.rotary(d))
        gwq = gwk = None
        if v.norm_weight:
            gwq, gwk = torch.empty(wq.shape), torch.empty(wk.shape)
        gq, gk, gv = (f(t) for t in grads[:3])
        rope_qk_norm_backward(gq, gk, gv, xq, xk, None, None, f(wq), f(wk), f(cos), f(sin), dqkv=dqkv,
                              grad_cos=gcos, grad_sin=gsin, grad_q_norm_weight=gwq, grad_k_norm_weight=gwk,
                              exact=False, norm_after_rope=after_rope, saved_rotated=False, backend=backend, eps=1e-6,
                              variant=v, grad_gate=f(grads[3]).transpose(1, 2) if v.q_gate else None,
                              saved_v=xv if v.v_norm else None)
        got = [dqkv.view(b, s, -1), gcos, gsin] + ([gwq, gwk] if v.norm_weight else [])
        for i, (a, r) in enumerate(zip(got, want)):
            assert _rel(a, r) < 2e-5, (backend, i, _rel(a, r))
        results[backend] = got_fwd + got
    for i, (a, b_) in enumerate(zip(results["torch"], results["triton"])):  # the two backends agree closely
        assert _rel(b_, a) < 1e-5, i


@pytest.mark.parametrize("after_rope", [True, False], ids=["after_rope", "before_rope"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_stages_match_reference_block_float64(name, after_rope):
    _check_stages(make_variant(name), after_rope, seed=len(name))


# head_dim 512 (Gemma 4's global layers): weighted norms before RoPE with v normed (Gemma 4's block), the
# plain block after RoPE, and the query/key variant path (gate, partial rotary); 2 blocks of 4 tokens
WIDE = dict(b=1, s=5, hq=2, hkv=1, d=512)
WIDE_CASES = [("v_norm", False), ("plain", True), ("gate_partial_v_norm", False)]


@pytest.mark.parametrize("name, after_rope", WIDE_CASES, ids=[f"{n}-{'after' if a else 'before'}" for n, a in WIDE_CASES])
def test_stages_at_head_dim_512_match_reference_block_float64(name, after_rope):
    v = Variant() if name == "plain" else make_variant(name, WIDE["d"])
    _check_stages(v, after_rope, seed=5, **WIDE)


def test_stage_layouts_match_torch_backend():
    """The backward stage's other program layouts (every head of a token block; 2-head groups of
    2-token blocks, several groups per head set) on the variants, against the torch backend."""
    from fusedqkv.ops import config

    for tile in ((4, 1, 2, 3, 0), (2, 1, 2, 3, 2)):
        for name in ("partial_interleaved", "gate_partial_v_norm", "unweighted"):
            v = make_variant(name)
            x, wq, wk, cos, sin, g = _stage_inputs(v, seed=3)
            f = lambda t: None if t is None else t.float()  # noqa: E731
            xq, xk, xv, _ = heads_of(f(x), HQ, HKV, D, v.q_gate)
            gq, gk, gv = (torch.randn(t.shape, generator=g) for t in (xq, xk, xk))
            gg = torch.randn(xq.shape, generator=g) if v.q_gate else None
            got = {}
            for backend in ("torch", "triton"):
                dqkv = torch.empty(B * S, x.shape[-1])
                gcos, gsin = torch.empty(B, S, v.rotary(D)), torch.empty(B, S, v.rotary(D))
                gw = (torch.empty(D), torch.empty(D)) if v.norm_weight else (None, None)
                with config.override(stage_tile=tile):
                    rope_qk_norm_backward(gq, gk, gv, xq, xk, None, None, f(wq), f(wk), f(cos), f(sin), dqkv=dqkv,
                                          grad_cos=gcos, grad_sin=gsin, grad_q_norm_weight=gw[0],
                                          grad_k_norm_weight=gw[1], exact=False, norm_after_rope=tile[4] == 0,
                                          saved_rotated=False, backend=backend, eps=1e-6, variant=v, grad_gate=gg,
                                          saved_v=xv if v.v_norm else None)
                got[backend] = [dqkv, gcos, gsin] + [t for t in gw if t is not None]
            for i, (a, b) in enumerate(zip(got["torch"], got["triton"])):
                assert _rel(b, a) < 1e-5, (tile, name, i)


class _TorchStages(torch.autograd.Function):
    """The torch backend's forward stage with its backward stage as the gradient (for gradcheck)."""

    @staticmethod
    def forward(ctx, qkv, wq, wk, cos, sin, meta):
        after_rope, v, hq, hkv, d = meta
        q, k, _, _, vn = forward_torch(qkv, wq, wk, cos, sin, hq, hkv, 1e-6, after_rope, v)
        ctx.save_for_backward(qkv, wq, wk, cos, sin)
        ctx.meta = meta
        _, _, xv, gate = heads_of(qkv, hq, hkv, d, v.q_gate)  # [B, H, S, D] views
        outs = (q, k, vn if v.v_norm else xv.clone())
        return outs + ((gate.clone(),) if v.q_gate else ())

    @staticmethod
    def backward(ctx, gq, gk, gv, gg=None):
        qkv, wq, wk, cos, sin = ctx.saved_tensors
        after_rope, v, hq, hkv, d = ctx.meta
        xq, xk, xv, _ = heads_of(qkv, hq, hkv, d, v.q_gate)
        dqkv = torch.empty(qkv.shape[0] * qkv.shape[1], qkv.shape[2], dtype=qkv.dtype)
        gcos, gsin = torch.empty_like(cos), torch.empty_like(sin)
        gwq = None if wq is None else torch.empty_like(wq)
        gwk = None if wk is None else torch.empty_like(wk)
        backward_torch(gq, gk, gv, xq, xk, None, None, wq, wk, cos, sin, dqkv, gcos, gsin, gwq, gwk, False,
                       after_rope, False, 1e-6, v, gg, xv)
        return dqkv.view(qkv.shape), gwq, gwk, gcos, gsin, None


def _gradcheck(name: str, after_rope: bool, d: int, fast_mode: bool = False) -> bool:
    hq, hkv = 2, 1
    v = Variant() if name == "plain" else make_variant(name, d)
    x, wq, wk, cos, sin, _ = _stage_inputs(v, 1, b=1, s=2, hq=hq, hkv=hkv, d=d)
    inputs = [x.requires_grad_(), cos.requires_grad_(), sin.requires_grad_()]
    if v.norm_weight:
        inputs += [wq.requires_grad_(), wk.requires_grad_()]

    def fn(qkv, c, s, *w):
        return _TorchStages.apply(qkv, *(w or (None, None)), c, s, (after_rope, v, hq, hkv, d))

    return torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast_mode)


@pytest.mark.parametrize("after_rope", [True, False], ids=["after_rope", "before_rope"])
@pytest.mark.parametrize("name", ["plain", *VARIANTS])
def test_torch_backend_gradcheck_float64(name, after_rope):
    """gradcheck of the torch backend's backward stage against its forward stage, float64 (the
    backends compute in fp64 for fp64 inputs), every input including cos/sin and the weights."""
    assert _gradcheck(name, after_rope, d=8)


@pytest.mark.parametrize("name, after_rope", WIDE_CASES, ids=[f"{n}-{'after' if a else 'before'}" for n, a in WIDE_CASES])
def test_torch_backend_gradcheck_float64_head_dim_512(name, after_rope):
    """The gradcheck at head_dim 512, in fast mode (a random projection of the Jacobian: ~6k inputs)."""
    assert _gradcheck(name, after_rope, d=512, fast_mode=True)


# ------------------------------------------------------------------------------ the training API


# (variant name, qk_norm_position, cos/sin trainable)
API_CASES = [
    ("unweighted", "after_rope", True),
    ("partial", "before_rope", True),
    ("interleaved", "after_rope", True),
    ("gate", "before_rope", True),
    ("v_norm", "after_rope", False),
    ("all_heads", "before_rope", True),
    ("all_heads_unweighted_partial", "after_rope", True),
    ("everything", "before_rope", True),
    ("k_eq_v", "before_rope", True),
    ("k_eq_v_gate_partial", "after_rope", True),
    ("k_eq_v_all_heads", "before_rope", False),
]


def _api_run(v: Variant, position, cos_grad, backend, seed=0, hidden=24, bias=False, b=B, s=S, hq=HQ, hkv=HKV,
             d=D):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(v.qkv_heads(hq, hkv) * d, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    bv = torch.randn(v.qkv_heads(hq, hkv) * d, generator=g, dtype=torch.float64) if bias else None
    ang = torch.randn(1, s, v.rotary(d), generator=g, dtype=torch.float64) * 3  # shared by the batch
    cos, sin = ang.cos(), ang.sin()
    ws = []
    if v.norm_weight:
        ws = [1 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
              for n in ((hq * d, hkv * d) if v.all_heads else (d, d))]
    opts = api_options(v)

    def go(dtype, fn):
        leaves = [t.to(dtype).requires_grad_() for t in [x, w] + ws]
        cs = [t.to(dtype).requires_grad_(cos_grad) for t in (cos, sin)]
        lb = None if bv is None else bv.to(dtype).requires_grad_()
        wq, wk = leaves[2:] if ws else (None, None)
        out = fn(leaves[0], leaves[1], wq, wk, *cs, lb)
        gg = torch.Generator().manual_seed(seed + 1)
        grads = [torch.randn(o.shape, generator=gg, dtype=torch.float64).to(dtype) for o in out]
        wrt = leaves + (cs if cos_grad else []) + ([lb] if bias else [])
        return [o.detach() for o in out] + list(torch.autograd.grad(out, wrt, grads))

    ours = go(torch.float32, lambda *a: gqa_qkv_rope_qk_norm(*a[:6], num_heads=hq, num_kv_heads=hkv, eps=1e-6,
                                                             qk_norm_position=position, backend=backend,
                                                             qkv_bias=a[6], **opts))
    ref = go(torch.float64, lambda *a: reference_block(*a[:6], hq, hkv, 1e-6, position == "after_rope", a[6], **opts))
    return ours, ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name, position, cos_grad", API_CASES, ids=[c[0] for c in API_CASES])
def test_training_api_matches_reference_fp32(name, position, cos_grad, backend):
    """Outputs (q, k, v[, gate]) and every gradient (x, qkv_weight[, norm weights][, cos, sin][, bias])."""
    v = make_variant(name)
    ours, ref = _api_run(v, position, cos_grad, backend, seed=len(name), bias=name in ("everything", "k_eq_v"))
    assert len(ours) == len(ref)
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert a.dtype == torch.float32 and a.shape == r.shape, i
        assert _rel(a, r) < 1e-4, (i, _rel(a, r))
    if v.q_gate:  # the gate is the unnormed second half of each query head's projection columns
        gate = ours[3]
        assert gate.shape == (B, S, HQ, D)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_training_api_at_head_dim_512_matches_reference_fp32(backend):
    """Gemma 4's global-layer block at head_dim 512 (weighted norms before RoPE, v the raw k, normed)
    through the training API: outputs and every gradient (x, qkv_weight, norm weights, cos, sin)."""
    ours, ref = _api_run(make_variant("k_eq_v"), "before_rope", True, backend, seed=3, hidden=16,
                         **{k: v for k, v in WIDE.items()})
    assert len(ours) == len(ref) == 9
    for i, (a, r) in enumerate(zip(ours, ref)):
        assert a.dtype == torch.float32 and a.shape == r.shape, i
        assert _rel(a, r) < 1e-4, (i, _rel(a, r))


def test_stage_at_head_dim_512_every_head_of_a_block():
    """The stage's other layout at head_dim 512: every query and key head of a 4-token block in one
    program (the launcher's choice from ~1.6k tokens on an H200), against the reference."""
    from fusedqkv.ops import config

    with config.override(stage_tile=(4, 1, 0, 3, 0)):
        _check_stages(make_variant("v_norm"), False, seed=6, **WIDE)


def test_modules_with_variants_match_and_share_state_dicts():
    torch.manual_seed(0)
    kw = dict(q_gate=True, rope_style="interleaved", norm_scope="all_heads", v_norm=True)
    m = GQAQKVRoPEQKNorm(24, HQ, HKV, D, qk_norm_position="before_rope", **kw)
    r = ReferenceGQAQKVRoPEQKNorm(24, HQ, HKV, D, qk_norm_position="before_rope", **kw)
    assert m.qkv_weight.shape == ((2 * HQ + 2 * HKV) * D, 24) and m.q_norm_weight.shape == (HQ * D,)
    with torch.no_grad():
        m.q_norm_weight.uniform_(0.5, 1.5)
    r.load_state_dict(m.state_dict())
    x = torch.randn(B, S, 24)
    ang = torch.randn(B, S, D // 2)
    cos, sin = ang.cos(), ang.sin()
    outs, refs = m(x, cos, sin), r(x, cos, sin)
    assert len(outs) == 4
    for a, b in zip(outs, refs):
        assert _rel(a, b) < 1e-5
    u = GQAQKVRoPEQKNorm(24, HQ, HKV, D, norm_weight=False)
    assert u.q_norm_weight is None and "q_norm_weight" not in u.state_dict()
    with pytest.raises(ValueError, match="norm_weight_offset"):
        GQAQKVRoPEQKNorm(24, HQ, HKV, D, norm_weight=False, norm_weight_offset=1.0)


def test_torch_compile_fullgraph_with_variants():
    v = make_variant("gate_partial_v_norm")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, 24, generator=g)
    w = torch.randn((2 * HQ + 2 * HKV) * D, 24, generator=g).requires_grad_()
    ang = torch.randn(B, S, v.rotary(D), generator=g)
    cos, sin = ang.cos(), ang.sin()

    def f(x, w, cos, sin):
        q, k, vv, gate = gqa_qkv_rope_qk_norm(x, w, None, None, cos, sin, num_heads=HQ, num_kv_heads=HKV,
                                              qk_norm_position="before_rope", q_gate=True, v_norm=True)
        return (q.sum() + 2 * k.sum() + 3 * vv.sum() + (gate * gate).sum())

    eager = torch.autograd.grad(f(x, w, cos, sin), w)[0]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w, cos, sin), w)[0]
    assert _rel(got, eager) < 1e-5


def test_opcheck_custom_ops_with_variant_flags():
    fwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_fwd.default
    bwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_bwd.default
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 16, generator=g)
    w = torch.randn((2 * 2 + 2) * 8, 16, generator=g)
    ang = torch.randn(1, 3, 4, generator=g)
    cos, sin = ang.cos(), ang.sin()
    args = (x, w, None, None, cos, sin, 2, 1, 1e-6, False, "auto", None, True, True, True, True)
    torch.library.opcheck(fwd, args)
    q, k, qkv, _, _, vn = fwd(*args)
    gq, gk, gv = (torch.randn(t.shape, generator=g) for t in (q, k, vn))
    gg = torch.randn(1, 3, 2, 8, generator=g)
    torch.library.opcheck(bwd, (gq, gk, gv, x, w, qkv, None, None, cos, sin, 2, 1, 1e-6, False, True, True, True,
                                "auto", False, gg, True, True, True, True))
    # k_eq_v (no V rows), with a residual and its gradient
    w = w[:(2 * 2 + 1) * 8]
    r = torch.randn(1, 3, w.shape[0], generator=g)
    args = (x, w, None, None, cos, sin, 2, 1, 1e-6, False, "auto", None, True, True, False, True, r, True)
    torch.library.opcheck(fwd, args)
    q, k, qkv, _, _, vn = fwd(*args)
    assert qkv.shape == (1, 3, w.shape[0])
    torch.library.opcheck(bwd, (gq, gk, gv, x, w, qkv, None, None, cos, sin, 2, 1, 1e-6, False, True, True, True,
                                "auto", False, gg, True, True, False, True, True, True))


# ------------------------------------------------------------------------------ errors


def _call(**change):
    g = torch.Generator().manual_seed(0)
    a = dict(hidden_states=torch.randn(1, 3, 16, generator=g), qkv_weight=torch.randn((2 + 2) * 8, 16, generator=g),
             q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8), cos=torch.ones(1, 3, 8),
             sin=torch.zeros(1, 3, 8))
    kw = dict(num_heads=2, num_kv_heads=1)
    for key, val in change.items():
        (a if key in a else kw)[key] = val
    return gqa_qkv_rope_qk_norm(*a.values(), **kw)


@pytest.mark.parametrize("change, exc, pattern", [
    (dict(cos=torch.ones(1, 3, 5), sin=torch.zeros(1, 3, 5)), ValueError, r"^cos/sin: rotary width 5 .* even size"),
    (dict(cos=torch.ones(1, 3, 10), sin=torch.zeros(1, 3, 10)), ValueError, r"^cos/sin: rotary width 10 .*head_dim=8"),
    (dict(sin=torch.zeros(1, 3, 4)), ValueError, r"^sin: expected shape \[1, 3, 8\] \(the rotary width of cos\)"),
    (dict(k_norm_weight=None), ValueError, r"^q_norm_weight / k_norm_weight: give both"),
    (dict(q_norm_weight=None, k_norm_weight=None, norm_weight_offset=1.0), ValueError,
     r"^norm_weight_offset: 1\.0 needs norm weights"),
    (dict(norm_scope="all_heads"), ValueError, r"^q_norm_weight: expected shape \[16\] \(\[num_heads\*head_dim\]"),
    (dict(norm_scope="all_heads", q_norm_weight=torch.ones(16), k_norm_weight=torch.ones(16)), ValueError,
     r"^k_norm_weight: expected shape \[8\] \(\[num_kv_heads\*head_dim\]"),
    (dict(q_gate=True), ValueError, r"^qkv_weight: expected shape .*q_gate"),
    (dict(rope_style="gptj"), ValueError, r"^rope_style: expected 'neox'"),
    (dict(norm_scope="token"), ValueError, r"^norm_scope: expected 'head'"),
    (dict(q_gate=1), TypeError, r"^q_gate: expected a bool"),
    (dict(v_norm="yes"), TypeError, r"^v_norm: expected a bool"),
    (dict(k_eq_v=1), TypeError, r"^k_eq_v: expected a bool"),
    # k_eq_v: [Q | K] rows; the block's [Q | K | V] weight is a head too many
    (dict(k_eq_v=True), ValueError, r"^qkv_weight: expected shape \[\(num_heads \+ num_kv_heads\)\*head_dim, "
                                    r"hidden_size\] = \[\(2 \+ 1\)\*8, 16\] = \[24, 16\] \(k_eq_v: rows \[Q \| K\]"),
])
def test_impossible_combinations_raise_clear_errors(change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _call(**change)


def test_the_plain_block_is_the_variant_free_path():
    """All switches off is ``Variant()``: the plans build the plain path (and its kernels' constexprs)."""
    out = _call()
    assert len(out) == 3
    plan = fusedqkv.ops.training_forward.PLANS.last()
    assert plan.variant == Variant()
    assert Variant().constexprs(128) == dict(HALF=64, HALF_P2=64, PASS=0, PASS_P2=1, INTERLEAVED=False,
                                             NORM_WEIGHT=True, Q_GATE=False, V_NORM=False)
    assert Variant().head_tiles(32, 8) == dict(HQ_P2=0, HKV_P2=0)  # one compile for every head count


def test_bench_variants_script_smoke(tmp_path):
    """benchmarks/bench_variants.py runs every variant end to end (CPU, the torch backend)."""
    import json

    from _scripts import load_benchmark

    bench = load_benchmark("bench_variants")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_variants.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == set(bench.VARIANTS)


@pytest.mark.parametrize("name", ["plain", "partial", "all_heads"])
def test_eps_zero_with_a_partial_token_block_gives_finite_gradients(name):
    """eps = 0 and fewer tokens than a block: the rows past the tokens must not turn the norm-weight
    gradients into nan (their rstd 1/sqrt(0) was inf, and 0 * inf = nan in the sums)."""
    v = Variant() if name == "plain" else make_variant(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 16, generator=g)
    w = torch.randn((HQ + 2 * HKV) * D, 16, generator=g).requires_grad_()
    n_q, n_k = (HQ * D, HKV * D) if v.all_heads else (D, D)
    wq, wk = torch.ones(n_q, requires_grad=True), torch.ones(n_k, requires_grad=True)
    ang = torch.randn(1, 3, v.rotary(D), generator=g)
    grads = {}
    for backend in ("torch", "triton"):
        out = gqa_qkv_rope_qk_norm(x, w, wq, wk, ang.cos(), ang.sin(), num_heads=HQ, num_kv_heads=HKV, eps=0.0,
                                   backend=backend, **api_options(v))
        grads[backend] = torch.autograd.grad(out, [w, wq, wk], [torch.ones_like(o) for o in out])
        assert all(bool(torch.isfinite(t).all()) for t in grads[backend]), backend
    for a, b in zip(grads["torch"], grads["triton"]):
        assert _rel(b, a) < 1e-4


def test_all_heads_pipeline_stages_fit_shared_memory(monkeypatch):
    """The all-heads backward's token loop keeps as many stages in flight as the device's shared
    memory holds (the H200's 232,448 bytes: 5 stages of OLMo 3's heads failed to launch)."""
    from fusedqkv.ops import rope_qk_norm as R

    monkeypatch.setattr(R, "max_shared_bytes", lambda device: 232448)
    cuda = torch.device("cuda")
    v = Variant(all_heads=True)
    assert R.all_heads_stages(32, 32, 128, v, 2, 4, cuda) == R.ALL_HEADS_STAGES == 3  # OLMo 3, bf16
    assert R.all_heads_stages(32, 32, 128, v, 4, 4, cuda) == 2  # fp32 tiles twice the bytes
    assert R.all_heads_stages(40, 40, 128, v, 2, 4, cuda) == 2  # 64-row tiles
    assert R.all_heads_stages(128, 128, 256, v, 2, 4, cuda) == 1
    assert R.all_heads_stages(32, 32, 128, Variant(all_heads=True, q_gate=True, v_norm=True), 4, 4, cuda) == 1
