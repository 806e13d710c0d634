"""Hostile inputs to the 091 backward: every bad argument raises ValueError/TypeError
naming the argument and the expectation, before any kernel runs, leaving out= untouched.

Table-driven: each case mutates a valid argument list (14 inputs + out) and states
the exception type and a regex the message must match (argument name first).
"""

import numpy as np
import pytest
import torch

import fusedqkv
from fusedqkv.ops import backward_091 as gqa_backward
from fusedqkv.ops import device as device_state

from _oracle import make_inputs

B, HQ, HKV, S, D, HID = 2, 4, 2, 3, 64, 32
I = {n: i for i, n in enumerate(gqa_backward.INPUT_NAMES)}  # noqa: E741
OUT = {n: i for i, n in enumerate(gqa_backward.OUTPUT_NAMES)}
bf = torch.bfloat16


def _valid():
    return make_inputs(B, HQ, HKV, S, D, hidden=HID)


def _out_like():
    return [torch.empty(s, dtype=dt) for s, dt in (
        ((B, S, HID), bf), ((B, S, D), bf), ((B, S, D), bf), (((HQ + 2 * HKV) * D, HID), bf), ((D,), bf), ((D,), bf))]


def setarg(name, fn):
    """A mutation of one input: fn(old_value, args) -> new value."""
    def mutate(args, out):
        args[I[name]] = fn(args[I[name]], args)
        return args, out
    return mutate


def setout(fn):
    def mutate(args, out):
        return args, fn(out if out is not None else _out_like(), args)
    return mutate


def both(mut_a, mut_b):
    def mutate(args, out):
        return mut_b(*mut_a(args, out))
    return mutate


def rn(*shape, dtype=bf):
    return torch.randn(*shape).to(dtype)


def _halves_of_one_buffer(o):
    """grad_cos and grad_sin as the two disjoint halves of one buffer: valid."""
    buf = torch.empty(2 * B * S * D, dtype=bf)
    return (o[0], buf[: B * S * D].view(B, S, D), buf[B * S * D:].view(B, S, D), o[3], o[4], o[5])


def out_set(i, value):
    def f(out, args):
        out = list(out)
        out[i] = value(out[i], args) if callable(value) else value
        return tuple(out)
    return f


# (id, mutation, exception type, message regex)
CASES = [
    # ---- not a tensor / not a number
    ("grad_query_list", setarg("grad_query", lambda t, a: t.tolist()), TypeError, r"^grad_query: expected a torch\.Tensor, got list"),
    ("qkv_weight_numpy", setarg("qkv_weight", lambda t, a: t.float().numpy()), TypeError, r"^qkv_weight: expected a torch\.Tensor, got ndarray"),
    ("q_norm_weight_none", setarg("q_norm_weight", lambda t, a: None), TypeError, r"^q_norm_weight: expected a torch\.Tensor, got NoneType"),
    ("k_rstd_float", setarg("k_rstd", lambda t, a: 0.5), TypeError, r"^k_rstd: expected a torch\.Tensor, got float"),
    ("cos_sparse", setarg("cos", lambda t, a: t.float().to_sparse().to(bf)), ValueError, r"^cos: expected a dense \(strided\) tensor"),
    ("eps_str", setarg("eps", lambda t, a: "1e-6"), TypeError, r"^eps: expected a real number, got str"),
    ("eps_none", setarg("eps", lambda t, a: None), TypeError, r"^eps: expected a real number, got NoneType"),
    ("eps_bool", setarg("eps", lambda t, a: True), TypeError, r"^eps: expected a real number, got bool"),
    ("eps_complex", setarg("eps", lambda t, a: 1e-6 + 0j), TypeError, r"^eps: expected a real number, got complex"),
    ("eps_bool_tensor", setarg("eps", lambda t, a: torch.tensor(True)), TypeError, r"^eps: expected a real number, got a tensor of dtype bool"),
    ("eps_tensor_2", setarg("eps", lambda t, a: torch.tensor([1e-6, 1e-6])), ValueError, r"^eps: expected a scalar, got a tensor of shape \[2\]"),
    ("eps_nan", setarg("eps", lambda t, a: float("nan")), ValueError, r"^eps: expected a finite number"),
    ("eps_inf", setarg("eps", lambda t, a: float("inf")), ValueError, r"^eps: expected a finite number"),
    ("eps_negative", setarg("eps", lambda t, a: -1e-6), ValueError, r"^eps: expected a number >= 0"),
    # ---- rank
    ("grad_query_rank3", setarg("grad_query", lambda t, a: t[0]), ValueError, r"^grad_query: expected a 4-d tensor \[batch, num_heads, seq, head_dim\], got shape \[4, 3, 64\]"),
    ("grad_key_rank5", setarg("grad_key", lambda t, a: t[None]), ValueError, r"^grad_key: expected a 4-d tensor"),
    ("hidden_states_rank2", setarg("hidden_states", lambda t, a: t.reshape(B * S, HID)), ValueError, r"^hidden_states: expected a 3-d tensor \[batch, seq, hidden_size\]"),
    ("cos_rank2", setarg("cos", lambda t, a: t[0]), ValueError, r"^cos: expected shape \[2, 3, 64\]"),
    ("q_norm_weight_rank2", setarg("q_norm_weight", lambda t, a: t[None]), ValueError, r"^q_norm_weight: expected shape \[64\] \(\[head_dim\]\), got \[1, 64\]"),
    ("q_rstd_rank2", setarg("q_rstd", lambda t, a: t[0, :, :, 0]), ValueError, r"^q_rstd: expected shape \[2, 4, 3, 1\]"),
    ("k_rstd_rank5", setarg("k_rstd", lambda t, a: t[..., None]), ValueError, r"^k_rstd: expected shape \[2, 2, 3, 1\]"),
    # ---- batch / seq / head_dim disagreeing between arguments
    ("grad_key_batch", setarg("grad_key", lambda t, a: t[:1]), ValueError, r"^grad_key: expected shape \[2, num_kv_heads, 3, 64\] \(batch, seq and head_dim of grad_query\)"),
    ("grad_key_seq", setarg("grad_key", lambda t, a: t[:, :, :2]), ValueError, r"^grad_key: expected shape \[2, num_kv_heads, 3, 64\]"),
    ("grad_key_head_dim", setarg("grad_key", lambda t, a: t[..., :32]), ValueError, r"^grad_key: expected shape \[2, num_kv_heads, 3, 64\]"),
    ("grad_value_kv_heads", setarg("grad_value", lambda t, a: rn(B, 1, S, D)), ValueError, r"^grad_value: expected shape \[2, 2, 3, 64\] \(like grad_key\)"),
    # grad_key is the odd one out (grad_value, key_pre_norm and k_rstd have 2 heads): named as such
    ("grad_key_kv_heads", setarg("grad_key", lambda t, a: rn(B, 1, S, D)), ValueError,
     r"^grad_key: expected shape \[2, 2, 3, 64\] \(num_kv_heads from grad_value and key_pre_norm and k_rstd\), got \[2, 1, 3, 64\]"),
    ("grad_value_seq", setarg("grad_value", lambda t, a: t[:, :, :1]), ValueError, r"^grad_value: expected shape \[2, 2, 3, 64\]"),
    ("query_pre_norm_heads", setarg("query_pre_norm", lambda t, a: t[:, :2]), ValueError, r"^query_pre_norm: expected shape \[2, 4, 3, 64\] \(like grad_query\)"),
    ("key_pre_norm_batch", setarg("key_pre_norm", lambda t, a: t[:1]), ValueError, r"^key_pre_norm: expected shape \[2, 2, 3, 64\] \(like grad_key\)"),
    ("hidden_states_batch", setarg("hidden_states", lambda t, a: t[:1]), ValueError, r"^hidden_states: expected shape \[2, 3, hidden_size\] \(batch and seq of grad_query\)"),
    ("hidden_states_seq", setarg("hidden_states", lambda t, a: rn(B, S + 1, HID)), ValueError, r"^hidden_states: expected shape \[2, 3, hidden_size\]"),
    ("cos_seq", setarg("cos", lambda t, a: t[:, :2]), ValueError, r"^cos: expected shape \[2, 3, 64\] \(\[batch, seq, head_dim\]\), got \[2, 2, 64\]"),
    ("sin_head_dim", setarg("sin", lambda t, a: rn(B, S, 2 * D)), ValueError, r"^sin: expected shape \[2, 3, 64\]"),
    ("k_norm_weight_size", setarg("k_norm_weight", lambda t, a: t[:32]), ValueError, r"^k_norm_weight: expected shape \[64\] \(\[head_dim\]\), got \[32\]"),
    ("q_rstd_heads", setarg("q_rstd", lambda t, a: a[I["k_rstd"]].clone()), ValueError, r"^q_rstd: expected shape \[2, 4, 3, 1\] \(\[batch, heads, seq, 1\]\), got \[2, 2, 3, 1\]"),
    ("k_rstd_last_dim", setarg("k_rstd", lambda t, a: t.expand(B, HKV, S, 2).clone()), ValueError, r"^k_rstd: expected shape \[2, 2, 3, 1\]"),
    ("k_rstd_3d_seq", setarg("k_rstd", lambda t, a: t[:, :, :2, 0]), ValueError, r"^k_rstd: expected shape \[2, 2, 3\] \(\[batch, heads, seq\]\)"),
    # grad_query is the odd one out (grad_key, grad_value and both pre-norm tensors agree): named, not grad_key
    ("grad_query_head_dim", setarg("grad_query", lambda t, a: t[..., :32]), ValueError,
     r"^grad_query: expected shape \[2, num_heads, 3, 64\] \(batch, seq and head_dim from grad_key, grad_value, query_pre_norm and key_pre_norm\), got \[2, 4, 3, 32\]"),
    ("grad_query_batch", setarg("grad_query", lambda t, a: t[:1]), ValueError, r"^grad_query: expected shape \[2, num_heads, 3, 64\] \(batch, seq and head_dim from"),
    ("grad_query_seq", setarg("grad_query", lambda t, a: t[:, :, :2]), ValueError, r"^grad_query: expected shape \[2, num_heads, 3, 64\]"),
    # a gradient one head off is named before the head configuration is checked ("3 is not divisible")
    ("grad_query_head_short", setarg("grad_query", lambda t, a: t[:, :3]), ValueError,
     r"^grad_query: expected shape \[2, 4, 3, 64\] \(num_heads from query_pre_norm and q_rstd\), got \[2, 3, 3, 64\]"),
    ("grad_key_head_long", setarg("grad_key", lambda t, a: rn(B, 3, S, D)), ValueError,
     r"^grad_key: expected shape \[2, 2, 3, 64\] \(num_kv_heads from grad_value and key_pre_norm and k_rstd\), got \[2, 3, 3, 64\]"),
    ("qkv_weight_head_long", setarg("qkv_weight", lambda t, a: rn((HQ + 2 * HKV + 1) * D, HID)), ValueError,
     r"^qkv_weight: expected shape \[512, 32\] .*got \[576, 32\] \(num_heads from grad_query, num_kv_heads from grad_key, head_dim from grad_query; its 576 rows are 9 heads, not 8\)"),
    # ---- head configuration
    ("heads_not_divisible", both(setarg("grad_key", lambda t, a: rn(B, 3, S, D)), setarg("grad_value", lambda t, a: rn(B, 3, S, D))),
     ValueError, r"^head configuration \(num_heads from grad_query\.shape\[1\], num_kv_heads from grad_key\.shape\[1\].*\): num_heads=4 is not divisible by num_kv_heads=3"),
    ("zero_query_heads", both(both(setarg("grad_query", lambda t, a: rn(B, 0, S, D)), setarg("query_pre_norm", lambda t, a: rn(B, 0, S, D))),
                              setarg("q_rstd", lambda t, a: rn(B, 0, S, 1))),
     ValueError, r"^head configuration \(.*grad_query.*\): num_heads=0 and num_kv_heads=2 must be >= 1"),
    ("odd_head_dim", both(setarg("grad_query", lambda t, a: rn(B, HQ, S, 63)), setarg("grad_key", lambda t, a: rn(B, HKV, S, 63))),
     ValueError, r"^head_dim \(.*grad_query.*\): 63 is not supported; expected an even size from 2 to 512"),
    ("head_dim_too_large", both(setarg("grad_query", lambda t, a: rn(B, HQ, S, 514)), setarg("grad_key", lambda t, a: rn(B, HKV, S, 514))),
     ValueError, r"^head_dim .*: 514 is not supported"),
    ("head_dim_zero", both(setarg("grad_query", lambda t, a: rn(B, HQ, S, 0)), setarg("grad_key", lambda t, a: rn(B, HKV, S, 0))),
     ValueError, r"^head_dim .*: 0 is not supported"),
    # ---- qkv_weight / hidden sizes that do not fit the heads
    ("qkv_weight_rows", setarg("qkv_weight", lambda t, a: t[:-D]), ValueError, r"^qkv_weight: expected shape \[512, 32\] \(\[\(num_heads \+ 2\*num_kv_heads\)\*head_dim, hidden_size\] = \[\(4 \+ 2\*2\)\*64, 32\]\), got \[448, 32\]"),
    ("qkv_weight_hidden", setarg("qkv_weight", lambda t, a: t[:, :16]), ValueError, r"^hidden_states / qkv_weight: hidden_states has hidden_size 32 .*but qkv_weight has 16 columns"),
    ("qkv_weight_transposed", setarg("qkv_weight", lambda t, a: t.t()), ValueError, r"^qkv_weight: expected shape \[512, 32\].*got \[32, 512\]"),
    ("hidden_states_hidden", setarg("hidden_states", lambda t, a: rn(B, S, 2 * HID)), ValueError, r"^hidden_states / qkv_weight: hidden_states has hidden_size 64 .*but qkv_weight has 32 columns"),
    # ---- dtypes
    ("grad_query_float64", setarg("grad_query", lambda t, a: t.double()), ValueError, r"^grad_query: dtype float64 is not supported; expected one of float32, bfloat16, float16"),
    ("qkv_weight_int", setarg("qkv_weight", lambda t, a: t.to(torch.int32)), ValueError, r"^qkv_weight: dtype int32 is not supported"),
    ("q_rstd_int", setarg("q_rstd", lambda t, a: t.to(torch.int64)), ValueError, r"^q_rstd: dtype int64 is not supported"),
    ("k_norm_weight_bool", setarg("k_norm_weight", lambda t, a: t > 1), ValueError, r"^k_norm_weight: dtype bool is not supported"),
    ("cos_complex", setarg("cos", lambda t, a: t.float().to(torch.complex64)), ValueError, r"^cos: dtype complex64 is not supported"),
    ("hidden_states_mixed", setarg("hidden_states", lambda t, a: t.float()), ValueError, r"^hidden_states: dtype float32 differs from grad_query's bfloat16; these arguments must share one dtype"),
    ("grad_value_mixed", setarg("grad_value", lambda t, a: t.half()), ValueError, r"^grad_value: dtype float16 differs from grad_query's bfloat16"),
    ("sin_mixed", setarg("sin", lambda t, a: t.float()), ValueError, r"^sin: dtype float32 differs"),
    ("qkv_weight_mixed", setarg("qkv_weight", lambda t, a: t.half()), ValueError, r"^qkv_weight: dtype float16 differs"),
    ("key_pre_norm_mixed", setarg("key_pre_norm", lambda t, a: t.float()), ValueError, r"^key_pre_norm: dtype float32 differs"),
    ("norm_weights_mixed", setarg("k_norm_weight", lambda t, a: t.float()), ValueError, r"^k_norm_weight: dtype float32 differs from q_norm_weight's bfloat16"),
    # ---- devices (meta stands in for a second device on a CPU-only machine)
    ("cos_other_device", setarg("cos", lambda t, a: t.to("meta")), ValueError, r"^cos: on device meta, but grad_query is on cpu; all tensors must be on one device"),
    ("k_rstd_other_device", setarg("k_rstd", lambda t, a: t.to("meta")), ValueError, r"^k_rstd: on device meta, but grad_query is on cpu"),
    ("qkv_weight_other_device", setarg("qkv_weight", lambda t, a: t.to("meta")), ValueError, r"^qkv_weight: on device meta"),
    # ---- out=
    ("out_tensor_not_tuple", setout(lambda o, a: o[0]), TypeError, r"^out: expected a tuple of 6 tensors, got Tensor"),
    ("out_five", setout(lambda o, a: tuple(o[:5])), ValueError, r"^out: expected 6 tensors \(grad_hidden_states, .*grad_k_norm_weight\), got 5"),
    ("out_non_tensor", setout(out_set(OUT["grad_sin"], None)), TypeError, r"^out\[grad_sin\]: expected a torch\.Tensor, got NoneType"),
    ("out_shape", setout(out_set(OUT["grad_cos"], lambda t, a: torch.empty(B, S + 1, D, dtype=bf))), ValueError, r"^out\[grad_cos\]: expected shape \[2, 3, 64\], got \[2, 4, 64\]"),
    ("out_weight_transposed", setout(out_set(OUT["grad_qkv_weight"], lambda t, a: torch.empty(HID, 512, dtype=bf))), ValueError, r"^out\[grad_qkv_weight\]: expected shape \[512, 32\]"),
    ("out_dtype", setout(out_set(OUT["grad_hidden_states"], lambda t, a: t.float())), ValueError, r"^out\[grad_hidden_states\]: expected dtype bfloat16, got float32"),
    ("out_norm_dtype", setout(out_set(OUT["grad_q_norm_weight"], lambda t, a: t.float())), ValueError, r"^out\[grad_q_norm_weight\]: expected dtype bfloat16, got float32"),
    ("out_device", setout(out_set(OUT["grad_k_norm_weight"], lambda t, a: t.to("meta"))), ValueError, r"^out\[grad_k_norm_weight\]: on device meta, expected cpu like the inputs"),
    ("out_sparse", setout(out_set(OUT["grad_q_norm_weight"], lambda t, a: torch.zeros(D).to_sparse().to(bf))), ValueError, r"^out\[grad_q_norm_weight\]: expected a dense"),
    ("out_expanded", setout(out_set(OUT["grad_cos"], lambda t, a: torch.empty(1, 1, D, dtype=bf).expand(B, S, D))), ValueError, r"^out\[grad_cos\]: has internally overlapping memory"),
    ("out_two_share", setout(lambda o, a: (o[0], o[1], o[1], o[3], o[4], o[5])), ValueError, r"^out\[grad_sin\]: shares memory with out\[grad_cos\]"),
    ("out_overlapping_views", setout(lambda o, a: _halves_of_one_buffer(o)), None, None),
    ("out_aliases_input", setout(out_set(OUT["grad_cos"], lambda t, a: a[I["cos"]])), ValueError, r"^out\[grad_cos\]: shares memory with the input cos"),
    ("out_aliases_input_view", setout(out_set(OUT["grad_q_norm_weight"], lambda t, a: a[I["grad_query"]][0, 0, 0])), ValueError, r"^out\[grad_q_norm_weight\]: shares memory with the input grad_query"),
]
# the 'out_overlapping_views' row is a valid call (disjoint halves of one buffer), kept as a control
VALID_CONTROLS = {"out_overlapping_views"}


def _build(case_mut, with_out):
    args = _valid()
    out = _out_like() if with_out else None
    args, out = case_mut(args, out)
    return args, out


@pytest.fixture
def no_compute(monkeypatch):
    """Any launch (Triton stage or GEMM) during a rejected call fails the test."""
    def boom(*a, **k):
        raise AssertionError("a kernel was launched before validation rejected the call")
    from fusedqkv.ops import backward_091, launch

    monkeypatch.setattr(launch.BoundLaunch, "launch", boom)
    monkeypatch.setattr(backward_091, "backward_torch", boom)
    monkeypatch.setattr(backward_091, "mm_into", boom)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] not in VALID_CONTROLS], ids=lambda c: c[0])
def test_bad_argument_raises_clear_error(case, backend, no_compute):
    cid, mut, exc, pattern = case
    uses_out = cid.startswith("out_")
    args, out = _build(mut, uses_out)
    kw = {"out": out} if uses_out else {}
    with pytest.raises(exc, match=pattern) as info:
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend, **kw)
    assert type(info.value) is exc  # not a subclass such as an internal error type
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 400, msg


def test_rejected_call_leaves_out_untouched():
    out = tuple(torch.full(t.shape, 7.0, dtype=t.dtype) for t in _out_like())
    args = _valid()
    args[I["sin"]] = args[I["sin"]].float()  # a dtype mismatch found after the shape checks
    with pytest.raises(ValueError, match="^sin:"):
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, out=out)
    assert all(bool((t == 7).all()) for t in out)


def test_valid_controls_pass():
    """The table's mutations are real: the unmutated call, and the valid control row, succeed."""
    args = _valid()
    ref = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    (cid, mut, _, _), = [c for c in CASES if c[0] in VALID_CONTROLS]
    args2, out = _build(mut, True)
    got = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args2, out=out)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


@pytest.mark.parametrize("eps", [0, 1e-6, np.float32(1e-5), np.float64(1e-6), torch.tensor(1e-6), torch.tensor([1e-6]),
                                 torch.tensor(0, dtype=torch.int64)], ids=repr)
def test_eps_accepts_real_scalars(eps):
    args = _valid()
    ref = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    args[I["eps"]] = eps
    got = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"^backend: expected 'triton', 'torch' or None, got 'cuda'"):
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*_valid(), backend="cuda")


def test_triton_backend_on_cpu_tensors_without_the_interpreter(monkeypatch):
    # a CPU process without TRITON_INTERPRET=1: a clear error at planning, not Triton's launcher
    # failing on the first CPU pointer
    from fusedqkv.ops import rope_qk_norm

    monkeypatch.setattr(rope_qk_norm, "INTERPRET", False)
    m = fusedqkv.GQAQKVRoPEQKNorm(32, 2, 1, 16)
    x = torch.randn(1, 4, 32)
    cos, sin = torch.ones(1, 4, 16), torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors.*cpu"):
        fusedqkv.gqa_qkv_rope_qk_norm(x, m.qkv_weight, m.q_norm_weight, m.k_norm_weight, cos, sin, num_heads=2,
                                      num_kv_heads=1, backend="triton")
    assert rope_qk_norm.pick_backend(torch.device("cpu"), "torch") == "torch"


def test_rstd_3d_and_fp32_norm_weights_accepted():
    """Relaxations the validator allows must compute the same thing."""
    a4 = make_inputs(B, HQ, HKV, S, D, hidden=HID, seed=3)
    a3 = make_inputs(B, HQ, HKV, S, D, hidden=HID, seed=3, rstd_3d=True)
    for backend in ("torch", "triton"):
        r4 = fusedqkv.gqa_qkv_rope_qk_norm_backward(*a4, backend=backend)
        r3 = fusedqkv.gqa_qkv_rope_qk_norm_backward(*a3, backend=backend)
        assert all(torch.equal(x, y) for x, y in zip(r4, r3))
    af = make_inputs(B, HQ, HKV, S, D, hidden=HID, seed=3, norm_dtype=torch.float32)
    rf = fusedqkv.gqa_qkv_rope_qk_norm_backward(*af)
    assert rf[4].dtype == torch.float32 and rf[5].dtype == torch.float32
    assert rf[0].dtype == bf


# ============================================================================ forward / module
# gqa_qkv_rope_qk_norm(hidden_states, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, *,
#                      num_heads, num_kv_heads, eps, qk_norm_position, backend)

FWD_POS = ("hidden_states", "qkv_weight", "q_norm_weight", "k_norm_weight", "cos", "sin")
FI = {n: i for i, n in enumerate(FWD_POS)}


def _fwd_valid():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(bf)  # noqa: E731
    args = [r(B, S, HID), r((HQ + 2 * HKV) * D, HID) * 0.1, torch.ones(D, dtype=bf), torch.ones(D, dtype=bf),
            r(B, S, D), r(B, S, D)]
    kw = dict(num_heads=HQ, num_kv_heads=HKV, eps=1e-6, qk_norm_position="after_rope")
    return args, kw


def fset(name, fn):
    def mutate(args, kw):
        if name in FI:
            args[FI[name]] = fn(args[FI[name]], args)
        else:
            kw[name] = fn(kw.get(name), args)
        return args, kw
    return mutate


FWD_CASES = [
    ("hidden_states_list", fset("hidden_states", lambda t, a: t.tolist()), TypeError, r"^hidden_states: expected a torch\.Tensor, got list"),
    ("qkv_weight_none", fset("qkv_weight", lambda t, a: None), TypeError, r"^qkv_weight: expected a torch\.Tensor"),
    ("cos_sparse", fset("cos", lambda t, a: t.float().to_sparse().to(bf)), ValueError, r"^cos: expected a dense"),
    ("num_heads_float", fset("num_heads", lambda v, a: 4.0), TypeError, r"^num_heads: expected an int, got float"),
    ("num_kv_heads_bool", fset("num_kv_heads", lambda v, a: True), TypeError, r"^num_kv_heads: expected an int, got bool"),
    ("num_heads_zero", fset("num_heads", lambda v, a: 0), ValueError, r"num_heads=0 and num_kv_heads=2 must be >= 1"),
    ("heads_not_divisible", both(fset("num_heads", lambda v, a: 3), fset("qkv_weight", lambda t, a: rn((3 + 2 * HKV) * D, HID))),
     ValueError, r"num_heads=3 is not divisible by num_kv_heads=2"),
    ("heads_dont_fit_weight", fset("num_kv_heads", lambda v, a: 1), ValueError,
     r"^qkv_weight: expected shape \[\(num_heads \+ 2\*num_kv_heads\)\*head_dim, hidden_size\] = \[\(4 \+ 2\*1\)\*64, 32\] = \[384, 32\] "
     r"\(head counts from num_heads=4 and num_kv_heads=1, head_dim from q_norm_weight and k_norm_weight \[64\].*got \[512, 32\]; its 512 rows are 8 heads of head_dim 64, not 6"),
    # issue 38: a qkv_weight one head short was reported as "q_norm_weight: expected shape [56]": the weight
    # is named, with the arguments that set the head counts (num_heads, num_kv_heads) and head_dim (the norm weights)
    ("qkv_weight_head_short", fset("qkv_weight", lambda t, a: t[:-D]), ValueError,
     r"^qkv_weight: expected shape .* = \[512, 32\] \(head counts from num_heads=4 and num_kv_heads=2, head_dim from "
     r"q_norm_weight and k_norm_weight \[64\] \(\[head_dim\]\)\), got \[448, 32\]; its 448 rows are 7 heads of head_dim 64, not 8$"),
    ("qkv_weight_head_long", fset("qkv_weight", lambda t, a: rn((HQ + 2 * HKV + 1) * D, HID)), ValueError,
     r"^qkv_weight: expected shape .* = \[512, 32\] \(head counts from num_heads=4 .*got \[576, 32\]; its 576 rows are 9 heads"),
    ("qkv_weight_head_short_unweighted", both(both(fset("q_norm_weight", lambda t, a: None), fset("k_norm_weight", lambda t, a: None)),
                                              fset("qkv_weight", lambda t, a: t[:-D])), ValueError,
     r"^qkv_weight / cos: qkv_weight's 448 rows give head_dim 56 \(448 / \(4 \+ 2\*2\) heads from num_heads and num_kv_heads\), "
     r"narrower than cos/sin's rotary width 64; expected qkv_weight \[512, 32\] for head_dim 64"),
    ("num_heads_one_more", fset("num_heads", lambda v, a: 5), ValueError,
     r"^qkv_weight: expected shape .* = \[\(5 \+ 2\*2\)\*64, 32\] = \[576, 32\] \(head counts from num_heads=5 and num_kv_heads=2.*got \[512, 32\]; its 512 rows are 8 heads"),
    ("all_heads_qkv_weight_head_short", both(both(fset("norm_scope", lambda v, a: "all_heads"),
                                                  fset("q_norm_weight", lambda t, a: torch.ones(HQ * D, dtype=bf))),
                                             both(fset("k_norm_weight", lambda t, a: torch.ones(HKV * D, dtype=bf)),
                                                  fset("qkv_weight", lambda t, a: t[:-D]))), ValueError,
     r"^qkv_weight: expected shape .*head_dim from q_norm_weight \[256\] and k_norm_weight \[128\] \(\[num_heads\*head_dim\], \[num_kv_heads\*head_dim\]\)\), got \[448, 32\]"),
    # head_dim 512 (Gemma 4's global layers) takes the per-head norm, not the all-heads one (its one-token tiles spill)
    ("all_heads_head_dim_512", both(both(fset("norm_scope", lambda v, a: "all_heads"),
                                         fset("q_norm_weight", lambda t, a: torch.ones(HQ * 512, dtype=bf))),
                                    both(fset("k_norm_weight", lambda t, a: torch.ones(HKV * 512, dtype=bf)),
                                         both(fset("qkv_weight", lambda t, a: rn((HQ + 2 * HKV) * 512, HID)),
                                              both(fset("cos", lambda t, a: rn(B, S, 512)),
                                                   fset("sin", lambda t, a: rn(B, S, 512)))))), ValueError,
     r"^head_dim \(from num_heads, num_kv_heads and qkv_weight\): 512 is not supported with norm_scope='all_heads'; "
     r"expected at most 256 \(norm_scope='head' takes up to 512\)$"),
    ("cos_head_dim", fset("cos", lambda t, a: rn(B, S, 32)), ValueError,
     r"^cos: expected shape \[2, 3, 64\] \(the rotary width of sin, head_dim from qkv_weight's 512 rows / 8 heads and from q_norm_weight"),
    ("hidden_states_seq", fset("hidden_states", lambda t, a: t[:, :2]), ValueError,
     r"^cos: expected shape \[2, 2, 64\] \(\[batch, seq, head_dim\] or \[1, seq, head_dim\], batch and seq from hidden_states\), got \[2, 3, 64\]"),
    ("odd_head_dim", both(fset("qkv_weight", lambda t, a: rn((HQ + 2 * HKV) * 63, HID)),
                          both(fset("q_norm_weight", lambda t, a: t[:63]), fset("k_norm_weight", lambda t, a: t[:63]))),
     ValueError, r"head_dim.*63 is not supported"),
    ("eps_negative", fset("eps", lambda v, a: -1.0), ValueError, r"^eps: "),
    ("eps_str", fset("eps", lambda v, a: "1e-6"), TypeError, r"^eps: expected a real number, got str"),
    ("eps_nan", fset("eps", lambda v, a: float("nan")), ValueError, r"^eps: "),
    ("eps_tensor_2", fset("eps", lambda v, a: torch.tensor([1e-6, 1e-6])), ValueError, r"^eps: expected a scalar"),
    ("position_unknown", fset("qk_norm_position", lambda v, a: "middle"), ValueError, r"^qk_norm_position: expected 'after_rope'"),
    ("position_bool", fset("qk_norm_position", lambda v, a: True), TypeError, r"^qk_norm_position: expected a str"),
    ("backend_unknown", fset("backend", lambda v, a: "cuda"), ValueError, r"^backend: expected 'triton', 'torch' or None"),
    ("hidden_states_rank2", fset("hidden_states", lambda t, a: t[0]), ValueError, r"^hidden_states: expected a 3-d tensor"),
    ("qkv_weight_rank3", fset("qkv_weight", lambda t, a: t[None]), ValueError, r"^qkv_weight: expected a 2-d tensor"),
    ("hidden_size_mismatch", fset("hidden_states", lambda t, a: rn(B, S, HID + 1)), ValueError, r"^hidden_states / qkv_weight: hidden_states has hidden_size 33 .*but qkv_weight has 32 columns"),
    ("q_norm_weight_size", fset("q_norm_weight", lambda t, a: t[:32]), ValueError, r"^q_norm_weight: expected shape \[64\]"),
    ("k_norm_weight_rank2", fset("k_norm_weight", lambda t, a: t[None]), ValueError, r"^k_norm_weight: expected shape \[64\]"),
    ("cos_seq", fset("cos", lambda t, a: t[:, :2]), ValueError, r"^cos: expected shape \[2, 3, 64\] \(\[batch, seq, head_dim\] or \[1, seq, head_dim\], batch and seq from hidden_states\)"),
    ("sin_rank2", fset("sin", lambda t, a: t[0]), ValueError, r"^sin: expected a 3-d tensor"),
    ("sin_head_dim", fset("sin", lambda t, a: rn(B, S, 32)), ValueError, r"^sin: expected shape \[2, 3, 64\]"),
    ("hidden_states_float64", fset("hidden_states", lambda t, a: t.double()), ValueError, r"^hidden_states: dtype float64 is not supported"),
    ("q_norm_weight_int", fset("q_norm_weight", lambda t, a: t.long()), ValueError, r"^q_norm_weight: dtype int64 is not supported"),
    ("cos_mixed", fset("cos", lambda t, a: t.float()), ValueError, r"^cos: dtype float32 differs from hidden_states's bfloat16"),
    ("qkv_weight_mixed", fset("qkv_weight", lambda t, a: t.half()), ValueError, r"^qkv_weight: dtype float16 differs"),
    ("sin_other_device", fset("sin", lambda t, a: t.to("meta")), ValueError, r"^sin: on device meta, but hidden_states is on cpu"),
    ("k_norm_weight_other_device", fset("k_norm_weight", lambda t, a: t.to("meta")), ValueError, r"^k_norm_weight: on device meta"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: c[0])
def test_forward_bad_argument_raises_clear_error(case, backend):
    cid, mut, exc, pattern = case
    args, kw = _fwd_valid()
    kw["backend"] = backend
    args, kw = mut(args, kw)
    with pytest.raises(exc, match=pattern) as info:
        fusedqkv.gqa_qkv_rope_qk_norm(*args, **kw)
    assert type(info.value) is exc
    assert "\n" not in str(info.value)


# a plan in the cache must not take a call that validation refuses: 4.0 heads, a one-element tensor, q_gate=1
# compare equal to a cached plan's 4 and True (found in session 36: they ran on it after one valid call)
SCALAR_CASES = [
    ("num_heads_float", dict(num_heads=4.0), r"^num_heads: expected an int, got float$"),
    ("num_heads_tensor", dict(num_heads=torch.tensor(HQ)), r"^num_heads: expected an int, got Tensor$"),
    ("num_kv_heads_float", dict(num_kv_heads=2.0), r"^num_kv_heads: expected an int, got float$"),
    ("q_gate_int", dict(q_gate=0), r"^q_gate: expected a bool, got int$"),
    ("v_norm_int", dict(v_norm=0), r"^v_norm: expected a bool, got int$"),
    ("k_eq_v_int", dict(k_eq_v=0), r"^k_eq_v: expected a bool, got int$"),
]


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "after_a_valid_call"])
@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c[0])
def test_forward_scalar_refusals_do_not_depend_on_the_plan_cache(case, warm):
    cid, over, pattern = case
    args, kw = _fwd_valid()
    kw["backend"] = "torch"
    device_state.clear()  # no plan from an earlier test
    if warm:
        fusedqkv.gqa_qkv_rope_qk_norm(*args, **kw)
    with pytest.raises(TypeError, match=pattern):
        fusedqkv.gqa_qkv_rope_qk_norm(*args, **dict(kw, **over))


def test_forward_numpy_integers_are_counts():
    args, kw = _fwd_valid()
    kw["backend"] = "torch"
    want = fusedqkv.gqa_qkv_rope_qk_norm(*args, **kw)
    got = fusedqkv.gqa_qkv_rope_qk_norm(*args, **dict(kw, num_heads=np.int64(HQ), num_kv_heads=np.int32(HKV)))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("eps", [np.float64(1e-6), torch.tensor(1e-6, dtype=torch.float64)], ids=["numpy", "tensor"])
def test_forward_eps_of_another_type_is_read_once_and_planned(eps):
    from fusedqkv.ops import training_forward

    args, kw = _fwd_valid()
    kw["backend"] = "torch"
    want = fusedqkv.gqa_qkv_rope_qk_norm(*args, **kw)
    device_state.clear()
    builds = training_forward.PLANS.builds
    for _ in range(3):
        got = fusedqkv.gqa_qkv_rope_qk_norm(*args, **dict(kw, eps=eps))
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    assert training_forward.PLANS.builds - builds == 1  # (it built a plan every call, outside the cache)


def test_forward_table_control():
    args, kw = _fwd_valid()
    q, k, v = fusedqkv.gqa_qkv_rope_qk_norm(*args, **kw)
    assert q.shape == (B, HQ, S, D) and k.shape == (B, HKV, S, D) and v.shape == (B, HKV, S, D)


MODULE_CASES = [
    (dict(hidden_size=0), ValueError, r"^hidden_size: expected a positive int, got 0"),
    (dict(hidden_size=32.0), ValueError, r"^hidden_size: expected a positive int"),
    (dict(num_heads=4.0), TypeError, r"^num_heads: expected an int, got float"),
    (dict(num_kv_heads="2"), TypeError, r"^num_kv_heads: expected an int, got str"),
    (dict(head_dim="64"), TypeError, r"^head_dim: expected an int, got str"),
    (dict(num_heads=6, num_kv_heads=4), ValueError, r"num_heads=6 is not divisible by num_kv_heads=4"),
    (dict(head_dim=65), ValueError, r"head_dim.*65 is not supported"),
    (dict(head_dim=514), ValueError, r"head_dim.*514 is not supported"),
    (dict(head_dim=512, norm_scope="all_heads"), ValueError,
     r"^head_dim: 512 is not supported with norm_scope='all_heads'; expected at most 256"),
    (dict(eps=-1e-6), ValueError, r"^eps: expected a number >= 0"),
    (dict(eps=None), TypeError, r"^eps: expected a real number"),
    (dict(qk_norm_position="pre"), ValueError, r"^qk_norm_position: expected 'after_rope'"),
]


@pytest.mark.parametrize("case", MODULE_CASES, ids=lambda c: "_".join(f"{k}={v!r}" for k, v in c[0].items()))
def test_module_constructor_bad_argument(case):
    over, exc, pattern = case
    kw = dict(hidden_size=HID, num_heads=HQ, num_kv_heads=HKV, head_dim=D, eps=1e-6, qk_norm_position="after_rope")
    kw.update(over)
    with pytest.raises(exc, match=pattern):
        fusedqkv.GQAQKVRoPEQKNorm(**kw)


@pytest.mark.parametrize("case", [
    ("hidden_states_hidden", lambda x, c, s: (rn(B, S, HID * 2), c, s), ValueError, r"^hidden_states / qkv_weight: hidden_states has hidden_size 64 .*but qkv_weight has 32 columns"),
    ("hidden_states_dtype", lambda x, c, s: (x.float(), c, s), ValueError, r"^qkv_weight: dtype bfloat16 differs from hidden_states's float32"),
    ("hidden_states_tuple", lambda x, c, s: ((x,), c, s), TypeError, r"^hidden_states: expected a torch\.Tensor, got tuple"),
    ("cos_batch", lambda x, c, s: (x, rn(B + 1, S, D), s), ValueError, r"^cos: expected shape \[2, 3, 64\]"),
    ("sin_missing_batch", lambda x, c, s: (x, c, s[0]), ValueError, r"^sin: expected a 3-d tensor"),
], ids=lambda c: c[0])
def test_module_forward_bad_argument(case):
    cid, mut, exc, pattern = case
    m = fusedqkv.GQAQKVRoPEQKNorm(HID, HQ, HKV, D, dtype=bf)
    args, _ = _fwd_valid()
    x, c, s = mut(args[0], args[4], args[5])
    with pytest.raises(exc, match=pattern):
        m(x, c, s)
