"""The training-ready block (issue 4): gqa_qkv_rope_qk_norm / GQAQKVRoPEQKNorm against autograd
through the plain-PyTorch reference module in float64, for the CPU path and the Triton kernels
(interpreter), both norm positions, MHA/GQA/MQA, head_dim 64/128/256; bf16/fp16 by the
three-way rule; torch.compile(fullgraph=True); opcheck of the custom ops; validation."""

import pytest
import torch

import fusedqkv
from fusedqkv import GQAQKVRoPEQKNorm, ReferenceGQAQKVRoPEQKNorm, gqa_qkv_rope_qk_norm

from _oracle import TinyAttention

POSITIONS = ["after_rope", "before_rope"]


def rope_cos_sin(b, s, d, dtype, seed=0):
    """HF rotary embedding (NeoX rotate-half): cos/sin = cat(freqs, freqs), random positions."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.randint(0, 8192, (b, s), generator=g).double()
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_block(hidden, hq, hkv, d, pos, dtype, seed=0):
    torch.manual_seed(seed)
    m = GQAQKVRoPEQKNorm(hidden, hq, hkv, d, eps=1e-6, qk_norm_position=pos, dtype=dtype)
    with torch.no_grad():
        m.q_norm_weight.uniform_(0.5, 1.5)
        m.k_norm_weight.uniform_(0.5, 1.5)
    return m


def reference_like(m, dtype):
    r = ReferenceGQAQKVRoPEQKNorm(m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, eps=m.eps,
                                  qk_norm_position=m.qk_norm_position, dtype=dtype)
    r.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
    return r


def run(mod, x, cos, sin, grads, cos_sin_grad=False, backend=None):
    """outputs and gradients w.r.t. (x, qkv_weight, q_norm_weight, k_norm_weight[, cos, sin])."""
    x = x.detach().requires_grad_()
    cos = cos.detach().requires_grad_(cos_sin_grad)
    sin = sin.detach().requires_grad_(cos_sin_grad)
    if backend is not None:
        out = gqa_qkv_rope_qk_norm(x, mod.qkv_weight, mod.q_norm_weight, mod.k_norm_weight, cos, sin,
                                   num_heads=mod.num_heads, num_kv_heads=mod.num_kv_heads, eps=mod.eps,
                                   qk_norm_position=mod.qk_norm_position, backend=backend)
    else:
        out = mod(x, cos, sin)
    wrt = [x, mod.qkv_weight, mod.q_norm_weight, mod.k_norm_weight] + ([cos, sin] if cos_sin_grad else [])
    grads = [g.to(o.dtype) for g, o in zip(grads, out)]
    return list(out), list(torch.autograd.grad(out, wrt, grads))


def rel_err(a, ref):
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


NAMES = ["q", "k", "v", "grad_x", "grad_qkv_weight", "grad_q_norm_weight", "grad_k_norm_weight", "grad_cos", "grad_sin"]


def check_fp32(m, b, s, backend=None, cos_sin_grad=True, seed=0):
    d = m.head_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, m.hidden_size, generator=g)
    cos, sin = rope_cos_sin(b, s, d, torch.float32, seed)
    shapes = [(b, m.num_heads, s, d), (b, m.num_kv_heads, s, d), (b, m.num_kv_heads, s, d)]
    grads = [torch.randn(sh, generator=g, dtype=torch.float64) for sh in shapes]
    out, gr = run(m, x, cos, sin, grads, cos_sin_grad, backend)
    ref = reference_like(m, torch.float64)
    out64, gr64 = run(ref, x.double(), cos.double(), sin.double(), grads, cos_sin_grad)
    for o, o64 in zip(out, out64):
        assert o.dtype == torch.float32 and o.shape == o64.shape
    errs = {n: rel_err(a, r) for n, a, r in zip(NAMES, out + gr, out64 + gr64)}
    for n in NAMES[:3]:
        assert errs[n] < 1e-5, (n, errs)
    for n in NAMES[3:3 + len(gr)]:
        assert errs[n] < 1e-4, (n, errs)
    return out, gr


# (hidden, num_heads, num_kv_heads, head_dim, batch, seq): GQA 091-like ratio, MHA, MQA, odd hidden
CPU_CONFIGS = [
    (96, 8, 2, 64, 2, 7),     # GQA 4:1
    (72, 4, 4, 64, 1, 9),     # MHA, odd-ish hidden
    (64, 4, 1, 128, 2, 5),    # MQA (one KV head)
    (40, 2, 1, 256, 1, 6),    # head_dim 256
    (33, 6, 3, 128, 3, 3),    # hidden not a multiple of 8
]


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: "h{}_q{}_kv{}_d{}_b{}_s{}".format(*c))
def test_fp32_cpu_path_matches_float64_reference(cfg, pos):
    hidden, hq, hkv, d, b, s = cfg
    check_fp32(make_block(hidden, hq, hkv, d, pos, torch.float32), b, s)


# small shapes for the Triton interpreter: MHA/GQA/MQA, head_dim 64/128/256, an odd seq, batch > 1
INTERP_CONFIGS = [
    (32, 4, 2, 64, 2, 3),
    (24, 2, 1, 128, 1, 5),
    (16, 2, 2, 256, 1, 2),
]


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("cfg", INTERP_CONFIGS, ids=lambda c: "h{}_q{}_kv{}_d{}_b{}_s{}".format(*c))
def test_fp32_triton_kernels_match_float64_reference(cfg, pos):
    hidden, hq, hkv, d, b, s = cfg
    m = make_block(hidden, hq, hkv, d, pos, torch.float32, seed=1)
    out_t, gr_t = check_fp32(m, b, s, backend="triton", seed=3)
    out_c, gr_c = check_fp32(m, b, s, backend="torch", seed=3)
    for n, a, c in zip(NAMES, out_t + gr_t, out_c + gr_c):  # the two backends agree closely
        assert rel_err(a, c.double()) < 1e-5, n


def three_way(ours, eager, ref64, name, atol_rel=1e-3):
    e_ours = (ours.double() - ref64).abs().max()
    e_eager = (eager.double() - ref64).abs().max()
    atol = atol_rel * ref64.abs().max()
    assert e_ours <= 2 * e_eager + atol, (name, float(e_ours), float(e_eager), float(atol))


def check_low_precision(m32, b, s, dtype, backend=None, seed=0):
    """|ours - ref64| <= 2 |eager_lowp - ref64| + atol, outputs and all gradients."""
    d = m32.head_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, m32.hidden_size, generator=g).to(dtype)
    cos, sin = rope_cos_sin(b, s, d, dtype, seed)
    shapes = [(b, m32.num_heads, s, d), (b, m32.num_kv_heads, s, d), (b, m32.num_kv_heads, s, d)]
    grads = [torch.randn(sh, generator=g).to(dtype).double() for sh in shapes]
    m = make_block(m32.hidden_size, m32.num_heads, m32.num_kv_heads, d, m32.qk_norm_position, dtype)
    m.load_state_dict({k: v.to(dtype) for k, v in m32.state_dict().items()})
    out, gr = run(m, x, cos, sin, grads, True, backend)
    for o in out + gr[:4]:
        assert o.dtype == dtype
    eager = reference_like(m, dtype)
    out_e, gr_e = run(eager, x, cos, sin, grads, True)
    ref = reference_like(m, torch.float64)
    out64, gr64 = run(ref, x.double(), cos.double(), sin.double(), grads, True)
    for n, a, e, r in zip(NAMES, out + gr, out_e + gr_e, out64 + gr64):
        three_way(a, e, r, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("cfg", CPU_CONFIGS[:3], ids=lambda c: "h{}_q{}_kv{}_d{}_b{}_s{}".format(*c))
def test_low_precision_cpu_path_three_way(cfg, pos, dtype):
    hidden, hq, hkv, d, b, s = cfg
    check_low_precision(make_block(hidden, hq, hkv, d, pos, torch.float32, seed=2), b, s, dtype, seed=5)


@pytest.mark.parametrize("pos", POSITIONS)
def test_bf16_triton_kernels_three_way(pos):
    check_low_precision(make_block(32, 4, 2, 64, pos, torch.float32, seed=4), 2, 4, torch.bfloat16,
                        backend="triton", seed=6)


def test_bf16_triton_matches_cpu_path():
    m = make_block(32, 4, 1, 64, "after_rope", torch.float32).to(torch.bfloat16)
    x = torch.randn(1, 5, 32).to(torch.bfloat16)
    cos, sin = rope_cos_sin(1, 5, 64, torch.bfloat16)
    grads = [torch.randn(1, h, 5, 64).to(torch.bfloat16) for h in (4, 1, 1)]
    out_t, gr_t = run(m, x, cos, sin, grads, True, backend="triton")
    out_c, gr_c = run(m, x, cos, sin, grads, True, backend="torch")
    # the same math, one rounding: identical outputs up to an occasional last-bit difference
    for n, a, c in zip(NAMES, out_t + gr_t, out_c + gr_c):
        assert a.dtype == c.dtype, n
        diff = (a.float() - c.float()).abs()
        assert float(diff.max()) <= 2 ** -7 * float(c.float().abs().max()), n


PRODUCT_CHANGES = {
    # small tiles, fewer programs than tiles: several tiles a program, a partial last tile and K step
    "chain": dict(triton_products_in_interpreter=True, chain_min_balance=0.0, chain_dx=(16, 32, 32, 4, 2, 1),
                  chain_dw=(32, 64, 16, 4, 2, 1)),
    "hybrid": dict(triton_products_in_interpreter=True, chain_max_tokens=0, hybrid_max_tokens=1 << 20,
                   hybrid_dw=(32, 64, 16, 4, 2, 1)),
}
# the hybrid with its dW queued right behind the stage (the default above 1024 tokens), dX after it
PRODUCT_CHANGES["hybrid_dw_first"] = dict(PRODUCT_CHANGES["hybrid"], hybrid_dx_first_max_tokens=0)


def _training_backward_plan():
    from fusedqkv.ops import training_backward as TB

    return TB.PLANS.last()


@pytest.mark.parametrize("products,b,s,pos,bias", [
    (products, *shape) for products in ("chain", "hybrid") for shape in ((1, 7, "after_rope", False),
                                                                        (2, 5, "before_rope", True))]
    + [("hybrid_dw_first", 2, 5, "before_rope", True)])
def test_training_backward_triton_products_match_the_cublas_path(products, b, s, pos, bias):
    """The training backward's dX and dW as the 091 backward's Triton products behind the stage (the chain:
    both; the hybrid: dW behind dX on torch.mm, or right behind the stage with dX after it) give the
    torch-product path's gradients: the stage's outputs and
    torch.mm's dX bitwise, the Triton products within one bf16 rounding; repeated calls bitwise equal;
    ``training_triton_products=False`` keeps the cuBLAS path."""
    from fusedqkv.ops import config

    hidden, hq, hkv, d = 144, 4, 2, 32  # 144: a partial 128-wide tile
    m = make_block(hidden, hq, hkv, d, pos, torch.float32, seed=3).to(torch.bfloat16)
    m.qkv_bias = torch.nn.Parameter(torch.randn(m.qkv_weight.shape[0]).to(torch.bfloat16)) if bias else None
    g = torch.Generator().manual_seed(b * s)
    x = torch.randn(b, s, hidden, generator=g).to(torch.bfloat16)
    cos, sin = rope_cos_sin(b, s, d, torch.bfloat16, seed=s)
    grads = [torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]

    def fwd_bwd():
        xx = x.detach().requires_grad_()
        out = gqa_qkv_rope_qk_norm(xx, m.qkv_weight, m.q_norm_weight, m.k_norm_weight, cos, sin, num_heads=hq,
                                   num_kv_heads=hkv, eps=m.eps, qk_norm_position=pos, qkv_bias=m.qkv_bias,
                                   backend="triton")
        wrt = [xx, m.qkv_weight, m.q_norm_weight, m.k_norm_weight] + ([m.qkv_bias] if bias else [])
        return list(out) + list(torch.autograd.grad(out, wrt, grads))

    with config.override(**PRODUCT_CHANGES[products], training_triton_products=False):
        base = fwd_bwd()
        assert _training_backward_plan().path == "cublas"
    with config.override(**PRODUCT_CHANGES[products]):
        tri = fwd_bwd()
        plan = _training_backward_plan()
        again = fwd_bwd()
    assert plan.path == products.split("_")[0] and len(plan.products) == (2 if products == "chain" else 1)
    assert plan.dw_after_dx is (products == "hybrid")
    names = ["q", "k", "v", "grad_x", "grad_w", "grad_q_norm_weight", "grad_k_norm_weight"] + (["grad_bias"] if bias
                                                                                                 else [])
    for name, a, c in zip(names, tri, base):
        assert a.dtype == c.dtype and a.shape == c.shape, name
        if name == "grad_w" or (name == "grad_x" and products == "chain"):  # a Triton product: one bf16 rounding
            diff = (a.float() - c.float()).abs()
            assert float(diff.max()) <= 2 ** -7 * float(c.float().abs().max()), name
        else:
            assert torch.equal(a, c), name
    assert all(torch.equal(a, c) for a, c in zip(tri, again))


def test_training_backward_keeps_cublas_products_without_both_gradients():
    """A frozen weight (no dW) or no input gradient: the products stay torch's, whatever the rules allow."""
    from fusedqkv.ops import config

    m = make_block(144, 4, 2, 32, "after_rope", torch.float32, seed=1).to(torch.bfloat16)
    x = torch.randn(1, 6, 144).to(torch.bfloat16)
    cos, sin = rope_cos_sin(1, 6, 32, torch.bfloat16)
    grads = [torch.randn(1, h, 6, 32).to(torch.bfloat16) for h in (4, 2, 2)]
    m.qkv_weight.requires_grad_(False)
    with config.override(**PRODUCT_CHANGES["chain"]):
        xx = x.detach().requires_grad_()
        out = gqa_qkv_rope_qk_norm(xx, m.qkv_weight, m.q_norm_weight, m.k_norm_weight, cos, sin, num_heads=4,
                                   num_kv_heads=2, eps=m.eps, backend="triton")
        torch.autograd.grad(out, [xx], grads)
        assert _training_backward_plan().path == "cublas"


# --------------------------------------------------------------------------- autograd details


def test_cos_sin_grads_only_when_required_and_broadcast_cos():
    m = make_block(32, 4, 2, 64, "after_rope", torch.float32)
    x = torch.randn(2, 3, 32, requires_grad=True)
    cos, sin = rope_cos_sin(1, 3, 64, torch.float32)  # [1, seq, D], shared by the batch
    q, k, v = m(x, cos, sin)
    (q.sum() + k.pow(2).sum() + v.sum()).backward()  # stride-0 gradients from .sum()
    assert cos.grad is None and sin.grad is None
    assert x.grad is not None and m.qkv_weight.grad is not None and m.q_norm_weight.grad is not None
    cos_r, sin_r = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    x2 = x.detach().requires_grad_()
    q, k, v = m(x2, cos_r, sin_r)
    (q.sum() + k.pow(2).sum() + v.sum()).backward()
    ref = reference_like(m, torch.float64)
    c64, s64 = cos.double().requires_grad_(), sin.double().requires_grad_()
    q, k, v = ref(x.detach().double(), c64, s64)
    (q.sum() + k.pow(2).sum() + v.sum()).backward()
    assert cos_r.grad.shape == (1, 3, 64)
    assert rel_err(cos_r.grad, c64.grad) < 1e-4 and rel_err(sin_r.grad, s64.grad) < 1e-4
    assert rel_err(x2.grad, x.grad.double()) < 1e-6


def test_frozen_weight_and_no_input_grad():
    m = make_block(32, 4, 2, 64, "before_rope", torch.float32)
    m.qkv_weight.requires_grad_(False)
    x = torch.randn(1, 4, 32)
    cos, sin = rope_cos_sin(1, 4, 64, torch.float32)
    q, k, v = m(x, cos, sin)
    (q * k.repeat_interleave(2, dim=1)).sum().backward()
    assert m.qkv_weight.grad is None and m.q_norm_weight.grad is not None
    ref = reference_like(m, torch.float64)
    q, k, v = ref(x.double(), cos.double(), sin.double())
    (q * k.repeat_interleave(2, dim=1)).sum().backward()
    assert rel_err(m.q_norm_weight.grad, ref.q_norm_weight.grad) < 1e-4
    assert rel_err(m.k_norm_weight.grad, ref.k_norm_weight.grad) < 1e-4


def test_create_graph_gives_the_first_order_gradients_and_refuses_a_second_order():
    """backward(create_graph=True) through the block gives the gradients it gives without (bitwise), as
    tensors that require grad; a backward through them raises, naming the reason (the block's backward
    runs kernels and out= products, which build no graph: before, the first backward itself failed
    inside the CPU path's mm(out=))."""
    m = make_block(32, 4, 2, 64, "before_rope", torch.float32)
    cos, sin = rope_cos_sin(1, 4, 64, torch.float32)
    x0 = torch.randn(1, 4, 32)
    wrt_params = [m.qkv_weight, m.q_norm_weight, m.k_norm_weight]

    def first_order(create_graph):
        x = x0.clone().requires_grad_()
        q, k, v = m(x, cos, sin)
        loss = (q * k.repeat_interleave(2, dim=1)).sum() + v.square().sum()
        return torch.autograd.grad(loss, [x] + wrt_params, create_graph=create_graph)

    want, got = first_order(False), first_order(True)
    for a, b in zip(got, want):
        assert a.requires_grad and torch.equal(a.detach(), b)
    penalty = sum(g.square().sum() for g in got)
    with pytest.raises(RuntimeError, match="fused block's backward is not itself differentiable"):
        penalty.backward()


def test_weight_source_rebuilds_the_frozen_weight_in_the_backward():
    """qkv_weight_source (QLoRA's dequantized weight): the backward calls it once instead of
    keeping qkv_weight, with the same gradients; the forward's tensor may be overwritten meanwhile."""
    m = make_block(32, 4, 2, 16, "before_rope", torch.float32)
    w = m.qkv_weight.detach().clone()
    x = torch.randn(2, 5, 32, requires_grad=True)
    cos, sin = rope_cos_sin(2, 5, 16, torch.float32)
    kw = dict(num_heads=4, num_kv_heads=2, eps=1e-6, qk_norm_position="before_rope")
    want = torch.autograd.grad(gqa_qkv_rope_qk_norm(x, w, m.q_norm_weight, m.k_norm_weight, cos, sin, **kw)[0].sum(),
                               [x, m.q_norm_weight])
    scratch, calls, saved = w.clone(), [], []

    def source():
        calls.append(1)
        return scratch.copy_(w)

    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        q = gqa_qkv_rope_qk_norm(x, source(), m.q_norm_weight, m.k_norm_weight, cos, sin, qkv_weight_source=source,
                                 **kw)[0]
    assert scratch.data_ptr() not in saved
    scratch.zero_()  # another layer's weight in the workspace: the backward rebuilds its own
    got = torch.autograd.grad(q.sum(), [x, m.q_norm_weight])
    assert len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="qkv_weight_source: qkv_weight requires grad"):
        gqa_qkv_rope_qk_norm(x, m.qkv_weight, m.q_norm_weight, m.k_norm_weight, cos, sin,
                             qkv_weight_source=lambda: m.qkv_weight, **kw)


def test_outputs_layout_and_non_contiguous_input():
    m = make_block(32, 4, 2, 64, "after_rope", torch.float32)
    base = torch.randn(5, 2, 64)
    x = base[:, :, ::2].transpose(0, 1)  # [2, 5, 32], non-contiguous
    cos, sin = rope_cos_sin(2, 5, 64, torch.float32)
    q, k, v = m(x, cos, sin)
    assert q.shape == (2, 4, 5, 64) and k.shape == (2, 2, 5, 64) and v.shape == (2, 2, 5, 64)
    # token-major, as HF's q/k/v: [B, S, H, D] in memory
    for t in (q, k):
        assert t.transpose(1, 2).is_contiguous() and not t.is_contiguous()
    ref = reference_like(m, torch.float64)
    for a, r in zip((q, k, v), ref(x.double(), cos.double(), sin.double())):
        assert rel_err(a, r) < 1e-5
    with torch.no_grad():
        q2, _, _ = m(x.contiguous(), cos, sin)
    assert torch.equal(q, q2)


def test_state_dict_interchangeable_with_reference():
    m = GQAQKVRoPEQKNorm(48, 4, 2, 64)
    r = ReferenceGQAQKVRoPEQKNorm(48, 4, 2, 64)
    assert set(m.state_dict()) == set(r.state_dict()) == {"qkv_weight", "q_norm_weight", "k_norm_weight"}
    assert m.qkv_weight.shape == (8 * 64, 48)
    r.load_state_dict(m.state_dict())
    assert "qk_norm_position='after_rope'" in repr(m)


# --------------------------------------------------------------------------- torch.compile / custom ops


@pytest.mark.parametrize("pos", POSITIONS)
def test_torch_compile_fullgraph_no_graph_breaks(pos):
    torch._dynamo.reset()
    m = TinyAttention(make_block(32, 4, 2, 64, pos, torch.float32))
    x = torch.randn(2, 6, 32, requires_grad=True)
    cos, sin = rope_cos_sin(2, 6, 64, torch.float32)
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")  # raises on any graph break
    y = cm(x, cos, sin)
    gc = torch.autograd.grad(y.square().sum(), [x, *m.parameters()])
    y2 = m(x, cos, sin)
    ge = torch.autograd.grad(y2.square().sum(), [x, *m.parameters()])
    assert torch.allclose(y, y2, rtol=1e-6, atol=1e-6)
    for a, b in zip(gc, ge):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # the block reached the graph as our custom ops
    gm_ops = []

    def backend(gm, example_inputs):
        gm_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(m, fullgraph=True, backend=backend)(x, cos, sin)
    assert any("GQAQKVRoPEQKNormFunction" in t or "autograd_function_apply" in t or "fusedqkv" in t for t in gm_ops), gm_ops


class _EpsBlock(torch.nn.Module):
    def __init__(self, eps, tensors):
        super().__init__()
        self.eps, self.tensors = eps, tensors

    def forward(self, x):
        w, qw, kw, cos, sin = self.tensors
        return gqa_qkv_rope_qk_norm(x, w, qw, kw, cos, sin, num_heads=4, num_kv_heads=2, eps=self.eps)


def compiled_blocks_of_several_eps(device, dtype, backend):
    """Blocks of different eps compiled in one process (two models' attentions, each compiled with
    fullgraph=True): from the second on, torch.compile passes eps symbolically. Each call equals eager
    bitwise, outputs and the weight's gradient. (Before, the second compile failed: math.isfinite of the
    symbolic eps in the validation.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 64, generator=g).to(device, dtype)
    w = torch.randn(128, 64, generator=g).to(device, dtype).requires_grad_()
    qw, kw = (torch.rand(16, generator=g) + 0.5).to(device, dtype), (torch.rand(16, generator=g) + 0.5).to(device, dtype)
    cos, sin = (t.to(device) for t in rope_cos_sin(1, 8, 16, dtype))
    torch._dynamo.reset()
    for eps in (1e-6, 1e-12, 0.5):
        block = _EpsBlock(eps, (w, qw, kw, cos, sin))
        got = torch.compile(block, backend=backend, fullgraph=True)(x)
        sum(t.float().square().sum() for t in got).backward()
        g_got, w.grad = w.grad, None
        want = block(x)
        sum(t.float().square().sum() for t in want).backward()
        g_want, w.grad = w.grad, None
        assert all(torch.equal(a, b) for a, b in zip(got, want)), eps
        assert torch.equal(g_got, g_want), eps


def test_compiled_blocks_of_several_eps_in_one_process():
    compiled_blocks_of_several_eps("cpu", torch.float32, "aot_eager")


def _op_inputs(norm_after_rope=True):
    g = torch.Generator().manual_seed(0)
    B, S, H, hq, hkv, D = 2, 3, 16, 2, 1, 8
    x = torch.randn(B, S, H, generator=g)
    w = torch.randn((hq + 2 * hkv) * D, H, generator=g)
    wq, wk = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    cos, sin = rope_cos_sin(B, S, D, torch.float32)
    return (x, w, wq, wk, cos, sin, hq, hkv, 1e-6, norm_after_rope, "auto")


@pytest.mark.parametrize("norm_after_rope", [True, False])
def test_opcheck_custom_ops(norm_after_rope):
    fwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_fwd.default
    bwd = torch.ops.fusedqkv.gqa_qkv_rope_qk_norm_bwd.default
    args = _op_inputs(norm_after_rope)
    torch.library.opcheck(fwd, args)
    x, w, wq, wk, cos, sin, hq, hkv = args[:8]
    q, k, qkv, rq, rk, _ = fwd(*args)
    g = torch.Generator().manual_seed(1)
    gq, gk, gv = (torch.randn(t.shape, generator=g) for t in (q, k, k))
    for flags in [(True, True, True), (False, True, False), (True, False, False)]:
        torch.library.opcheck(bwd, (gq, gk, gv, x, w, qkv, wq, wk, cos, sin, hq, hkv, 1e-6, norm_after_rope,
                                    *flags, "auto"))


# --------------------------------------------------------------------------- validation


def _good():
    x = torch.randn(1, 3, 16)
    w = torch.randn(8 * 8, 16)
    cos, sin = rope_cos_sin(1, 3, 8, torch.float32)
    return dict(hidden_states=x, qkv_weight=w, q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8),
                cos=cos, sin=sin)


@pytest.mark.parametrize("change, exc, words", [
    (dict(hidden_states=torch.randn(3, 16)), ValueError, "hidden_states"),
    (dict(qkv_weight=torch.randn(63, 16)), ValueError, "qkv_weight"),
    (dict(qkv_weight=torch.randn(64, 15)), ValueError, "qkv_weight"),
    (dict(q_norm_weight=torch.ones(7)), ValueError, "q_norm_weight"),
    (dict(cos=torch.randn(1, 4, 8)), ValueError, "cos"),
    (dict(sin=torch.randn(2, 3, 8)), ValueError, "sin"),
    (dict(cos="nope"), TypeError, "cos"),
    (dict(hidden_states=torch.randn(1, 3, 16, dtype=torch.float64)), ValueError, "hidden_states"),
    (dict(hidden_states=torch.randn(1, 3, 16).half()), ValueError, "qkv_weight"),
    (dict(num_heads=3), ValueError, "num_heads"),
    (dict(num_heads=4.0), TypeError, "num_heads"),
    (dict(qk_norm_position="middle"), ValueError, "qk_norm_position"),
    (dict(eps=-1.0), ValueError, "eps"),
])
def test_validation_names_the_argument(change, exc, words):
    kw = _good()
    kw.update(num_heads=4, num_kv_heads=2)
    kw.update(change)
    with pytest.raises(exc, match=words):
        gqa_qkv_rope_qk_norm(**kw)


def test_exports():
    assert fusedqkv.gqa_qkv_rope_qk_norm is gqa_qkv_rope_qk_norm
    assert fusedqkv.GQAQKVRoPEQKNorm is GQAQKVRoPEQKNorm
    assert hasattr(fusedqkv, "gqa_qkv_rope_qk_norm_backward")


def test_torch_func_transforms_are_refused_with_the_reason():
    """torch.func's grad and vmap over the block (a functional_call of its parameters, or its input)
    raise naming the reason and the way out, where before grad's wrapped tensors failed in the plan's
    fingerprint ("Cannot access data pointer"); the reference module the message names takes them,
    and the first plan's repeat check does not let a wrapped call through."""
    from fusedqkv.ops.internals import FUNC_TRANSFORMS_REFUSED

    m = make_block(32, 4, 2, 16, "before_rope", torch.float32)
    r = reference_like(m, torch.float32)
    cos, sin = rope_cos_sin(1, 4, 16, torch.float32)
    x = torch.randn(1, 4, 32)
    m(x, cos, sin)  # a plan in the cache: its guards must not take the wrapped tensors

    def loss(mod, params, x):
        q, k, v = torch.func.functional_call(mod, params, (x, cos, sin))
        return q.square().sum() + k.sum() + v.sum()

    def params(mod):
        return {k: v.detach() for k, v in mod.named_parameters()}

    calls = {"grad of the parameters": lambda mod: torch.func.grad(lambda p: loss(mod, p, x))(params(mod)),
             "grad of the input": lambda mod: torch.func.grad(lambda t: loss(mod, params(mod), t))(x),
             "vmap": lambda mod: torch.func.vmap(lambda t: mod(t[None], cos, sin)[0])(x.expand(3, 4, 32))}
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as e:
            call(m)
        assert str(e.value) == FUNC_TRANSFORMS_REFUSED, name
        call(r)
    # a transform whose wrapped tensors do not reach the block: refused at the Function (as torch's apply
    # refuses it), not run
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda z: m(x, cos, sin)[0].sum() * z)(torch.tensor(1.0))


def test_forward_mode_ad_is_refused_with_the_reason():
    """Dual tensors (torch.autograd.forward_ad) into the block: refused naming forward-mode AD and the
    way out, where torch's own error named no library; the reference module computes the tangent."""
    import torch.autograd.forward_ad as fwAD
    from fusedqkv.ops.internals import FORWARD_AD_REFUSED

    m = make_block(32, 4, 2, 16, "before_rope", torch.float32)
    r = reference_like(m, torch.float32)
    cos, sin = rope_cos_sin(1, 4, 16, torch.float32)
    x, t = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    with fwAD.dual_level():
        assert fwAD.unpack_dual(r(fwAD.make_dual(x, t), cos, sin)[0]).tangent is not None
        with pytest.raises(RuntimeError) as e:
            m(fwAD.make_dual(x, t), cos, sin)
    assert str(e.value) == FORWARD_AD_REFUSED


def test_the_091_backward_refuses_a_transforms_tensors():
    """The 091 entry point under vmap: its plan's miss path names the transform, not a data pointer."""
    from _oracle import make_inputs

    args = make_inputs(1, 4, 2, 4, 16, hidden=32, dtype=torch.float32)
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    stacked = args[0].expand(2, *args[0].shape)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(lambda a: fusedqkv.gqa_qkv_rope_qk_norm_backward(a, *args[1:])[0])(stacked)


def test_the_091_backward_names_a_transform_whose_tensors_passed_the_guards(monkeypatch):
    """On the GPU the plan's guards took vmap's wrapped tensors and the run failed on a data pointer
    (session 46's device call 2): a run that fails with a transform's tensors among its inputs is
    refused naming the transform; any other failure keeps its own words."""
    from _oracle import make_inputs
    from fusedqkv.ops import backward_091

    args = make_inputs(1, 4, 2, 4, 16, hidden=32, dtype=torch.float32)
    call = fusedqkv.gqa_qkv_rope_qk_norm_backward
    call(*args)
    plan = backward_091.PLANS.last()

    def run(args, out):  # what the GPU plan's run met: an address of a tensor without storage
        return [t.data_ptr() for t in args[:13]]

    monkeypatch.setattr(backward_091.PLANS, "lookup", lambda *a: plan)
    monkeypatch.setattr(plan, "run", run)
    stacked = args[0].expand(2, *args[0].shape)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(lambda a: call(a, *args[1:])[0])(stacked)
    monkeypatch.setattr(plan, "run", lambda args, out: (_ for _ in ()).throw(RuntimeError("a launch failed")))
    with pytest.raises(RuntimeError, match="a launch failed"):
        call(*args)


def test_direct_apply_keeps_torch_semantics_where_it_steps_aside():
    """The Functions' apply without torch's Python layer (ops.internals.autograd_apply) is the
    public apply for a Function with setup_context, and under a functorch transform (where torch
    refuses a Function without setup_context, as it does through the public apply); elsewhere it
    computes the same values and gradients."""
    from fusedqkv.ops import internals

    class WithSetupContext(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, meta):
            return x * meta

        @staticmethod
        def backward(ctx, g):
            return g * 3, None

    assert internals.autograd_apply(WithSetupContext) == WithSetupContext.apply
    direct = internals.autograd_apply(Doubling)
    x = torch.randn(5, dtype=torch.float64)
    for apply in (Doubling.apply, direct):
        with pytest.raises(RuntimeError, match="setup_context"):
            torch.func.grad(lambda t: apply(t, 2.0).sum())(x)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda t: internals.autograd_apply(Doubling, refuse_transforms=True)(t, 2.0).sum())(x)
    got = []
    for apply in (Doubling.apply, direct):
        xr = x.clone().requires_grad_()
        y = apply(xr, 2.0)
        y.sum().backward()
        got.append((y.detach(), xr.grad, y.grad_fn.name()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]) and got[0][2] == got[1][2]
    assert torch.equal(got[1][1], torch.full_like(x, 3.0))
