"""Plans: built once per input signature, never reused for a call they don't fit.

A repeated call hits the plan cache (its build counter does not move); a changed stride,
dtype, shape, config, eps or destination-passing mode builds a new plan; a call with
destinations aliasing an input is refused even on a cached plan; and the generated raw
enqueue passes exactly the arguments the template says.
"""

import itertools
import random

import pytest
import torch

import fusedqkv
from fusedqkv.ops import backward_091, config, internals, launch, validation

from _oracle import make_inputs
from _fp8_cpu import needs_cpu_row_scales


def _args():
    return make_inputs(1, 4, 2, 5, 64, hidden=64, seed=1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_repeated_call_hits_the_plan_cache(backend):
    cache = backward_091.PLANS
    args = _args()
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend)
    builds, misses = cache.builds, cache.misses
    first = fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend)
    # fresh tensors of the same signature: still the cached plan
    again = fusedqkv.gqa_qkv_rope_qk_norm_backward(*[a.clone() if torch.is_tensor(a) else a for a in args],
                                                   backend=backend)
    assert (cache.builds, cache.misses) == (builds, misses)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def _variants(args):
    """(name, mutated args): each differs from ``args`` in one thing a plan depends on."""
    gq = args[0]
    yield "stride", [gq.transpose(2, 3).contiguous().transpose(2, 3)] + args[1:]
    yield "dtype", [a.half() if torch.is_tensor(a) and a.dtype == torch.bfloat16 else a for a in args]
    yield "shape", make_inputs(1, 4, 2, 6, 64, hidden=64, seed=1)
    yield "eps", args[:13] + [args[13] * 2]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_changed_signature_builds_a_new_plan_with_the_right_result(backend):
    cache = backward_091.PLANS
    args = _args()
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend)
    for name, other in _variants(args):
        builds = cache.builds
        got = fusedqkv.gqa_qkv_rope_qk_norm_backward(*other, backend=backend)
        assert cache.builds == builds + 1, name
        ref = fusedqkv.gqa_qkv_rope_qk_norm_backward(*other, backend="torch")
        for a, b in zip(got, ref):  # the new plan's result, not a stale plan's
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
        # and back: the first signature's plan again, no build
        builds = cache.builds
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend)
        assert cache.builds == builds or name == "eps", name


def test_config_change_builds_a_new_plan():
    cache = backward_091.PLANS
    args = _args()
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    builds = cache.builds
    with config.override(fused_finish=False):
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
        assert cache.builds == builds + 1
        assert cache.recent[0][2].cfg.fused_finish is False
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    assert cache.recent[0][2].cfg.fused_finish is True


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_aliasing_destination_refused_on_a_cached_plan(backend):
    args = _args()
    out = [torch.empty_like(t) for t in fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend=backend)]
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, out=out, backend=backend)  # plan cached
    bad = list(out)
    bad[1] = args[4]  # grad_cos written over the input cos: same shape, dtype and strides
    with pytest.raises(ValueError, match=r"out\[grad_cos\]: shares memory with the input cos"):
        fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, out=bad, backend=backend)


def test_overlap_sweep_agrees_with_pairwise_check():
    rng = random.Random(0)
    for _ in range(2000):
        outs = [(rng.randrange(0, 200), rng.randrange(0, 30)) for _ in range(rng.randrange(1, 5))]
        ins = [(rng.randrange(0, 200), rng.randrange(0, 30)) for _ in range(rng.randrange(0, 5))]

        def hit(a, b):
            return a[1] and b[1] and a[0] < b[0] + b[1] and b[0] < a[0] + a[1]

        expect = any(hit(a, b) for a, b in itertools.combinations(outs, 2)) or any(
            hit(a, b) for a in outs for b in ins)
        got = validation.overlaps_any([p for p, _ in outs], [s for _, s in outs], [p for p, _ in ins], [s for _, s in ins])
        assert got == expect, (outs, ins)


def test_raw_enqueue_passes_the_template_with_addresses_filled():
    """The generated enqueue: constants as given, pointer slots from the address table, a
    descriptor slot encoded once per address, the kernel arguments spread or packed as the
    launcher ABI wants them (test_fast_path_gate checks them against Triton's own launches)."""
    calls = []

    def encoder(desc, meta):
        calls.append(("encode", desc.base.data_ptr(), meta))
        return [f"map@{desc.base.data_ptr()}", *desc.shape, *desc.strides]

    like = torch.empty(4, 8)
    d = internals.DescriptorSlot(3, 1, launch._tensor_descriptor(like, [2, 8]), "meta", encoder)
    template = [None, 7, 2.5, None, 4, 8, 8, 1, None]
    for pack, wrap in ((None, lambda *a: a), (list, lambda *a: ([*a],)), (tuple, lambda *a: (a,))):
        calls.clear()
        d.ptr = None
        d.memo.clear()
        enqueue = internals.make_enqueue(lambda *a: calls.append(a), (5, 1, 1), ("fn", 0, 1), template,
                                         [(0, 0), (8, 2)], [d], pack)
        bound = launch.BoundLaunch(None, (5,), [], {})
        bound._raw, bound._descs = enqueue, [d]
        assert bound.bound
        bound.launch(None, [100, 200, 300], 9)
        bound.encode([101, 200, 301])  # the same address: not encoded again
        bound.launch(None, [101, 200, 301], 9)
        bound.encode([101, 201, 301])
        head = (5, 1, 1, 9, "fn", 0, 1)
        assert calls == [("encode", 200, "meta"), (*head, *wrap(100, 7, 2.5, "map@200", 4, 8, 8, 1, 300)),
                         (*head, *wrap(101, 7, 2.5, "map@200", 4, 8, 8, 1, 301)), ("encode", 201, "meta")]
        assert d.host.base.data_ptr() == 201 and d.host.shape == [4, 8]


def test_table_gather_agrees_with_addresses():
    """The run paths' generated gather gives the table's addresses in table order, derived entries
    at their offsets, whatever order the call lists its addresses in (extra names ignored)."""
    t = launch.Table()
    base = torch.empty(64)
    for name in ("c", "a", "b"):
        t.add(name, base)
    t.derive("a_part", t.slots["a"], 32, (4,))
    order = ("b", "unused", "a", "c")
    addr = dict(a=4096, b=8192, c=12288, unused=1)
    assert t.gather(order)([addr[n] for n in order]) == t.addresses(addr) == [12288, 4096, 8192, 4096 + 32]
    with pytest.raises(KeyError, match="'c'"):
        t.gather(("a", "b"))


def test_descriptor_slot_remembers_each_address_encoding():
    """An address seen before takes its remembered map (no encode); a new one is encoded; the memo
    is bounded."""
    calls = []

    def encoder(desc, meta):
        calls.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr()), *desc.shape, *desc.strides]

    d = internals.DescriptorSlot(0, 0, launch._tensor_descriptor(torch.empty(4, 8), [2, 8]), None, encoder)
    calls.clear()
    for ptr in (1000, 2000, 1000, 2000, 3000, 1000):
        d.encode(ptr)
        assert d.ptr == ptr and d.encoded == ("map", ptr)
    assert calls == [1000, 2000, 3000]
    for ptr in range(internals.DESCRIPTOR_MEMO + 5):
        d.encode(16 * ptr + 16)
    assert len(d.memo) <= internals.DESCRIPTOR_MEMO and d.encoded == ("map", 16 * (internals.DESCRIPTOR_MEMO + 4) + 16)


def test_plans_do_not_keep_the_building_calls_tensors_alive():
    import gc
    import weakref

    args = make_inputs(1, 4, 2, 7, 64, hidden=64, seed=5)
    refs = [weakref.ref(t) for t in args if torch.is_tensor(t)]
    fusedqkv.gqa_qkv_rope_qk_norm_backward(*args, backend="triton")
    del args
    gc.collect()
    assert all(r() is None for r in refs)


def test_training_block_plans_hit_on_repeat():
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(64, 4, 2, 16, dtype=torch.float32)
    x = torch.randn(2, 3, 64, requires_grad=True)
    ang = torch.randn(1, 3, 16)
    q, k, v = block(x, ang.cos(), ang.sin())
    (q.sum() + k.sum() + v.sum()).backward()
    builds = lambda: {n: c["builds"] for n, c in fusedqkv.cache_info()["plans"].items()}  # noqa: E731
    before = builds()
    q, k, v = block(x, ang.cos(), ang.sin())
    (q.sum() + k.sum() + v.sum()).backward()
    assert builds() == before


def test_the_fused_forward_rule_reasons_and_setting():
    """The one-launch Hopper forward (ops/qkv_rope_norm_gemm.py): the cases it refuses, the tile
    count behind ``auto``, its setting's parsing, and its gate (Gluon has no interpreter). Its GPU
    behaviour: test_gpu_fused_forward.py."""
    from fusedqkv.ops.qkv_rope_norm_gemm import consumer_rounds, fused_gemm_unsupported
    from fusedqkv.ops.variant import Variant

    x = torch.empty(4, 256, dtype=torch.bfloat16)
    w = torch.empty(768, 256, dtype=torch.bfloat16)
    plain = Variant()
    assert fused_gemm_unsupported(x, w, 128, 128, plain, None, (9, 0)) is None
    assert "sm_90" in fused_gemm_unsupported(x, w, 128, 128, plain, None, (10, 0))
    assert "head_dim" in fused_gemm_unsupported(x, w, 64, 64, plain, None, (9, 0))
    assert "head_dim" in fused_gemm_unsupported(x, w, 512, 512, plain, None, (9, 0))  # Gemma 4: cuBLAS + the stage
    assert "partial" in fused_gemm_unsupported(x, w, 128, 64, plain, None, (9, 0))
    for switches in (dict(q_gate=True), dict(interleaved=True), dict(all_heads=True), dict(v_norm=True),
                     dict(k_eq_v=True)):
        assert "variant" in fused_gemm_unsupported(x, w, 128, 128, Variant(**switches), None, (9, 0))
    assert "bias" in fused_gemm_unsupported(x, w, 128, 128, plain, torch.empty(768), (9, 0))
    assert "dtype" in fused_gemm_unsupported(x.float(), w.float(), 128, 128, plain, None, (9, 0))
    # 8192 tokens of 48 heads: 64 x 48 tiles over 2 x 132 consumers
    assert consumer_rounds(8192, 48 * 128, 128, 132) == pytest.approx(3072 / 264)
    assert consumer_rounds(1, 48 * 128, 128, 132) == pytest.approx(48 / 264)
    assert config.Config.from_env({"FUSEDQKV_FUSED_FORWARD": "off"}).fused_forward == "off"
    with pytest.raises(ValueError, match="FUSEDQKV_FUSED_FORWARD: expected one of auto, on, off"):
        config.Config.from_env({"FUSEDQKV_FUSED_FORWARD": "yes"})
    if config.INTERPRET:
        assert internals.gluon_gate() == "interpreter"


def test_a_cpu_forward_plan_never_takes_the_fused_forward():
    from fusedqkv.ops.training_forward import forward_plan

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 64, generator=g)
    w = torch.randn((4 + 2 * 2) * 16, 64, generator=g)
    wq, wk = torch.ones(16), torch.ones(16)
    cos, sin = torch.ones(1, 8, 16), torch.zeros(1, 8, 16)
    with config.override(fused_forward="on"):
        plan = forward_plan(x, w, wq, wk, cos, sin, 4, 2, 1e-6, "before_rope", None)
    assert plan.fused is None


# the one-launch forward's FP8 build (issue 35, session 23): which FP8 plans take it (the CPU side of the rule;
# the kernel's numerics on the GPU: test_gpu_fused_forward.py)


def test_the_fp8_one_launch_forward_takes_the_recipes_it_computes_as_scaled_mm_does():
    """The named recipes' forwards (e4m3 both, fast accumulation, one granularity) take the FP8 build:
    rowwise scales (``SCALES`` 1) or one scale each (2); activations other than bf16, a forward
    without fast accumulation, other FP8 formats and mixed granularities keep the split path."""
    import dataclasses

    from fusedqkv.ops import fp8
    from fusedqkv.ops.qkv_rope_norm_gemm import fp8_scales, fused_gemm_unsupported
    from fusedqkv.ops.variant import Variant

    x = torch.empty(4, 256, dtype=torch.bfloat16)
    w = torch.empty(768, 256, dtype=torch.bfloat16)
    plain = Variant()
    assert {n: fp8_scales(r) for n, r in fp8.RECIPES.items()} == {"rowwise": 1, "rowwise_with_gw_hp": 1,
                                                                  "tensorwise": 2, "mxfp8": 0,
                                                                  "mxfp8_rceil": 0}
    for name in ("mxfp8", "mxfp8_rceil"):
        assert "MX" in fused_gemm_unsupported(x, w, 128, 128, plain, None, (9, 0), fp8.RECIPES[name])
    for r in (r for r in fp8.RECIPES.values() if not r.mx):
        assert fused_gemm_unsupported(x, w, 128, 128, plain, None, (9, 0), r) is None
        assert "bf16" in fused_gemm_unsupported(x.half(), w.half(), 128, 128, plain, None, (9, 0), r)
        # the 16-bit rules before it: the device, the variant, the bias
        assert "sm_90" in fused_gemm_unsupported(x, w, 128, 128, plain, None, (10, 0), r)
        assert "variant" in fused_gemm_unsupported(x, w, 128, 128, Variant(q_gate=True), None, (9, 0), r)
        assert "bias" in fused_gemm_unsupported(x, w, 128, 128, plain, torch.empty(768), (9, 0), r)
    rw = fp8.RECIPES["rowwise"]
    refused = {"accumulation": dataclasses.replace(rw, name="custom", fast_accum=(False, False, False)),
               "granularities": dataclasses.replace(rw, name="custom", weight=fp8.Cast(fp8.E4M3, True)),
               "e4m3": dataclasses.replace(rw, name="custom", input=fp8.Cast(fp8.E5M2), weight=fp8.Cast(fp8.E5M2))}
    for reason, r in refused.items():
        assert reason in fused_gemm_unsupported(x, w, 128, 128, plain, None, (9, 0), r)
        assert fp8_scales(r) == 0
    assert config.Config().fused_forward_fp8 == "auto"
    assert config.Config.from_env({"FUSEDQKV_FUSED_FORWARD_FP8": "off"}).fused_forward_fp8 == "off"
    with pytest.raises(ValueError, match="FUSEDQKV_FUSED_FORWARD_FP8"):
        config.Config.from_env({"FUSEDQKV_FUSED_FORWARD_FP8": "1"})


def _as_an_h200(monkeypatch):
    """The plan rule's view of the device as an H200's (sm_90, 132 SMs) with Gluon's gate open: the CPU
    side of the rule only (nothing launches)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(internals, "gluon_gate", lambda instead=None: None)


def _fp8_plan_inputs(tokens, hidden=256, hq=4, hkv=2, d=128, dtype=torch.bfloat16, layout="contiguous"):
    from fusedqkv.ops.gqa_forward import validate_forward_inputs

    x = torch.randn(1, tokens, hidden, dtype=dtype)
    if layout == "transposed":  # not a matrix TMA takes: the FP8 casts' codes are, whatever x's layout
        x = torch.randn(hidden, tokens, dtype=dtype).t().unsqueeze(0)
    w = torch.randn((hq + 2 * hkv) * d, hidden, dtype=dtype)
    wq, wk = torch.ones(d, dtype=dtype), torch.ones(d, dtype=dtype)
    cos, sin = torch.ones(1, tokens, d, dtype=dtype), torch.zeros(1, tokens, d, dtype=dtype)
    sz = validate_forward_inputs(x, w, wq, wk, cos, sin, hq, hkv, 1e-6, "after_rope")
    return dict(sz, device=torch.device("cuda")), x, w, (cos, sin, wq, wk)


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp", "tensorwise"])
def test_fp8_plans_take_the_fp8_one_launch_forward_under_the_16_bit_rules(monkeypatch, name):
    """An FP8 plan takes the FP8 build where a bf16 plan would take the 16-bit one (``fused_forward``
    on, or auto from ``fused_forward_min_rounds`` tiles per consumer), with or without a matrix layout
    of x; not with ``fused_forward_fp8`` off, with LoRA adapters, or with fp16 activations; under its
    "auto" the tensorwise recipe only. The FP8 build: e4m3 operands at the FP8 K step, the scales two
    more call tensors."""
    from fusedqkv.ops import fp8
    from fusedqkv.ops.qkv_rope_norm_gemm import FP8_BK, FP8_ENTRIES, consumer_rounds, plan_fused_forward

    _as_an_h200(monkeypatch)
    r = fp8.RECIPES[name]
    cfg = config.current()
    sz, x, w, small = _fp8_plan_inputs(256)
    assert consumer_rounds(256, sz["qkv"], 128, 132) < cfg.fused_forward_min_rounds
    with config.override(fused_forward="on") as auto_fp8:  # fused_forward_fp8 "auto"
        assert (plan_fused_forward(sz, x, w, None, auto_fp8, small, recipe=r) is not None) == r.input.tensorwise
    with config.override(fused_forward="on", fused_forward_fp8="on") as on:
        fused = plan_fused_forward(sz, x, w, None, on, small, recipe=r)
        assert fused is not None and plan_fused_forward(sz, x, w, None, on, small) is not None
        assert fused.constexprs["SCALES"] == (2 if r.input.tensorwise else 1)
        assert fused.constexprs["BK"] == FP8_BK and fused.entries == FP8_ENTRIES and not fused.constexprs["LORA"]
        t_sz, t_x, t_w, t_small = _fp8_plan_inputs(256, layout="transposed")
        assert plan_fused_forward(t_sz, t_x, t_w, None, on, t_small) is None  # (16-bit: x not a TMA matrix)
        assert plan_fused_forward(t_sz, t_x, t_w, None, on, t_small, recipe=r) is not None
        assert plan_fused_forward(sz, x, w, None, on, small, lora=True, recipe=r) is None
        h_sz, h_x, h_w, h_small = _fp8_plan_inputs(256, dtype=torch.float16)
        assert plan_fused_forward(h_sz, h_x, h_w, None, on, h_small, recipe=r) is None
    with config.override(fused_forward="on", fused_forward_fp8="off") as off:
        assert plan_fused_forward(sz, x, w, None, off, small, recipe=r) is None
        assert plan_fused_forward(sz, x, w, None, off, small) is not None  # (the 16-bit build: its own switch)
    with config.override(fused_forward="auto", fused_forward_fp8="on") as auto:
        assert plan_fused_forward(sz, x, w, None, auto, small, recipe=r) is None
        big = _fp8_plan_inputs(8192, hq=32, hkv=8)  # 091's heads: 64 x 48 tiles over 264 consumers
        assert consumer_rounds(8192, big[0]["qkv"], 128, 132) >= cfg.fused_forward_min_rounds
        assert plan_fused_forward(*big[:3], None, auto, big[3], recipe=r) is not None
    with config.override(fused_forward="off") as never:
        assert plan_fused_forward(sz, x, w, None, never, small, recipe=r) is None


@needs_cpu_row_scales
@pytest.mark.parametrize("name", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("kept", [False, True])
def test_an_fp8_one_launch_plan_launches_on_the_casts_of_x_and_w(monkeypatch, name, kept):
    """The training forward's FP8 plan with the one-launch forward (the plan's rule as on an H200; its
    launch recorded instead of run): the kernel's x and W are the e4m3 casts ``fp8.forward_operands``
    makes (the kept casts where the autograd forward made them, as they are), its ``xs_ptr``/``ws_ptr``
    their inverse scales, the rest of the call's tensors as the 16-bit build gets them; the plan holds
    no GEMM or stage of its own."""
    from fusedqkv.ops import fp8, training_forward
    from fusedqkv.ops.launch import Desc, Ptr

    _as_an_h200(monkeypatch)
    rule = training_forward.plan_fused_forward  # (the rule for CPU tensors as for CUDA ones)
    monkeypatch.setattr(training_forward, "plan_fused_forward",
                        lambda sz, *a, **k: rule(dict(sz, device=torch.device("cuda")), *a, **k))
    r = fp8.RECIPES[name]
    sz, x, w, (cos, sin, wq, wk) = _fp8_plan_inputs(40)
    with config.override(fused_forward="on", fused_forward_fp8="on") as on:
        plan = training_forward.build_forward(x, w, wq, wk, cos, sin, 4, 2, 1e-6, "after_rope", "triton",
                                              fp8_key=r.key, cfg=on)
    assert plan.fused is not None and plan.fp8 is r and plan.lt_qkv is None
    bound = plan.launch
    params = internals.parameter_names(bound.fn)
    slot = {n: a for n, a in zip(params, bound.args)}
    names = plan.table.supplied
    assert isinstance(slot["x_desc"], Desc) and names[slot["x_desc"].index] == "x"
    assert isinstance(slot["xs_ptr"], Ptr) and slot["xs_ptr"].name == "x_scale"
    assert isinstance(slot["ws_ptr"], Ptr) and slot["ws_ptr"].name == "w_scale"
    assert slot["x_desc"].shape == [40, 256] and slot["x_desc"].block == [128, 128]
    seen = {}
    monkeypatch.setattr(bound, "launch", lambda tensors, ptrs, stream: seen.update(zip(names, tensors)))
    x_cast = w_cast = None
    if kept:
        x_cast = fp8.cast_rows(x.reshape(40, 256), r.input, r.round_scales_to_power_of_2)
        w_cast = fp8.cast_rows(w, r.weight, r.round_scales_to_power_of_2)
    q, k, qkv, *_ = plan.run(x, w, wq, wk, cos, sin, fp8_weight=w_cast, fp8_input=x_cast)
    (xa, xs), (wa, ws) = fp8.forward_operands(x.reshape(40, 256), w, r)
    assert seen["x"].dtype == seen["w"].dtype == fp8.E4M3
    for got, want in ((seen["x"], xa), (seen["w"], wa)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(seen["x_scale"], xs) and torch.equal(seen["w_scale"], ws)
    assert seen["x_scale"].shape == (() if r.input.tensorwise else (40, 1))
    if kept:
        assert seen["x"].data_ptr() == x_cast[0].data_ptr() and seen["w_scale"] is w_cast[1]
    assert seen["qkv"].data_ptr() == qkv.data_ptr() and seen["qkv"].shape == (40, 8 * 128)
    assert seen["cos"] is cos and seen["q_norm_weight"] is wq


class _RecordingKernel:
    """A stand-in kernel: ``fn[grid](*args, **constexprs)`` records the launch (the interpreter's path)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def test_tensor_launches_build_once_per_signature_and_keep_no_tensor(monkeypatch):
    """``launch.TensorLaunches``: one bound launch per signature -- the tensors' dtypes and 16-byte
    alignment, the scalars, the grid and the constexprs -- each call launched with that call's
    tensors; the oldest signature dropped at capacity; the build keeps no tensor alive."""
    import gc
    import weakref

    from fusedqkv.ops import device

    # (registered into a copy of the registry: cache_info() elsewhere lists the library's caches only)
    monkeypatch.setattr(device, "_plan_caches", dict(device._plan_caches))
    cache = launch.TensorLaunches("test tensor launches", capacity=4)
    monkeypatch.setattr(launch.BoundLaunch, "_bind_raw", lambda self, compiled, resolved: None)
    fn = _RecordingKernel()
    base = torch.zeros(64, dtype=torch.bfloat16)
    a, b = base[:32], torch.zeros(32, dtype=torch.bfloat16)
    cache(fn, (2,), (a,), (32, 1), dict(BLOCK=16, num_warps=4))
    cache(fn, (2,), (b,), (32, 1), dict(BLOCK=16, num_warps=4))  # other memory, the same signature
    assert cache.builds == 1 and len(fn.calls) == 2 and fn.calls[1][1][0] is b
    for tensors, scalars, grid, kw in (((base[1:33],), (32, 1), (2,), dict(BLOCK=16, num_warps=4)),  # misaligned
                                       ((a.float(),), (32, 1), (2,), dict(BLOCK=16, num_warps=4)),  # another dtype
                                       ((a,), (31, 1), (2,), dict(BLOCK=16, num_warps=4)),  # another scalar
                                       ((a,), (32, 1), (3,), dict(BLOCK=16, num_warps=4)),  # another grid
                                       ((a,), (32, 1), (2,), dict(BLOCK=32, num_warps=4))):  # another constexpr
        before = cache.builds
        cache(fn, grid, tensors, scalars, kw)
        assert cache.builds == before + 1 and fn.calls[-1] == ((*grid, 1, 1), tensors + scalars, kw)
    assert cache.info()["plans"] == 4  # at capacity: the oldest dropped
    held = torch.zeros(8)
    ref = weakref.ref(held)
    cache(fn, (1,), (held,), (), dict(num_warps=1))
    del held
    fn.calls.clear()
    gc.collect()
    assert ref() is None
