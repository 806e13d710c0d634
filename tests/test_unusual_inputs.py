"""Valid but unusual input to the 091 backward gets the right answer, on both backends
(CPU path and Triton kernel through the interpreter):

* non-contiguous and strided views -- HF's transposed q/k/v storage, a transposed
  weight, cos/sin broadcast over the batch (stride 0), stride-0 gradients from
  ``.sum()``, a strided last dim -- give exactly the contiguous-input result;
* strided ``out=`` destinations;
* zero-size batch or sequence: right shapes, zero weight gradients;
* sequence length 1;
* NaN/Inf propagate as in the reference (same non-finite positions, no silent zeros).
"""

import pytest
import torch

import fusedqkv
from fusedqkv.ops import backward_091 as gqa_backward

from _oracle import OUTPUT_NAMES, assert_matches_oracle, make_inputs, oracle_backward

I = {n: i for i, n in enumerate(gqa_backward.INPUT_NAMES)}  # noqa: E741
BACKENDS = ["torch", "triton"]
bw = fusedqkv.gqa_qkv_rope_qk_norm_backward


def _assert_equal(got, ref, label=""):
    for name, g, r in zip(OUTPUT_NAMES, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (label, name)
        assert torch.equal(g, r), (label, name, float((g.float() - r.float()).abs().max()))


def _hf_layout(t):
    """Same values, stored [batch, seq, heads, head_dim] and viewed as [batch, heads, seq, head_dim]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _strided_last(t):
    """Same values with last-dim stride 2 (every other element of a wider buffer)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def _views(args):
    """(label, transformed args) pairs: same values, unusual strides."""
    a = list(args)
    out = []

    hf = list(a)
    for n in ("grad_query", "grad_key", "grad_value", "query_pre_norm", "key_pre_norm"):
        hf[I[n]] = _hf_layout(a[I[n]])
    out.append(("hf_transposed_qkv", hf))

    t = list(a)
    t[I["qkv_weight"]] = a[I["qkv_weight"]].t().contiguous().t()  # column-major weight
    t[I["hidden_states"]] = a[I["hidden_states"]].transpose(0, 1).contiguous().transpose(0, 1)
    t[I["q_rstd"]] = a[I["q_rstd"]].transpose(1, 2).contiguous().transpose(1, 2)
    t[I["k_rstd"]] = a[I["k_rstd"]].transpose(0, 2).contiguous().transpose(0, 2)
    out.append(("transposed_weight_hidden_rstd", t))

    s = list(a)
    for n in ("grad_query", "key_pre_norm", "cos", "sin", "q_norm_weight", "grad_value"):
        s[I[n]] = _strided_last(a[I[n]])
    out.append(("strided_last_dim", s))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 64), (3, 2, 1, 3, 128)], ids=lambda s: "b{}_h{}_kv{}_s{}_d{}".format(*s))
def test_non_contiguous_inputs_equal_contiguous(shape, backend):
    args = make_inputs(*shape, seed=11)
    ref = bw(*args, backend=backend)
    for label, v in _views(args):
        for x, y in zip(v, args):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
        assert any(isinstance(x, torch.Tensor) and not x.is_contiguous() for x in v), label
        _assert_equal(bw(*v, backend=backend), ref, label)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_stride0_inputs(backend):
    """cos/sin broadcast over the batch and a gradient from ``.sum()`` (all strides 0)."""
    b, hq, hkv, s, d = 3, 4, 2, 4, 64
    args = make_inputs(b, hq, hkv, s, d, seed=5)
    args[I["cos"]] = args[I["cos"]][:1].expand(b, s, d)
    args[I["sin"]] = args[I["sin"]][:1].expand(b, s, d)
    args[I["grad_value"]] = torch.ones((), dtype=torch.bfloat16).expand(b, hkv, s, d)
    args[I["grad_query"]] = torch.full((), 0.5, dtype=torch.bfloat16).expand(b, hq, s, d)
    dense = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in args]
    _assert_equal(bw(*args, backend=backend), bw(*dense, backend=backend))
    assert_matches_oracle(bw(*dense, backend=backend), oracle_backward(*dense))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_out_destinations(backend):
    b, hq, hkv, s, d, hid = 2, 4, 2, 3, 64, 32
    args = make_inputs(b, hq, hkv, s, d, hidden=hid, seed=2)
    ref = bw(*args, backend=backend)
    qkv = (hq + 2 * hkv) * d
    bf = torch.bfloat16
    out = (
        torch.empty(hid, s, b, dtype=bf).permute(2, 1, 0),        # grad_hidden_states, transposed storage
        torch.empty(b, s, 2 * d, dtype=bf)[..., ::2],              # grad_cos, strided last dim
        torch.empty(s, b, d, dtype=bf).transpose(0, 1),            # grad_sin
        torch.empty(hid, qkv, dtype=bf).t(),                       # grad_qkv_weight, column-major
        torch.empty(2 * d, dtype=bf)[::2],                         # grad_q_norm_weight, stride 2
        torch.empty(d, 3, dtype=bf)[:, 1],                         # grad_k_norm_weight, stride 3
    )
    got = bw(*args, out=out, backend=backend)
    assert all(g is o for g, o in zip(got, out))
    _assert_equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [(0, 5), (2, 0), (0, 0)], ids=["batch0", "seq0", "both0"])
def test_zero_size_batch_or_seq(bs, backend):
    b, s = bs
    hq, hkv, d, hid = 4, 2, 64, 32
    args = make_inputs(b, hq, hkv, s, d, hidden=hid)
    out = bw(*args, backend=backend)
    ref = oracle_backward(*args)
    assert_matches_oracle(out, ref)
    assert out[3].shape == ((hq + 2 * hkv) * d, hid) and not bool(out[3].any())
    assert not bool(out[4].any()) and not bool(out[5].any())
    # into destinations that hold garbage: the weight gradients must be overwritten with zeros
    dest = tuple(torch.full(t.shape, float("nan"), dtype=t.dtype) for t in ref)
    assert_matches_oracle(bw(*args, out=dest, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 64), (4, 2, 1, 1, 128), (1, 1, 1, 1, 64)],
                         ids=lambda s: "b{}_h{}_kv{}_s{}_d{}".format(*s))
def test_sequence_length_one(shape, backend):
    args = make_inputs(*shape, seed=4)
    assert_matches_oracle(bw(*args, backend=backend), oracle_backward(*args))


def _nonfinite_cases():
    nan, inf = float("nan"), float("inf")
    return [
        ("grad_query", (1, 2, 3, 5), nan),
        ("grad_key", (0, 1, 0, 63), inf),
        ("grad_value", (1, 0, 2, 7), -inf),
        ("query_pre_norm", (0, 3, 1, 0), inf),
        ("key_pre_norm", (1, 1, 3, 33), nan),
        ("hidden_states", (0, 2, 9), nan),
        ("qkv_weight", (70, 4), inf),
        ("cos", (1, 0, 40), nan),
        ("sin", (0, 3, 2), inf),
        ("q_norm_weight", (17,), nan),
        ("k_norm_weight", (5,), inf),
        ("q_rstd", (0, 1, 2, 0), nan),
        ("k_rstd", (1, 1, 0, 0), inf),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _nonfinite_cases(), ids=lambda c: f"{c[0]}_{c[2]}")
def test_nan_inf_propagate_like_reference(case, backend):
    name, idx, value = case
    args = make_inputs(2, 4, 2, 4, 64, hidden=16, seed=9)
    args[I[name]] = args[I[name]].clone()
    args[I[name]][idx] = value
    ref = oracle_backward(*args)
    got = bw(*args, backend=backend)
    touched = False
    for oname, g, r in zip(OUTPUT_NAMES, got, ref):
        assert torch.equal(torch.isnan(g), torch.isnan(r)), (oname, int(torch.isnan(g).sum()), int(torch.isnan(r).sum()))
        assert torch.equal(torch.isposinf(g), torch.isposinf(r)), oname
        assert torch.equal(torch.isneginf(g), torch.isneginf(r)), oname
        fin = torch.isfinite(r)
        touched |= not bool(fin.all())
        # finite entries keep their values: nothing is zeroed or skipped
        assert torch.equal(g[fin], r[fin]) or torch.allclose(g[fin].float(), r[fin].float(), rtol=2 ** -7, atol=1e-6), oname
    assert touched, "the injected value reached no output (test would be vacuous)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_that_require_grad(backend):
    """Tensors that carry autograd history (e.g. saved activations) are accepted."""
    args = make_inputs(1, 4, 2, 3, 64, seed=8)
    ref = bw(*args, backend=backend)
    rg = [x.clone().requires_grad_() if isinstance(x, torch.Tensor) else x for x in args]
    _assert_equal(bw(*rg, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode(backend):
    args = make_inputs(1, 4, 2, 3, 64, seed=8)
    ref = bw(*args, backend=backend)
    with torch.inference_mode():
        inf_args = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        _assert_equal(bw(*inf_args, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bs", [(0, 5), (2, 0)], ids=["batch0", "seq0"])
def test_forward_and_backward_of_the_block_with_zero_tokens(bs, backend):
    import fusedqkv

    b, s = bs
    hq, hkv, d, hid = 4, 2, 64, 32
    x = torch.randn(b, s, hid, requires_grad=True)
    w = (torch.randn((hq + 2 * hkv) * d, hid) / hid ** 0.5).requires_grad_()
    wq = torch.ones(d, requires_grad=True)
    wk = torch.ones(d, requires_grad=True)
    ang = torch.randn(b, s, d)
    q, k, v = fusedqkv.gqa_qkv_rope_qk_norm(x, w, wq, wk, ang.cos(), ang.sin(), num_heads=hq, num_kv_heads=hkv,
                                             backend=backend)
    assert q.shape == (b, hq, s, d) and k.shape == (b, hkv, s, d) and v.shape == (b, hkv, s, d)
    (q.sum() + k.sum() + v.sum()).backward()
    assert x.grad.shape == x.shape
    for p in (w, wq, wk):
        assert p.grad is not None and p.grad.shape == p.shape and not bool(p.grad.any())


def _block_inputs(b=2, s=5, hid=32, hq=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, hid, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, hid, generator=g) / hid ** 0.5
    wq = 1 + 0.1 * torch.randn(d, generator=g)
    wk = 1 + 0.1 * torch.randn(d, generator=g)
    ang = torch.randn(b, s, d, generator=g)
    return x, w, wq, wk, ang.cos(), ang.sin(), hq, hkv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", ["after_rope", "before_rope"])
def test_forward_strided_views_equal_contiguous(backend, position):
    import fusedqkv

    x, w, wq, wk, cos, sin, hq, hkv = _block_inputs()
    ref = fusedqkv.gqa_qkv_rope_qk_norm(x, w, wq, wk, cos, sin, num_heads=hq, num_kv_heads=hkv,
                                         qk_norm_position=position, backend=backend)
    # [seq, batch, hidden] storage seen as [batch, seq, hidden]; a transposed weight; cos/sin
    # with a strided head_dim
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    wt = w.t().contiguous().t()
    cos2 = torch.stack((cos, cos), dim=-1)[..., 0]
    sin2 = torch.stack((sin, sin), dim=-1)[..., 0]
    assert not xt.is_contiguous() and not wt.is_contiguous() and cos2.stride(-1) == 2
    got = fusedqkv.gqa_qkv_rope_qk_norm(xt, wt, wq, wk, cos2, sin2, num_heads=hq, num_kv_heads=hkv,
                                         qk_norm_position=position, backend=backend)
    # the projection GEMM may pick another kernel for transposed operands: fp32-level
    # differences only (a stride bug would show as O(1) errors)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_forward_non_finite_input_propagates_like_reference(backend, bad):
    import fusedqkv

    x, w, wq, wk, cos, sin, hq, hkv = _block_inputs()
    x[1, 3, 7] = bad  # one token of one sequence
    ref_mod = fusedqkv.ReferenceGQAQKVRoPEQKNorm(x.shape[-1], hq, hkv, 64)
    with torch.no_grad():
        ref_mod.qkv_weight.copy_(w)
        ref_mod.q_norm_weight.copy_(wq)
        ref_mod.k_norm_weight.copy_(wk)
        ref = ref_mod(x, cos, sin)
    got = fusedqkv.gqa_qkv_rope_qk_norm(x, w, wq, wk, cos, sin, num_heads=hq, num_kv_heads=hkv, backend=backend)
    for a, b in zip(got, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        assert not bool(torch.isfinite(a[1, :, 3]).all())  # the bad token is not silently zeroed
        fin = torch.isfinite(b)
        assert torch.allclose(a[fin], b[fin], rtol=1e-4, atol=1e-5)
