"""The training forward as one Hopper launch (the Gluon GEMM with RoPE + RMSNorm in its epilogue,
``ops/qkv_rope_norm_gemm.py``), on an sm_90 GPU with a Triton its gate accepts: q/k/rstd match the
torch stage run on the kernel's own qkv within one rounding, qkv matches cuBLAS's product, launches
repeat bitwise and replay inside a CUDA graph, the block's gradients match the cuBLAS + stage path,
the plan takes the kernel only where it is supported and (``auto``) where the shape pays, and a
configured tile (another ring depth) gives the default's outputs bitwise. Its FP8 build (FP8 plans,
issue 35): qkv within 1 bf16 ulp of the split FP8 path's (``torch._scaled_mm`` + the stage), q/k/rstd
as above, the block's gradients, a CUDA graph, the plan's rule.
Skipped elsewhere (the CPU tests of the plan's rule: test_plan.py)."""

import pytest
import torch

from fusedqkv import GQAQKVRoPEQKNorm
from fusedqkv.ops import config, internals
from fusedqkv.ops.gqa_forward import forward_outputs, forward_torch
from fusedqkv.ops.qkv_rope_norm_gemm import FusedGemmForward, call_entries, consumer_rounds
from fusedqkv.ops.training_forward import forward_plan, run_forward

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                            or internals.gluon_gate() is not None, reason="needs an sm_90 GPU and Gluon's Triton")

CASES = [  # (hidden, hq, hkv, batch, seq, position, weighted, dtype)
    (4096, 32, 8, 1, 512, "after_rope", True, torch.bfloat16),
    (4096, 32, 8, 2, 1000, "before_rope", True, torch.bfloat16),  # a ragged last tile row
    (2048, 16, 4, 1, 77, "before_rope", False, torch.bfloat16),  # unweighted, less than a tile
    (1024, 8, 2, 3, 129, "after_rope", True, torch.float16),
]


def _inputs(hidden, hq, hkv, b, s, weighted, dtype, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed + b * s)
    d = 128
    x = torch.randn(b, s, hidden, device=dev, generator=g).to(dtype)
    w = (torch.randn((hq + 2 * hkv) * d, hidden, device=dev, generator=g) / hidden ** 0.5).to(dtype)
    wq = (1 + 0.2 * torch.randn(d, device=dev, generator=g)).to(dtype) if weighted else None
    wk = (1 + 0.2 * torch.randn(d, device=dev, generator=g)).to(dtype) if weighted else None
    ang = torch.rand(b, s, d // 2, device=dev, generator=g) * 6.3
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    return x, w, wq, wk, cos, sin


def _beyond_one_rounding(a, ref, dtype):
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    return int(((a.float() - ref.float()).abs() > torch.clamp(ref.float().abs(), min=1.0) * ulp).sum())


@hopper
@pytest.mark.parametrize("hidden,hq,hkv,b,s,position,weighted,dtype", CASES)
def test_fused_forward_matches_the_stage_on_its_qkv(hidden, hq, hkv, b, s, position, weighted, dtype):
    x, w, wq, wk, cos, sin = _inputs(hidden, hq, hkv, b, s, weighted, dtype)
    with config.override(fused_forward="on"):
        plan = forward_plan(x, w, wq, wk, cos, sin, hq, hkv, 1e-6, position, "triton")
        assert plan.fused is not None
        q, k, qkv, rq, rk, v = run_forward(plan, x, w, wq, wk, cos, sin)
        again = run_forward(plan, x, w, wq, wk, cos, sin)
    assert v is None
    for a, b_ in zip((q, k, qkv, rq, rk), again):  # bitwise repeatable
        assert torch.equal(a, b_)
    ref = torch.mm(x.view(b * s, hidden).float(), w.float().t()).view_as(qkv)
    assert float((qkv.float() - ref).norm() / ref.norm()) < 3e-3
    tq, tk, trq, trk, _ = forward_torch(qkv, wq, wk, cos, sin, hq, hkv, 1e-6, position == "after_rope")
    assert _beyond_one_rounding(q, tq, dtype) == 0
    assert _beyond_one_rounding(k, tk, dtype) == 0
    torch.testing.assert_close(rq, trq, rtol=1e-5, atol=0)
    torch.testing.assert_close(rk, trk, rtol=1e-5, atol=0)


def _run_kernel(x, w, wq, wk, cos, sin, hq, hkv, position, fuse=True, **tile):
    """The kernel alone (``FusedGemmForward`` with ``tile``'s overrides), every output first NaN."""
    b, s, hidden = x.shape
    M, N = b * s, w.shape[0]
    fwd = FusedGemmForward(M, N, hidden, s, hq, hkv, 128, 1e-6, position == "after_rope", wq is not None, x.dtype,
                           x.device, fuse=fuse, **tile)
    qkv = torch.full((M, N), float("nan"), device="cuda", dtype=x.dtype)
    q, k, rq, rk, _ = forward_outputs(b, s, hq, hkv, 128, x.dtype, x.device, False)
    for t in (q, k, rq, rk):
        t.fill_(float("nan"))
    fwd.run(call_entries((b, s, hq, hkv, 128), x, w, qkv, q, k, wq, wk, rq, rk, cos, sin))
    return (qkv, ) if not fuse else (q, k, qkv, rq, rk)


@hopper
@pytest.mark.parametrize("weighted", [True, False])
def test_the_plan_launches_the_kernel_directly_at_any_address(weighted):
    """After its first launch the plan's launch is bound (the compiled kernel's launcher called
    directly, the descriptors re-encoded where their tensor moved): calls with every tensor at
    other addresses give the JIT launch's outputs bitwise; a call whose cos/sin are not 16-byte
    aligned (the plan's were) gets a plan of its own, with the same outputs."""
    args = (16, 4, "before_rope")
    x, w, wq, wk, cos, sin = _inputs(2048, 16, 4, 2, 300, weighted, torch.bfloat16)
    with config.override(fused_forward="on"):
        plan = forward_plan(x, w, wq, wk, cos, sin, *args[:2], 1e-6, args[2], "triton")
        run_forward(plan, x, w, wq, wk, cos, sin)
        assert plan.launch.bound == (internals.raw_launch_gate() is not None)
        for seed in (1, 2):
            call = _inputs(2048, 16, 4, 2, 300, weighted, torch.bfloat16, seed=seed)
            assert forward_plan(*call, *args[:2], 1e-6, args[2], "triton") is plan
            got = run_forward(plan, *call)[:5]
            for a, b_ in zip(got, _run_kernel(*call, *args)):  # (the kernel alone gives qkv as a matrix)
                assert torch.equal(a.reshape(b_.shape), b_)
        moved = []
        for t in (cos, sin):  # the same values two bytes off a 16-byte boundary
            buf = torch.empty(t.numel() + 8, device="cuda", dtype=t.dtype)
            moved.append(buf[1: 1 + t.numel()].view_as(t).copy_(t))
        assert moved[0].data_ptr() % 16
        got = run_forward(plan, x, w, wq, wk, *moved)[:5]
    for a, b_ in zip(got, _run_kernel(x, w, wq, wk, cos, sin, *args)):
        assert torch.equal(a.reshape(b_.shape), b_)


@hopper
@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("hidden,hq,hkv,b,s,position,weighted,dtype", CASES)
def test_a_shallower_ring_equals_the_default(stages, hidden, hq, hkv, b, s, position, weighted, dtype):
    """The ring's depth changes when a K step's operands arrive, not the arithmetic: every output
    bitwise equal to the default (5-stage) kernel's, the plain GEMM's too, with per-element cos/sin
    and token counts that leave a tile past the last token."""
    x, w, wq, wk, _, _ = _inputs(hidden, hq, hkv, b, s, weighted, dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    cos, sin = (torch.rand(b, s, 128, device="cuda", generator=g).mul(2).sub(1).to(dtype) for _ in range(2))
    args = (x, w, wq, wk, cos, sin, hq, hkv, position)
    for fuse in (True, False):
        ref = _run_kernel(*args, fuse=fuse)
        got = _run_kernel(*args, fuse=fuse, STAGES=stages)
        torch.cuda.synchronize()
        for a, b_ in zip(ref, got):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b_)


@hopper
def test_the_plan_takes_the_configured_tile():
    """``config.fused_forward_tile`` reaches the plan's launch, with the default's outputs."""
    x, w, wq, wk, cos, sin = _inputs(4096, 32, 8, 2, 300, True, torch.bfloat16)
    outs = {}
    for name, tile in (("default", None), ("stages4", (("STAGES", 4), ))):
        with config.override(fused_forward="on", fused_forward_tile=tile):
            plan = forward_plan(x, w, wq, wk, cos, sin, 32, 8, 1e-6, "before_rope", "triton")
            assert plan.fused.tile["STAGES"] == (5 if tile is None else 4)
            outs[name] = run_forward(plan, x, w, wq, wk, cos, sin)[:5]
    for a, b in zip(outs["default"], outs["stages4"]):
        assert torch.equal(a, b)


@hopper
def test_fused_forward_replays_in_a_cuda_graph():
    x, w, wq, wk, cos, sin = _inputs(4096, 32, 8, 1, 640, True, torch.bfloat16, seed=3)
    with config.override(fused_forward="on"):
        plan = forward_plan(x, w, wq, wk, cos, sin, 32, 8, 1e-6, "after_rope", "triton")
        eager = run_forward(plan, x, w, wq, wk, cos, sin)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_forward(plan, x, w, wq, wk, cos, sin)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_forward(plan, x, w, wq, wk, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager[:5], captured[:5]):
        assert torch.equal(a, b)


@hopper
@pytest.mark.parametrize("position", ["after_rope", "before_rope"])
def test_block_gradients_with_the_fused_forward_match_cublas_and_the_stage(position):
    torch.manual_seed(0)
    block = GQAQKVRoPEQKNorm(hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, qk_norm_position=position,
                             device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        block.q_norm_weight.normal_(1.0, 0.2)
        block.k_norm_weight.normal_(1.0, 0.2)
    b, s = 2, 768
    x = torch.randn(b, s, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, _, _, _, cos, sin = _inputs(2048, 16, 4, b, s, True, torch.bfloat16)
    dy = [torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16) for h in (16, 4, 4)]
    leaves = [x, *block.parameters()]
    got = {}
    for mode in ("off", "on"):
        with config.override(fused_forward=mode):
            out = block(x, cos, sin)
            got[mode] = (*out, *torch.autograd.grad(out, leaves, dy))
    for a, b_ in zip(got["off"], got["on"]):  # two GEMMs' accumulation orders, one rounding apart
        rel = float((a.float() - b_.float()).norm() / b_.float().norm().clamp_min(1e-30))
        assert rel < 1e-2, rel


@hopper
def test_auto_takes_the_fused_forward_only_where_it_pays_and_is_supported():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = _inputs(4096, 32, 8, 2, 4096, True, torch.bfloat16)  # 11.6 tiles per consumer on 132 SMs
    small = _inputs(4096, 32, 8, 1, 2048, True, torch.bfloat16)
    assert consumer_rounds(8192, 48 * 128, 128, sms) >= config.current().fused_forward_min_rounds
    assert consumer_rounds(2048, 48 * 128, 128, sms) < config.current().fused_forward_min_rounds
    with config.override(fused_forward="auto"):
        assert forward_plan(*big[:6], 32, 8, 1e-6, "after_rope", "triton").fused is not None
        assert forward_plan(*small[:6], 32, 8, 1e-6, "after_rope", "triton").fused is None
    with config.override(fused_forward="off"):
        assert forward_plan(*big[:6], 32, 8, 1e-6, "after_rope", "triton").fused is None
    # LoRA plans (a residual): the kernel with the adapters inside from ~3 tiles per consumer (2048 tokens: 2.9)
    lora_small = _inputs(4096, 32, 8, 1, 512, True, torch.bfloat16)
    assert consumer_rounds(2048, 48 * 128, 128, sms) >= config.current().fused_forward_lora_min_rounds
    assert consumer_rounds(512, 48 * 128, 128, sms) < config.current().fused_forward_lora_min_rounds
    with config.override(fused_forward="auto"):
        assert forward_plan(*small[:6], 32, 8, 1e-6, "after_rope", "triton", residual=True).fused_lora is not None
        assert forward_plan(*lora_small[:6], 32, 8, 1e-6, "after_rope", "triton", residual=True).fused_lora is None
    x, w, wq, wk, cos, sin = big
    with config.override(fused_forward="on"):  # variants it does not cover keep cuBLAS + the stage
        bias = torch.zeros(w.shape[0], device="cuda", dtype=w.dtype)
        assert forward_plan(x, w, wq, wk, cos, sin, 32, 8, 1e-6, "after_rope", "triton", bias).fused is None
        half = cos[..., :64].contiguous(), sin[..., :64].contiguous()
        assert forward_plan(x, w, wq, wk, *half, 32, 8, 1e-6, "after_rope", "triton").fused is None
        assert forward_plan(x, w, wq, wk, cos, sin, 32, 8, 1e-6, "after_rope", "triton",
                            rope_style="interleaved").fused is None


def _lora_call(x, w, wq, wk, cos, sin, hq, hkv, position, adapters, mode):
    """The block with LoRA adapters inside (``adapters``: (row, rows, A, B, scaling) per projection,
    A and B leaf parameters) under ``config.fused_forward=mode``: outputs, then the gradients of x,
    every A and every B for fixed output gradients; and the forward's plan."""
    from fusedqkv import gqa_qkv_rope_qk_norm
    from fusedqkv.ops.lora import LoRAUpdate

    pairs = [(row, rows, a, b, s, True) for row, rows, a, b, s in adapters]
    params = [x] + [a for *_, a, _, _ in adapters] + [b for *_, b, _ in adapters]
    with config.override(fused_forward=mode):
        lora = LoRAUpdate(pairs, [], w.shape[0], x.dtype)
        out = gqa_qkv_rope_qk_norm(x, w, wq, wk, cos, sin, num_heads=hq, num_kv_heads=hkv, eps=1e-6,
                                   qk_norm_position=position, qkv_lora=lora)
        plan = forward_plan(x, w, wq, wk, cos, sin, hq, hkv, 1e-6, position, "auto", residual=True)  # the call's
    g = torch.Generator(device="cuda").manual_seed(11)
    dy = [torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g) for o in out]
    return [o.detach() for o in out] + list(torch.autograd.grad(out, params, dy)), plan


def _adapters(hidden, hq, hkv, rank, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(100 + seed)
    out, row = [], 0
    for rows, scaling in ((hq * 128, 2.0), (hkv * 128, 0.75), (hkv * 128, 1.0 / 3)):  # one scale not a power of 2
        a = (torch.randn(rank, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
        b = (torch.randn(rows, rank, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
        out.append((row, rows, a, b, scaling))
        row += rows
    return out


@hopper
@pytest.mark.parametrize("hidden,hq,hkv,b,s,position,weighted,dtype", CASES)
def test_lora_adapters_inside_the_fused_gemm_match_the_in_place_path(hidden, hq, hkv, b, s, position, weighted, dtype):
    """The adapters' U and B as more inner columns of the one-launch forward (``fused_forward="on"``):
    q, k, v and the gradients of x, A and B match the cuBLAS + in-place update + stage path
    (``"off"``) within the two paths' roundings (the in-place path rounds x W^T before adding
    s U B^T; the GEMM rounds s B to the dtype once), the plan takes the kernel and binds its
    launch, and a second call repeats the first bitwise."""
    x, w, wq, wk, cos, sin = _inputs(hidden, hq, hkv, b, s, weighted, dtype)
    x.requires_grad_()
    adapters = _adapters(hidden, hq, hkv, 16, dtype)
    ref, plan_off = _lora_call(x, w, wq, wk, cos, sin, hq, hkv, position, adapters, "off")
    got, plan = _lora_call(x, w, wq, wk, cos, sin, hq, hkv, position, adapters, "on")
    again, _ = _lora_call(x, w, wq, wk, cos, sin, hq, hkv, position, adapters, "on")
    assert plan_off.fused_lora is None and plan.fused_lora is not None
    launch = plan.lora_launches[48][1]
    assert launch.bound == (internals.raw_launch_gate() is not None)
    names = ["q", "k", "v", "dx", "dA_q", "dA_k", "dA_v", "dB_q", "dB_k", "dB_v"]
    for name, a, r, a2 in zip(names, got, ref, again):
        assert torch.equal(a, a2), name
        rel = float((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
        assert rel < 1e-2, (name, rel)
    # and the update is there at all: without the adapters q differs by far more than that
    plain = run_forward(forward_plan(x.detach(), w, wq, wk, cos, sin, hq, hkv, 1e-6, position, "triton"),
                        x.detach(), w, wq, wk, cos, sin)[0]
    assert float((plain.float() - got[0].float()).norm() / got[0].float().norm()) > 5e-2


@hopper
def test_lora_in_the_fused_gemm_at_other_addresses_ranks_and_in_a_cuda_graph():
    """A bound LoRA launch at other addresses equals a fresh plan's JIT launch bitwise; a rank
    sum whose U rows are not 16-byte multiples (3 x 4 bf16) takes the in-place path with the
    same results as "off"; the fused LoRA forward replays in a CUDA graph with eager's outputs."""
    from fusedqkv.ops import training_forward

    args = (2048, 16, 4, 2, 300, "before_rope", True, torch.bfloat16)
    x, w, wq, wk, cos, sin = _inputs(*args[:5], True, torch.bfloat16)
    x.requires_grad_()
    adapters = _adapters(2048, 16, 4, 16, torch.bfloat16)
    call = (w, wq, wk, cos, sin, 16, 4, "before_rope", adapters)
    first, plan = _lora_call(x, *call, "on")
    x2 = _inputs(*args[:5], True, torch.bfloat16, seed=5)[0].requires_grad_()
    got, plan2 = _lora_call(x2, *call, "on")
    assert plan2 is plan
    training_forward.PLANS.clear()  # a fresh plan: its first launch of this rank sum is the JIT's
    fresh, plan3 = _lora_call(x2, *call, "on")
    assert plan3 is not plan
    for a, b_ in zip(got, fresh):
        assert torch.equal(a, b_)
    odd = _adapters(2048, 16, 4, 4, torch.bfloat16, seed=1)
    on, plan4 = _lora_call(x, w, wq, wk, cos, sin, 16, 4, "before_rope", odd, "on")
    off, _ = _lora_call(x, w, wq, wk, cos, sin, 16, 4, "before_rope", odd, "off")
    assert 12 not in plan4.lora_launches
    for a, b_ in zip(on, off):
        assert torch.equal(a, b_)
    # a CUDA graph of the forward (no autograd: the graph holds the forward's launches)
    from fusedqkv.ops.lora import LoRAUpdate

    pairs = [(row, rows, a.detach(), b.detach(), s_, True) for row, rows, a, b, s_ in adapters]
    xd = x.detach()
    with config.override(fused_forward="on"):
        fplan = forward_plan(xd, w, wq, wk, cos, sin, 16, 4, 1e-6, "before_rope", "triton", residual=True)
        eager = run_forward(fplan, xd, w, wq, wk, cos, sin, lora=LoRAUpdate(pairs, [], w.shape[0], xd.dtype))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_forward(fplan, xd, w, wq, wk, cos, sin, lora=LoRAUpdate(pairs, [], w.shape[0], xd.dtype))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_forward(fplan, xd, w, wq, wk, cos, sin, lora=LoRAUpdate(pairs, [], w.shape[0], xd.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for a, b_ in zip(eager[:3], captured[:3]):
        assert torch.equal(a, b_)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_lora_block_builder_equals_the_torch_ops_bitwise():
    """``block_b``'s one Triton launch per four pairs (kernels/lora_blocks.py) against ``torch.zeros`` +
    ``torch.mul(B, s, out=view)``: bitwise for bf16/fp16/fp32 adapters and blocks (fp32 adapters into a
    bf16 block: autocast), odd rows and ranks, a transposed and a sliced B, five pairs (two launches),
    rows no pair covers; a second call (the bound launch) repeats it."""
    from fusedqkv.ops.lora import _BUILDS, block_b

    g = torch.Generator(device="cuda").manual_seed(3)
    specs = [(0, 300, 16, 2.0), (300, 77, 5, 0.75), (377, 64, 16, 1 / 3), (0, 300, 3, -1.7), (377, 50, 1, 0.3)]
    for b_dtype, dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                           (torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
        pairs, cols, c = [], [], 0
        for k, (row, rows, r, s) in enumerate(specs):
            if k == 1:
                b = (torch.randn(r, rows, device="cuda", generator=g) * 3).to(b_dtype).t()
            elif k == 2:
                b = (torch.randn(rows, r + 3, device="cuda", generator=g) * 3).to(b_dtype)[:, 1:r + 1]
            else:
                b = (torch.randn(rows, r, device="cuda", generator=g) * 3).to(b_dtype)
            pairs.append((row, rows, None, b, s, True))
            cols.append(c)
            c += r
        want = block_b(pairs, cols, 500, c, dtype, "torch")
        for _ in range(2):
            got = block_b(pairs, cols, 500, c, dtype, "triton")
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (b_dtype, dtype)
        assert not got[441:].float().any()
    launches = [launch for launches in _BUILDS.values() for launch, _ in launches]
    assert launches and all(launch.bound == (internals.raw_launch_gate() is not None) for launch in launches)


@cuda
@pytest.mark.parametrize("mode", ["off", "on"])
def test_lora_block_path_matches_the_per_pair_path(mode):
    """At 512 tokens (bench_lora's r=16 on q/k/v, 091's shape, bf16) the split forward takes the block
    path (one ``addmm_`` over the block, dU in one GEMM) by the rule; its outputs and the gradients of
    x, every A and every B match the per-pair path (``lora_block="off"``) within bf16 rounding, and the
    same call with the one-launch forward where it runs (``fused_forward=mode``)."""
    from fusedqkv.ops.lora import LoRAUpdate

    x, w, wq, wk, cos, sin = _inputs(4096, 32, 8, 1, 512, True, torch.bfloat16)
    x.requires_grad_()
    adapters = _adapters(4096, 32, 8, 16, torch.bfloat16)
    pairs = [(row, rows, a, b, s, True) for row, rows, a, b, s in adapters]
    assert LoRAUpdate(pairs, [], w.shape[0], x.dtype).block_pays(512, 2, 3)
    with config.override(lora_block="off"):
        ref, _ = _lora_call(x, w, wq, wk, cos, sin, 32, 8, "after_rope", adapters, "off")
    with config.override(lora_block="auto"):
        got, _ = _lora_call(x, w, wq, wk, cos, sin, 32, 8, "after_rope", adapters, mode)
    names = ["q", "k", "v", "dx", "dA_q", "dA_k", "dA_v", "dB_q", "dB_k", "dB_v"]
    for name, a, r in zip(names, got, ref):
        rel = float((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
        assert rel < 1e-2, (name, rel)


@cuda
@pytest.mark.parametrize("tokens", [512, 8192])
def test_fp32_adapters_take_fp32_products_for_da_and_db(tokens, monkeypatch):
    """Autocast's case (fp32 adapters, bf16 block): dA and every dB from fp32 products, dB from one
    product over all pairs (``WIDE_GRAD_PRODUCTS``); against fp64 at most the per-pair bf16 path's
    error, each gradient a contiguous fp32 tensor."""
    from fusedqkv.ops import lora as L

    hidden, n_tot = 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(7)
    pairs = [(row, rows, (torch.randn(16, hidden, device="cuda", generator=g) / 32).requires_grad_(),
              (torch.randn(rows, 16, device="cuda", generator=g) * 0.1).requires_grad_(), s, True)
             for row, rows, s in ((0, 2048, 2.0), (2048, 1024, 0.75), (3072, 1024, 1.0 / 3))]
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    dqkv = torch.randn(tokens, n_tot, device="cuda", generator=g).bfloat16()
    ref = []
    for row, rows, a, b, s, _ in pairs:  # fp64 of the same bf16 operands the block multiplies
        u = x.double() @ a.detach().bfloat16().double().t()
        ref.append((dqkv[:, row:row + rows].double().t() @ u) * s)
    da_ref = [(dqkv[:, row:row + rows].double() @ (b.detach().bfloat16().double() * s)).t() @ x.double()
              for row, rows, a, b, s, _ in pairs]

    def run(wide):
        monkeypatch.setattr(L, "WIDE_GRAD_PRODUCTS", wide)
        update = L.LoRAUpdate(pairs, [], n_tot, torch.bfloat16)
        qkv = torch.zeros(tokens, n_tot, device="cuda", dtype=torch.bfloat16)
        update.forward(qkv, x)
        torch.cuda.synchronize()
        return update.backward(dqkv, None, x, [True] * 6)

    old, new = run(False), run(True)
    for i in range(3):
        for got, was, want in ((new[3 + i], old[3 + i], ref[i]), (new[i], old[i], da_ref[i])):
            assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == want.shape
            err_new = float((got.double() - want).norm() / want.norm())
            err_old = float((was.double() - want).norm() / want.norm())
            assert err_new <= err_old * 1.01 + 1e-7, (i, err_new, err_old)


# the one-launch forward's FP8 build (issue 35, session 23): FP8 plans' GEMM on the casts of x and W, the
# recipe's inverse scales on the accumulator before the rounding, against the split FP8 path (the same casts,
# torch._scaled_mm -- torch's CUTLASS rowwise kernel, cuBLASLt tensorwise -- then the forward stage)

FP8_CASES = [  # (hidden, hq, hkv, b, s, position, weighted)
    (4096, 32, 8, 1, 8192, "after_rope", True),  # 091 at 8192 tokens
    (1024, 8, 2, 2, 300, "before_rope", False),  # 600 tokens: a ragged last tile row, unweighted
]


def _bf16_ulps(a, b):
    """|a - b| elementwise in bf16 ulps of max(|a|, |b|) (the spacing of bf16 values at that magnitude)."""
    a, b = a.float(), b.float()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(mag)) - 7)


def _fp8_forward(x, w, wq, wk, cos, sin, hq, hkv, position, name, one_launch):
    """The training forward's plan for ``fp8=name`` with (``one_launch``) or without the FP8 one-launch
    forward (``fused_forward`` on: wherever it can run), its outputs (q, k, qkv, rstd_q, rstd_k)."""
    with config.override(fused_forward="on", fused_forward_fp8="on" if one_launch else "off"):
        plan = forward_plan(x, w, wq, wk, cos, sin, hq, hkv, 1e-6, position, "triton", fp8_key=name)
        assert (plan.fused is not None) == one_launch and plan.fp8 is not None
        if one_launch:
            assert plan.fused.scales == (2 if name == "tensorwise" else 1)
        return run_forward(plan, x, w, wq, wk, cos, sin)[:5], plan


@hopper
@pytest.mark.parametrize("name", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("hidden,hq,hkv,b,s,position,weighted", FP8_CASES)
def test_fp8_one_launch_forward_matches_scaled_mm_and_the_stage(name, hidden, hq, hkv, b, s, position, weighted):
    """The bound: qkv within 1 bf16 ulp of the split path's elementwise (both are one rounding of the
    same fp32 value up to the accumulation: the same casts, wgmma's fast accumulation over K in order
    in both kernels, the scales applied as ``_scaled_mm`` applies them -- power-of-two rowwise scales
    exactly, tensorwise by the one product ``x_s * w_s``; expected bitwise, reported below); q, k and
    rstd then as the 16-bit build's test bounds them against the torch stage on the kernel's own qkv (q/k
    within one rounding, rstd 1e-5), and against the split path's q/k within two roundings (its stage
    rounds once, and a qkv element 1 ulp apart moves its head's rstd by < 2**-8)."""
    x, w, wq, wk, cos, sin = _inputs(hidden, hq, hkv, b, s, weighted, torch.bfloat16)
    (q, k, qkv, rq, rk), plan = _fp8_forward(x, w, wq, wk, cos, sin, hq, hkv, position, name, True)
    assert plan.launch.bound == (internals.raw_launch_gate() is not None)
    again = run_forward(plan, x, w, wq, wk, cos, sin)[:5]  # the bound launch
    for a, b_ in zip((q, k, qkv, rq, rk), again):
        assert torch.equal(a, b_)
    (sq, sk, sqkv, srq, srk), _ = _fp8_forward(x, w, wq, wk, cos, sin, hq, hkv, position, name, False)
    ulps = _bf16_ulps(qkv, sqkv)
    print(f"\n{name} {b}x{s}: qkv bitwise the split path's on {float((ulps == 0).float().mean()):.6f} of "
          f"{qkv.numel()} elements, max {float(ulps.max()):.0f} ulp")
    assert float(ulps.max()) <= 1
    tq, tk, trq, trk, _ = forward_torch(qkv, wq, wk, cos, sin, hq, hkv, 1e-6, position == "after_rope")
    assert _beyond_one_rounding(q, tq, torch.bfloat16) == 0
    assert _beyond_one_rounding(k, tk, torch.bfloat16) == 0
    torch.testing.assert_close(rq, trq, rtol=1e-5, atol=0)
    torch.testing.assert_close(rk, trk, rtol=1e-5, atol=0)
    for a, ref in ((q, sq), (k, sk)):
        assert int(((a.float() - ref.float()).abs() > torch.clamp(ref.float().abs(), min=1.0) * 2 ** -6).sum()) == 0
    torch.testing.assert_close(rq, srq, rtol=4e-3, atol=0)
    torch.testing.assert_close(rk, srk, rtol=4e-3, atol=0)


@hopper
@pytest.mark.parametrize("name", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("hidden,hq,hkv,b,s,position,weighted", FP8_CASES)
def test_fp8_block_gradients_with_the_one_launch_forward_match_the_split_path(name, hidden, hq, hkv, b, s, position,
                                                                              weighted):
    """The block's fwd+bwd (``fp8=name``, the forward's casts of x and W made once and kept by the autograd
    forward) with the FP8 one-launch forward against the split path: the backward reads the same saved
    tensors (x, W, qkv, W's dX cast, x's amaxes), so where qkv came out bitwise equal (the two plans'
    forwards, compared apart) v and every gradient are bitwise equal; all within relative 1e-2 (q and k:
    two roundings, the test above; the gradients otherwise: the forward's 1-ulp differences)."""
    import fusedqkv

    x, w, wq, wk, cos, sin = _inputs(hidden, hq, hkv, b, s, weighted, torch.bfloat16)
    qkvs = [_fp8_forward(x, w, wq, wk, cos, sin, hq, hkv, position, name, one)[0][2] for one in (True, False)]
    same_qkv = torch.equal(*qkvs)
    del qkvs
    g = torch.Generator(device="cuda").manual_seed(9)
    dy = [torch.randn(b, h, s, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]
    got = {}
    for one_launch in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, wq, wk) if t is not None]
        with config.override(fused_forward="on", fused_forward_fp8="on" if one_launch else "off"):
            out = fusedqkv.gqa_qkv_rope_qk_norm(leaves[0], leaves[1], *(leaves[2:] or (None, None)), cos, sin,
                                                num_heads=hq, num_kv_heads=hkv, eps=1e-6, qk_norm_position=position,
                                                fp8=name)
            got[one_launch] = [o.detach() for o in out] + list(torch.autograd.grad(out, leaves, dy))
    for i, (a, r) in enumerate(zip(got[True], got[False])):
        if same_qkv and i >= 2:  # v: qkv's columns; the gradients: the backward of the same saved tensors
            assert torch.equal(a, r), i
        rel = float((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
        assert rel < 1e-2, (i, rel)


@hopper
@pytest.mark.parametrize("name", ["rowwise", "tensorwise"])
def test_fp8_one_launch_forward_replays_in_a_cuda_graph(name):
    """The FP8 plan's forward (its casts of x and W, then the one launch) captured in a CUDA graph: the
    replay gives the eager call's outputs bitwise."""
    x, w, wq, wk, cos, sin = _inputs(4096, 32, 8, 1, 640, True, torch.bfloat16, seed=3)
    with config.override(fused_forward="on", fused_forward_fp8="on"):
        plan = forward_plan(x, w, wq, wk, cos, sin, 32, 8, 1e-6, "after_rope", "triton", fp8_key=name)
        assert plan.fused is not None and plan.fused.scales
        eager = run_forward(plan, x, w, wq, wk, cos, sin)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_forward(plan, x, w, wq, wk, cos, sin)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_forward(plan, x, w, wq, wk, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager[:5], captured[:5]):
        assert torch.equal(a, b)


@hopper
def test_auto_takes_the_fp8_one_launch_forward_where_the_16_bit_one_runs():
    """FP8 plans under ``auto``: the FP8 build from ``fused_forward_min_rounds`` tiles per consumer (8192
    tokens of 091's heads), not below, not with ``fused_forward_fp8`` off, not with a residual (LoRA); its
    "auto" for tensorwise only (rowwise measured slower than the split path, session 23)."""
    big = _inputs(4096, 32, 8, 2, 4096, True, torch.bfloat16)
    small = _inputs(4096, 32, 8, 1, 2048, True, torch.bfloat16)
    for name in ("rowwise", "tensorwise", "rowwise_with_gw_hp"):
        with config.override(fused_forward="auto"):  # fused_forward_fp8 "auto": tensorwise only
            plan = forward_plan(*big, 32, 8, 1e-6, "after_rope", "triton", fp8_key=name)
            assert (plan.fused is not None) == (name == "tensorwise")
        with config.override(fused_forward="auto", fused_forward_fp8="on"):
            assert forward_plan(*big, 32, 8, 1e-6, "after_rope", "triton", fp8_key=name).fused is not None
            assert forward_plan(*small, 32, 8, 1e-6, "after_rope", "triton", fp8_key=name).fused is None
            plan = forward_plan(*big, 32, 8, 1e-6, "after_rope", "triton", residual=True, fp8_key=name)
            assert plan.fused is None and plan.fused_lora is None
        with config.override(fused_forward="auto", fused_forward_fp8="off"):
            assert forward_plan(*big, 32, 8, 1e-6, "after_rope", "triton", fp8_key=name).fused is None
