"""fusedqkv.distributed without a process group: the TP row order and its inverse, argument
errors; and the block under torch.autocast (DDP's usual mixed precision)."""


import pytest
import torch
from torch import nn

import fusedqkv
from fusedqkv import distributed as fdist


@pytest.mark.parametrize("hq,hkv,d,tp", [(4, 2, 8, 2), (32, 8, 16, 2), (32, 8, 16, 4), (8, 8, 4, 8), (6, 3, 2, 3)])
def test_tp_row_order_gives_each_rank_its_heads(hq, hkv, d, tp):
    hidden = 5
    w = torch.randn((hq + 2 * hkv) * d, hidden)
    q, k, v = w.split([hq * d, hkv * d, hkv * d])
    shards = fdist.to_tp_rows(w, hq, hkv, tp).chunk(tp)
    for r, shard in enumerate(shards):
        # rank r: query heads [r*hq/tp, (r+1)*hq/tp), KV heads [r*hkv/tp, (r+1)*hkv/tp) -- the
        # KV heads its query heads attend to (query head h uses KV head h // (hq/hkv))
        assert torch.equal(shard, torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]]))
        q_heads = range(r * hq // tp, (r + 1) * hq // tp)
        assert {h // (hq // hkv) for h in q_heads} == set(range(r * hkv // tp, (r + 1) * hkv // tp))
    assert torch.equal(fdist.to_canonical_rows(fdist.to_tp_rows(w, hq, hkv, tp), hq, hkv, tp), w)
    perm = fdist.tp_row_order(hq, hkv, d, tp)
    assert sorted(perm.tolist()) == list(range(w.shape[0]))


def test_tp_row_order_is_identity_for_one_rank():
    assert torch.equal(fdist.tp_row_order(32, 8, 4, 1), torch.arange(48 * 4))


def test_local_shard_is_a_working_block():
    """The local shard [Q_r | K_r | V_r] with local head counts computes exactly rank r's heads."""
    hq, hkv, d, tp, hidden = 8, 4, 8, 2, 24
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(hidden, hq, hkv, d)
    x = torch.randn(2, 5, hidden)
    cos, sin = torch.randn(2, 5, d), torch.randn(2, 5, d)
    q, k, v = block(x, cos, sin)
    for r, w_r in enumerate(fdist.to_tp_rows(block.qkv_weight.detach(), hq, hkv, tp).chunk(tp)):
        q_r, k_r, v_r = fusedqkv.gqa_qkv_rope_qk_norm(x, w_r, block.q_norm_weight, block.k_norm_weight, cos, sin,
                                                      num_heads=hq // tp, num_kv_heads=hkv // tp)
        torch.testing.assert_close(q_r, q.chunk(tp, dim=1)[r], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_r, k.chunk(tp, dim=1)[r], rtol=1e-6, atol=1e-6)
        assert torch.equal(v_r, v.chunk(tp, dim=1)[r])


@pytest.mark.parametrize("hq,hkv,d,tp", [(4, 1, 8, 2), (8, 2, 4, 4), (16, 2, 2, 8), (8, 1, 4, 8), (12, 3, 2, 6)])
def test_fewer_kv_heads_than_ranks_stores_each_kv_head_in_pieces(hq, hkv, d, tp):
    """Rank r stores its query heads and the (r % rep)-th of rep equal pieces of the rows [K_g |
    V_g] of the KV head g = r // rep its query heads use; the pieces of the ranks sharing g, in
    rank order, are those rows -- what the forward's all-gather gives -- and the TP row order
    is a permutation (every row stored once)."""
    hidden = 3
    w = torch.randn((hq + 2 * hkv) * d, hidden)
    q, k, v = w.split([hq * d, hkv * d, hkv * d])
    rep = tp // hkv
    assert fdist.kv_replicas(hkv, tp) == rep
    perm = fdist.tp_row_order(hq, hkv, d, tp)
    assert sorted(perm.tolist()) == list(range(w.shape[0]))
    shards = fdist.to_tp_rows(w, hq, hkv, tp).chunk(tp)
    q_rows = hq // tp * d
    for r, shard in enumerate(shards):
        g = r // rep
        assert torch.equal(shard[:q_rows], q.chunk(tp)[r])
        q_heads = range(r * hq // tp, (r + 1) * hq // tp)
        assert {h // (hq // hkv) for h in q_heads} == {g}
        gathered = torch.cat([s[q_rows:] for s in shards[g * rep:(g + 1) * rep]])
        assert torch.equal(gathered, torch.cat([k.chunk(hkv)[g], v.chunk(hkv)[g]]))
    assert torch.equal(fdist.to_canonical_rows(fdist.to_tp_rows(w, hq, hkv, tp), hq, hkv, tp), w)
    b = torch.randn((hq + 2 * hkv) * d)  # 1-D (a bias) too
    assert torch.equal(fdist.to_canonical_rows(fdist.to_tp_rows(b, hq, hkv, tp), hq, hkv, tp), b)


def test_kv_pieces_need_2_head_dim_divisible_by_the_replicas():
    with pytest.raises(ValueError, match=r"tp=8: head_dim=2 with num_kv_heads=1: .*divisible by tp/num_kv_heads=8"):
        fdist.tp_row_order(8, 1, 2, 8)
    with pytest.raises(ValueError, match=r"head_dim=3"):
        fdist.require_tp_divisible(4, 1, 4, head_dim=3)
    fdist.require_tp_divisible(4, 1, 4, head_dim=2)


@pytest.mark.parametrize("hq,hkv,tp", [(32, 8, 3), (6, 3, 2), (2, 1, 4), (12, 4, 6), (8, 2, 16)])
def test_not_divisible_is_a_clear_error(hq, hkv, tp):
    with pytest.raises(ValueError, match=rf"tp={tp}: num_heads={hq} and num_kv_heads={hkv}: .*divisible"):
        fdist.tp_row_order(hq, hkv, 4, tp)
    with pytest.raises(ValueError, match=rf"tp={tp}: num_heads={hq} and num_kv_heads={hkv}"):
        fdist.require_tp_divisible(hq, hkv, tp)


def test_row_count_must_match_the_heads():
    with pytest.raises(ValueError, match=r"weight: expected \(num_heads \+ 2\*num_kv_heads\)\*head_dim"):
        fdist.to_tp_rows(torch.zeros(50, 3), 4, 2, 2)


@pytest.mark.parametrize("tp", [0, -1, 2.0, True])
def test_bad_tp_size(tp):
    with pytest.raises(ValueError, match="tp: expected a positive int"):
        fdist.require_tp_divisible(4, 2, tp)


def test_bad_input_layouts():
    from torch.distributed.tensor import Partial, Shard

    for layout in (Shard(0), Shard(2), Partial()):
        with pytest.raises(ValueError, match="input_layouts"):
            fdist.HeadParallelQKV(input_layouts=layout)
    assert fdist.HeadParallelQKV(input_layouts=Shard(-2)).input_layouts == Shard(1)


def test_tp_plan_finds_the_blocks():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Module()
            self.attn.qkv = fusedqkv.GQAQKVRoPEQKNorm(16, 4, 2, 4)
            self.attn.o_proj = nn.Linear(16, 16)
            self.ref = fusedqkv.ReferenceGQAQKVRoPEQKNorm(16, 4, 2, 4)

    plan = fdist.tp_plan(Layer(), use_local_output=False)
    assert sorted(plan) == ["attn.qkv", "ref"]
    assert all(isinstance(s, fdist.HeadParallelQKV) and not s.use_local_output for s in plan.values())
    with pytest.raises(ValueError, match="contains no fusedqkv"):
        fdist.tp_plan(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="parallelize_block"):
        fdist.tp_plan(fusedqkv.GQAQKVRoPEQKNorm(16, 4, 2, 4))


def test_full_qkv_weight_of_a_plain_block():
    block = fusedqkv.GQAQKVRoPEQKNorm(16, 4, 2, 4)
    assert torch.equal(fdist.full_qkv_weight(block), block.qkv_weight)


@pytest.mark.parametrize("position", ["after_rope", "before_rope"])
def test_autocast_runs_the_block_in_the_autocast_dtype(position):
    """fp32 parameters under torch.autocast(bf16): the same as an explicit bf16 call, gradients
    in the parameters' dtype; also when backward runs inside the autocast region."""
    torch.manual_seed(0)
    block = fusedqkv.GQAQKVRoPEQKNorm(32, 4, 2, 8, qk_norm_position=position)
    x = torch.randn(2, 6, 32)
    cos, sin = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    g = [torch.randn(2, h, 6, 8) for h in (4, 2, 2)]
    xb = x.bfloat16().requires_grad_()
    wb = block.qkv_weight.detach().bfloat16().requires_grad_()
    ref = fusedqkv.gqa_qkv_rope_qk_norm(xb, wb, block.q_norm_weight, block.k_norm_weight, cos.bfloat16(),
                                        sin.bfloat16(), num_heads=4, num_kv_heads=2, qk_norm_position=position)
    ref_grads = torch.autograd.grad(ref, [xb, wb], [t.bfloat16() for t in g])
    for backward_inside in (False, True):
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(xx, cos, sin)
            if backward_inside:
                grads = torch.autograd.grad(out, [xx, block.qkv_weight], [t.bfloat16() for t in g])
        if not backward_inside:
            grads = torch.autograd.grad(out, [xx, block.qkv_weight], [t.bfloat16() for t in g])
        for o, r in zip(out, ref):
            assert o.dtype == torch.bfloat16 and torch.equal(o, r)
        assert grads[0].dtype == grads[1].dtype == torch.float32
        assert torch.equal(grads[0], ref_grads[0].float()) and torch.equal(grads[1], ref_grads[1].float())


def test_autocast_with_bf16_inputs_and_fp32_weights():
    """A bf16 activation (from an earlier autocast op) with fp32 weights validates under autocast."""
    block = fusedqkv.GQAQKVRoPEQKNorm(16, 2, 1, 8)
    x = torch.randn(1, 3, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = block(x, cos, sin)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):  # outside autocast the dtypes must agree
        block(x, cos, sin)


@pytest.mark.parametrize("kw", [dict(q_gate=True), dict(norm_weight=False), dict(norm_scope="all_heads"),
                                dict(v_norm=True), dict(rope_style="interleaved")])
def test_the_block_variants_are_refused_not_sharded_wrongly(kw):
    """Issue 25's variants change the rows and norms the head-parallel plan shards: a clear error."""
    from fusedqkv import GQAQKVRoPEQKNorm

    with pytest.raises(NotImplementedError, match="variants"):
        fdist.HeadParallelQKV()._apply(GQAQKVRoPEQKNorm(16, 2, 1, 8, **kw), None)
