"""The block options the Hugging Face integration needs (issue 16): a q/k/v projection bias
(``qkv_bias``: ``x W^T + b``, its gradient dQKV summed over tokens) and Gemma3's norm
weight form ``offset + w`` (``norm_weight_offset``). Checked against autograd through the
plain-PyTorch reference in float64 (every gradient, the bias's included), for the CPU path
and the Triton kernels (interpreter), both norm positions; bf16 by the three-way rule; the
custom ops (opcheck) and torch.compile(fullgraph=True); validation."""

import pytest
import torch

from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm, gqa_qkv_rope_qk_norm

from _oracle import TinyAttention

POSITIONS = ["after_rope", "before_rope"]
# (bias, norm_weight_offset)
OPTIONS = [(True, 0.0), (False, 1.0), (True, 1.0)]
NAMES = ["q", "k", "v", "grad_x", "grad_qkv_weight", "grad_qkv_bias", "grad_q_norm_weight",
         "grad_k_norm_weight", "grad_cos", "grad_sin"]


def rope_cos_sin(b, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.randint(0, 4096, (b, s), generator=g).double()
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_block(hidden, hq, hkv, d, pos, bias, offset, dtype=torch.float32, seed=0, cls=GQAQKVRoPEQKNorm):
    torch.manual_seed(seed)
    m = cls(hidden, hq, hkv, d, eps=1e-6, qk_norm_position=pos, bias=bias, norm_weight_offset=offset, dtype=dtype)
    with torch.no_grad():
        # Gemma3-style weights sit near 0 (scale 1 + w), the others near 1
        m.q_norm_weight.uniform_(-0.5, 0.5).add_(1.0 - offset)
        m.k_norm_weight.uniform_(-0.5, 0.5).add_(1.0 - offset)
        if bias:
            m.qkv_bias.normal_(0.0, 0.5)
    return m


def like(m, dtype, cls=ReferenceGQAQKVRoPEQKNorm):
    r = cls(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, eps=m.eps, qk_norm_position=m.qk_norm_position,
            bias=m.qkv_bias is not None, norm_weight_offset=m.norm_weight_offset, dtype=dtype)
    r.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
    return r


def run(mod, x, cos, sin, grads, backend=None):
    """outputs and gradients w.r.t. (x, qkv_weight, qkv_bias, q/k_norm_weight, cos, sin); a
    missing bias gives a zero placeholder so that the lists line up."""
    x = x.detach().requires_grad_()
    cos = cos.detach().requires_grad_()
    sin = sin.detach().requires_grad_()
    if backend is not None:
        out = gqa_qkv_rope_qk_norm(x, mod.qkv_weight, mod.q_norm_weight, mod.k_norm_weight, cos, sin,
                                   num_heads=mod.num_heads, num_kv_heads=mod.num_kv_heads, eps=mod.eps,
                                   qk_norm_position=mod.qk_norm_position, backend=backend,
                                   qkv_bias=mod.qkv_bias, norm_weight_offset=mod.norm_weight_offset)
    else:
        out = mod(x, cos, sin)
    has_bias = mod.qkv_bias is not None
    wrt = [x, mod.qkv_weight] + ([mod.qkv_bias] if has_bias else []) + [mod.q_norm_weight, mod.k_norm_weight, cos, sin]
    gr = list(torch.autograd.grad(out, wrt, [g.to(o.dtype) for g, o in zip(grads, out)]))
    if not has_bias:
        gr.insert(2, torch.zeros(mod.qkv_weight.shape[0], dtype=x.dtype))
    return list(out), gr


def rel_err(a, ref):
    a, ref = a.detach(), ref.detach()
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def inputs(m, b, s, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, m.hidden_size, generator=g).to(dtype)
    cos, sin = rope_cos_sin(b, s, m.head_dim, dtype, seed)
    shapes = [(b, m.num_heads, s, m.head_dim)] + [(b, m.num_kv_heads, s, m.head_dim)] * 2
    grads = [torch.randn(sh, generator=g).to(dtype).double() for sh in shapes]
    return x, cos, sin, grads


def check_fp32(m, b, s, backend=None, seed=0):
    x, cos, sin, grads = inputs(m, b, s, torch.float32, seed)
    out, gr = run(m, x, cos, sin, grads, backend)
    out64, gr64 = run(like(m, torch.float64), x.double(), cos.double(), sin.double(), grads)
    errs = {n: rel_err(a, r) for n, a, r in zip(NAMES, out + gr, out64 + gr64)}
    for n in NAMES[:3]:
        assert errs[n] < 1e-5, (n, errs)
    for n in NAMES[3:]:
        if n == "grad_qkv_bias" and m.qkv_bias is None:
            continue
        assert errs[n] < 1e-4, (n, errs)
    return out, gr


@pytest.mark.parametrize("bias, offset", OPTIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("pos", POSITIONS)
def test_fp32_cpu_path_matches_float64_reference(pos, bias, offset):
    check_fp32(make_block(48, 4, 2, 32, pos, bias, offset), 2, 5)


@pytest.mark.parametrize("bias, offset", OPTIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("pos", POSITIONS)
def test_fp32_triton_kernels_match_float64_reference(pos, bias, offset):
    m = make_block(32, 4, 2, 64, pos, bias, offset, seed=1)
    out_t, gr_t = check_fp32(m, 2, 3, backend="triton", seed=3)
    out_c, gr_c = check_fp32(m, 2, 3, backend="torch", seed=3)
    for n, a, c in zip(NAMES, out_t + gr_t, out_c + gr_c):
        assert rel_err(a, c.double()) < 1e-5, n


def test_bias_enters_before_rope_and_norm():
    # a bias only on the q rows moves q (through RoPE and the norm) and nothing else
    m = make_block(32, 2, 1, 16, "before_rope", True, 0.0)
    with torch.no_grad():
        m.qkv_bias.zero_()
    x = torch.randn(1, 3, 32)
    cos, sin = rope_cos_sin(1, 3, 16, torch.float32)
    q0, k0, v0 = m(x, cos, sin)
    with torch.no_grad():
        m.qkv_bias[: 2 * 16].fill_(3.0)
    q1, k1, v1 = m(x, cos, sin)
    assert torch.equal(k0, k1) and torch.equal(v0, v1) and not torch.allclose(q0, q1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pos", POSITIONS)
def test_bf16_three_way(pos, backend):
    """|ours - ref64| <= 2 |eager bf16 - ref64| + 1e-3 max|ref64|, outputs and every gradient;
    the bf16 norm weights of the offset form are formed as 1 + w in fp32 (HF Gemma3)."""
    m32 = make_block(32, 4, 2, 64, pos, True, 1.0, seed=4)
    m = like(m32, torch.bfloat16, GQAQKVRoPEQKNorm)
    x, cos, sin, grads = inputs(m, 2, 4, torch.bfloat16, seed=6)
    out, gr = run(m, x, cos, sin, grads, backend)
    for t in out + gr[:6]:
        assert t.dtype == torch.bfloat16
    out_e, gr_e = run(like(m, torch.bfloat16), x, cos, sin, grads)
    out64, gr64 = run(like(m, torch.float64), x.double(), cos.double(), sin.double(), grads)
    for n, a, e, r in zip(NAMES, out + gr, out_e + gr_e, out64 + gr64):
        e_ours = (a.double() - r).abs().max()
        e_eager = (e.double() - r).abs().max()
        assert e_ours <= 2 * e_eager + 1e-3 * r.abs().max(), (n, float(e_ours), float(e_eager))


def test_bias_gradient_is_deterministic_and_only_when_required():
    m = make_block(32, 4, 2, 16, "after_rope", True, 0.0)
    x = torch.randn(2, 7, 32)
    cos, sin = rope_cos_sin(2, 7, 16, torch.float32)
    grads = []
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        q, k, v = m(x, cos, sin)
        (q.pow(2).sum() + k.sum() + 3 * v.sum()).backward()
        grads.append(m.qkv_bias.grad.clone())
    assert torch.equal(grads[0], grads[1])
    # v's part of the bias gradient is dL/dv summed over batch and tokens: 3 * 2 * 7
    assert torch.equal(grads[0][-2 * 16:], torch.full((32,), 42.0))
    m.zero_grad(set_to_none=True)
    m.qkv_bias.requires_grad_(False)
    q, k, v = m(x, cos, sin)
    q.sum().backward()
    assert m.qkv_bias.grad is None and m.qkv_weight.grad is not None


def test_module_options_state_dict_and_init():
    m = GQAQKVRoPEQKNorm(48, 4, 2, 16, bias=True, norm_weight_offset=1.0)
    assert list(m.state_dict()) == ["qkv_weight", "qkv_bias", "q_norm_weight", "k_norm_weight"]
    assert m.qkv_bias.shape == (8 * 16,)
    # the offset form starts at an effective scale of 1, as Gemma3 (weights 0)
    assert torch.equal(m.q_norm_weight, torch.zeros(16)) and torch.equal(m.k_norm_weight, torch.zeros(16))
    assert "bias=True" in repr(m) and "norm_weight_offset=1.0" in repr(m)
    plain = GQAQKVRoPEQKNorm(48, 4, 2, 16)
    assert plain.qkv_bias is None and "qkv_bias" not in plain.state_dict()
    assert torch.equal(plain.q_norm_weight, torch.ones(16))
    r = ReferenceGQAQKVRoPEQKNorm(48, 4, 2, 16, bias=True, norm_weight_offset=1.0)
    r.load_state_dict(m.state_dict())


# --------------------------------------------------------------------------- custom ops / compile


def test_opcheck_custom_ops_with_bias():
    fwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_fwd.default
    bwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_bwd.default
    g = torch.Generator().manual_seed(0)
    B, S, H, hq, hkv, D = 2, 3, 16, 2, 1, 8
    x = torch.randn(B, S, H, generator=g)
    w = torch.randn((hq + 2 * hkv) * D, H, generator=g)
    bias = torch.randn((hq + 2 * hkv) * D, generator=g)
    wq, wk = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    cos, sin = rope_cos_sin(B, S, D, torch.float32)
    for nar in (True, False):
        args = (x, w, wq, wk, cos, sin, hq, hkv, 1e-6, nar, "auto", bias)
        torch.library.opcheck(fwd, args)
        q, k, qkv, rq, rk, _ = fwd(*args)
        assert torch.allclose(qkv, x @ w.t() + bias, atol=1e-6)
        gq, gk, gv = (torch.randn(t.shape, generator=g) for t in (q, k, k))
        out = bwd(gq, gk, gv, x, w, qkv, wq, wk, cos, sin, hq, hkv, 1e-6, nar, True, True, False, "auto", True)
        dqkv_v = gv.transpose(1, 2).reshape(B * S, hkv * D)
        assert torch.allclose(out[6][-hkv * D:], dqkv_v.sum(0), atol=1e-6)
        torch.library.opcheck(bwd, (gq, gk, gv, x, w, qkv, wq, wk, cos, sin, hq, hkv, 1e-6, nar,
                                    True, True, False, "auto", True))


def test_torch_compile_fullgraph_with_bias_and_offset():
    torch._dynamo.reset()
    m = TinyAttention(make_block(32, 4, 2, 16, "before_rope", True, 1.0))
    x = torch.randn(2, 6, 32, requires_grad=True)
    cos, sin = rope_cos_sin(2, 6, 16, torch.float32)
    y = torch.compile(m, fullgraph=True, backend="aot_eager")(x, cos, sin)  # raises on a graph break
    gc = torch.autograd.grad(y.square().sum(), [x, *m.parameters()])
    y2 = m(x, cos, sin)
    ge = torch.autograd.grad(y2.square().sum(), [x, *m.parameters()])
    assert torch.allclose(y, y2, rtol=1e-6, atol=1e-6)
    assert len(gc) == 6  # x, qkv_weight, qkv_bias, q/k norm weights, o
    for a, b in zip(gc, ge):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- validation


def _good():
    x = torch.randn(1, 3, 16)
    w = torch.randn(8 * 8, 16)
    cos, sin = rope_cos_sin(1, 3, 8, torch.float32)
    return dict(hidden_states=x, qkv_weight=w, q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8),
                cos=cos, sin=sin, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("change, exc, words", [
    (dict(qkv_bias=torch.randn(63)), ValueError, "qkv_bias"),
    (dict(qkv_bias=torch.randn(64, 1)), ValueError, "qkv_bias"),
    (dict(qkv_bias=torch.randn(64, dtype=torch.float64)), ValueError, "qkv_bias"),
    (dict(qkv_bias=[0.0] * 64), TypeError, "qkv_bias"),
    (dict(norm_weight_offset="1"), TypeError, "norm_weight_offset"),
    (dict(norm_weight_offset=float("inf")), ValueError, "norm_weight_offset"),
    (dict(norm_weight_offset=True), TypeError, "norm_weight_offset"),
])
def test_validation_names_the_argument(change, exc, words):
    kw = _good()
    kw.update(change)
    with pytest.raises(exc, match=words):
        gqa_qkv_rope_qk_norm(**kw)


def test_module_validation():
    with pytest.raises(TypeError, match="bias"):
        GQAQKVRoPEQKNorm(16, 2, 1, 8, bias=1)
    with pytest.raises(TypeError, match="norm_weight_offset"):
        GQAQKVRoPEQKNorm(16, 2, 1, 8, norm_weight_offset=None)
