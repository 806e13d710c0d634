"""PEFT LoRA inside the fused block (integrations.peft), and nothing in the projection's place
bypassed (integrations.fused_projection): tiny models of five families against the same PEFT
model without fusedqkv, fp32 on the CPU, both orders (apply_to then get_peft_model, and back)."""

import copy
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations.fused_projection import (_ANNOUNCED_UNGUARDED, ProjectionRows,  # noqa: E402
                                                     UnsupportedModuleError)
from fusedqkv.ops.internals import GUARDS_HOOK_DICT_READS  # noqa: E402

from _fp8_cpu import needs_cpu_row_scales, needs_torchao_mx_training  # noqa: E402
from _hf_families import build, family  # noqa: E402
from _lora_checks import add_hook, assert_bf16_like_peft, rel as _rel, step as _step  # noqa: E402

# Qwen3 (the common recipe), Qwen3.5 (gated q: its q_proj rows are [q | gate] per head, and the
# LoRA B rows follow them as in HF; partial rotary), OLMo 3 (the norm across heads), GLM-4.5
# (glm4_moe: partial rotary, q/k/v biases), Dory (transformers >= 5.25: L2 norms, a layer run twice a step)
FAMILIES = ["qwen3", "qwen3_5_text", "olmo3", "glm4_moe", "dory"]
TARGETS = {"all_linear": "all-linear", "q_v": ["q_proj", "v_proj"]}
TOL = 1e-5


def _ids(vocab, seed=0, shape=(2, 7)):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _lora(targets, **kw):
    # init_lora_weights=False: B random, so that every adapter changes the output
    return LoraConfig(target_modules=targets, init_lora_weights=False, **dict(dict(r=4, lora_alpha=8), **kw))


def _pair(fam_name, config, order, seed=0):
    """(PEFT model with fusedqkv, the same PEFT model without), equal adapters."""
    base = build(family(fam_name), bias=True, seed=seed)
    torch.manual_seed(seed + 10)
    ref = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    if order == "peft_first":
        m = copy.deepcopy(ref)
        assert fusedqkv.apply_to(m) == family(fam_name).n_fused
    else:
        m = copy.deepcopy(base)
        fusedqkv.apply_to(m)
        m = get_peft_model(m, copy.deepcopy(config))
        set_peft_model_state_dict(m, get_peft_model_state_dict(ref))
    return m, ref, base


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
@pytest.mark.parametrize("targets", list(TARGETS), ids=list(TARGETS))
@pytest.mark.parametrize("fam", FAMILIES)
def test_lora_logits_and_adapter_gradients_match_peft(fam, targets, order):
    m, ref, base = _pair(fam, _lora(TARGETS[targets]), order)
    ids = _ids(m.config.vocab_size)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert _rel(got, base(input_ids=ids).logits.detach()) > 1e-3  # the adapters are live
    assert sorted(g) == sorted(w) and any(".q_proj.lora_A." in n for n in g)
    ill = [n for n in w if g[n] is None or _rel(g[n], w[n]) > TOL]
    if ill:
        # a gradient that fp32 itself resolves worse than TOL (OLMo 3's norm across heads cancels in
        # layer 0's q adapter: PEFT's own fp32 gradient is 6.7e-5 off float64 there): the three-way
        # rule against PEFT in float64: at most twice PEFT's own fp32 error, plus TOL
        _, w64 = _step(copy.deepcopy(ref).double(), ids)
    for name in w:  # every trainable parameter is an adapter's; the fused weight is frozen
        assert g[name] is not None, name
        if name in ill:
            assert _rel(g[name], w64[name]) <= 2 * _rel(w[name], w64[name]) + TOL, name
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    assert not attn.qkv_proj.weight.requires_grad and attn.qkv_proj.weight.grad is None  # no dW GEMM



def test_create_graph_through_the_lora_block():
    """backward(create_graph=True) through the LoRA block: the adapters' first-order gradients are
    PEFT's, and a backward through them is refused with the reason."""
    m, ref, _ = _pair("qwen3", _lora("all-linear"), "apply_first")
    ids = _ids(m.config.vocab_size)
    got = {}
    for x in (m, ref):
        params = [p for n, p in x.named_parameters() if ".q_proj.lora_A." in n]
        got[x] = torch.autograd.grad(x(input_ids=ids, labels=ids).loss, params, create_graph=True)
    for a, b in zip(got[m], got[ref]):
        assert _rel(a.detach(), b.detach()) <= TOL
    with pytest.raises(RuntimeError, match="fused block's backward is not itself differentiable"):
        sum(g.square().sum() for g in got[m]).backward()

def _check_round_trip(m, ref, base, ids, tmp_path):
    """Adapters saved from the fused PEFT model load into the unfused one and back, the logits equal; the fused
    model's adapter and base keys are PEFT's and HF+PEFT's (<proj>.base_layer.*)."""
    m.save_pretrained(tmp_path / "fused")
    unfused = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "fused")
    assert _rel(unfused(input_ids=ids).logits, m(input_ids=ids).logits) <= TOL
    ref.save_pretrained(tmp_path / "unfused")
    fused_base = copy.deepcopy(base)
    fusedqkv.apply_to(fused_base)
    fused = PeftModel.from_pretrained(fused_base, tmp_path / "unfused")
    assert _rel(fused(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    assert list(get_peft_model_state_dict(m)) == list(get_peft_model_state_dict(ref))
    assert list(m.state_dict()) == list(ref.state_dict())


ERGO_TARGETS = {"all_linear": "all-linear", "qkv_proj": ["qkv_proj"]}


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
@pytest.mark.parametrize("targets", list(ERGO_TARGETS), ids=list(ERGO_TARGETS))
def test_lora_on_hfs_own_joined_qkv_proj(targets, order):
    """Ergo's HF attention has one qkv_proj Linear: after apply_to that name is the rows module over all
    rows (the fused parameter is qkv_fused), so PEFT wraps it as it wraps the unfused model's, by name and by
    all-linear; the adapter's B rows are [Q | K | V], applied in the block."""
    m, ref, base = _pair("ergo", _lora(ERGO_TARGETS[targets]), order)
    ids = _ids(m.config.vocab_size, 11)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert _rel(got, base(input_ids=ids).logits.detach()) > 1e-3  # the adapters are live
    assert sorted(g) == sorted(w) and any(".qkv_proj.lora_A." in n for n in g)
    for name in w:
        assert g[name] is not None and _rel(g[name], w[name]) <= TOL, name
    attns = [mod for mod in m.modules() if hasattr(mod, "_fusedqkv")]
    assert len(attns) == family("ergo").n_fused
    for attn in attns:
        assert type(attn.qkv_proj.base_layer) is ProjectionRows and attn.qkv_proj.base_layer.rows == (0, 128)
        assert not attn.qkv_fused.weight.requires_grad and attn.qkv_fused.weight.grad is None  # no dW GEMM


def test_joined_qkv_proj_adapters_round_trip_merge_and_compile(tmp_path):
    m, ref, base = _pair("ergo", _lora("all-linear"), "apply_first")
    ids = _ids(m.config.vocab_size, 12)
    _check_round_trip(m, ref, base, ids, tmp_path)  # (HF+PEFT's qkv_proj.base_layer.weight)
    # each fused attention of the PEFT model as one graph, through AOT autograd
    c = copy.deepcopy(m)
    for mod in c.modules():
        if hasattr(mod, "_fusedqkv"):
            mod.compile(backend="aot_eager", fullgraph=True)
    got, g = _step(c, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL and all(_rel(g[n], w[n]) <= TOL for n in w)
    merged, merged_ref = m.merge_and_unload(), ref.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.qkv_proj) is ProjectionRows  # the update in the fused weight
    assert _rel(merged(input_ids=ids).logits, merged_ref(input_ids=ids).logits) <= TOL
    sd, sd_ref = merged.state_dict(), merged_ref.state_dict()
    assert list(sd) == list(sd_ref) and all(_rel(sd[k], sd_ref[k]) <= TOL for k in sd_ref if sd_ref[k].is_floating_point()
                                            and sd_ref[k].abs().max() > 0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_dropout_rslora_and_rank_patterns(dropout):
    cfg = _lora("all-linear", lora_dropout=dropout, use_rslora=True, rank_pattern={"k_proj": 2},
                alpha_pattern={"v_proj": 3})
    m, ref, _ = _pair("qwen3", cfg, "apply_first")
    m.train()
    ref.train()
    ids = _ids(m.config.vocab_size, 2)
    torch.manual_seed(5)  # the same dropout masks: the fused block draws them in q, k, v order as PEFT does
    got, g = _step(m, ids)
    torch.manual_seed(5)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    for name in w:
        assert _rel(g[name], w[name]) <= TOL, name


def test_adapters_round_trip_between_fused_and_unfused(tmp_path):
    m, ref, base = _pair("qwen3", _lora("all-linear"), "apply_first")
    _check_round_trip(m, ref, base, _ids(m.config.vocab_size, 3), tmp_path)


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unload_matches_peft(safe_merge):
    m, ref, _ = _pair("qwen3", _lora(["q_proj", "k_proj", "v_proj"]), "apply_first")
    ids = _ids(m.config.vocab_size, 4)
    want = ref(input_ids=ids).logits
    merged = m.merge_and_unload(safe_merge=safe_merge)
    merged_ref = ref.merge_and_unload(safe_merge=safe_merge)
    attn = merged.model.layers[0].self_attn
    assert type(attn.q_proj) is ProjectionRows  # the rows again, the update in the fused weight
    assert _rel(merged(input_ids=ids).logits, want) <= TOL
    sd, sd_ref = merged.state_dict(), merged_ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert _rel(sd[k], sd_ref[k]) <= TOL if sd_ref[k].abs().max() > 0 else torch.equal(sd[k], sd_ref[k]), k


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_modules_to_save_on_the_q_norm(order):
    """PEFT's modules_to_save naming q_norm: the block takes the trained copy's weight (PEFT's wrapper gives it),
    logits and the copy's gradients as PEFT's without fusedqkv; the adapter disabled, the original's; a hook on
    the copy refused (session 36: the norm checks after apply_to first refused the wrapper itself)."""
    m, ref, _ = _pair("qwen3", _lora(["q_proj", "v_proj"], modules_to_save=["q_norm"]), order)
    for model in (m, ref):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "q_norm.modules_to_save" in name:
                    p.mul_(3.0)  # a trained copy that differs from the original
    ids = _ids(m.config.vocab_size, 6)
    got, want = m(input_ids=ids).logits, ref(input_ids=ids).logits
    assert _rel(got, want) <= TOL
    got.square().mean().backward()
    want.square().mean().backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if "q_norm.modules_to_save" in n}
    assert len(grads) == 2
    for n, p in m.named_parameters():
        if n in grads:
            assert _rel(p.grad, grads.pop(n)) <= TOL, n
    assert not grads
    with m.disable_adapter(), ref.disable_adapter():
        assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    copy_ = m.base_model.model.model.layers[0].self_attn.q_norm.modules_to_save["default"]
    handle = copy_.register_forward_hook(lambda mod, i, o: o)
    with pytest.raises(UnsupportedModuleError, match=r"q_norm.modules_to_save.default has a forward hook"):
        m(input_ids=ids)
    handle.remove()
    m(input_ids=ids)


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_modules_to_save_on_a_projection_is_refused_with_the_reason(order):
    """PEFT's modules_to_save naming v_proj (a trainable copy of it): refused in both orders, naming
    modules_to_save; PEFT matches those names as suffixes, so after apply_to it wraps qkv_proj too, which the
    message says (it was refused before with no word of modules_to_save)."""
    base = build(family("qwen3"), bias=True)
    config = _lora(["o_proj"], modules_to_save=["v_proj"])
    if order == "apply_first":
        fusedqkv.apply_to(base)
        m = get_peft_model(base, config)
        with pytest.raises(UnsupportedModuleError, match=r"qkv_proj is a peft.*ModulesToSaveWrapper.*modules_to_save "
                                                         r".*'v_proj' also takes 'qkv_proj'"):
            m(input_ids=_ids(m.config.vocab_size))
    else:
        m = get_peft_model(base, config)
        with pytest.raises(fusedqkv.UnsupportedModelError, match=r"v_proj is a peft\.[\w.]*\.ModulesToSaveWrapper.*PEFT's "
                                                                 r"modules_to_save"):
            fusedqkv.apply_to(m)


def test_disable_adapter_set_adapter_and_unload():
    m, ref, base = _pair("qwen3", _lora("all-linear"), "apply_first")
    ids = _ids(m.config.vocab_size, 5)
    plain = base(input_ids=ids).logits
    with m.disable_adapter():
        assert _rel(m(input_ids=ids).logits, plain) <= TOL
    torch.manual_seed(20)
    second = _lora(["q_proj", "v_proj"])
    m.add_adapter("second", second)
    torch.manual_seed(20)
    ref.add_adapter("second", copy.deepcopy(second))
    set_peft_model_state_dict(m, get_peft_model_state_dict(ref, adapter_name="second"), adapter_name="second")
    for names in ("second", ["default", "second"]):
        for model in (m, ref):
            model.base_model.set_adapter(names)
        assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    unloaded = m.unload()
    assert _rel(unloaded(input_ids=ids).logits, plain) <= TOL


def _two_adapter_pair(fam, order, targets="all-linear"):
    """A fused PEFT model and the same without fusedqkv, each with adapters 'default' (``targets``) and
    'second' (q/v only, another rank), equal adapters."""
    m, ref, base = _pair(fam, _lora(targets), order)
    torch.manual_seed(20)
    ref.add_adapter("second", _lora(["q_proj", "v_proj"], r=2))
    if order == "peft_first":
        m = copy.deepcopy(ref)
        fusedqkv.apply_to(m)
    else:
        m.add_adapter("second", _lora(["q_proj", "v_proj"], r=2))
        set_peft_model_state_dict(m, get_peft_model_state_dict(ref, adapter_name="second"), adapter_name="second")
    return m.eval(), ref.eval()


# GLM-4.5: attention only (PEFT's own mixed batches refuse its MoE router's ParamWrapper)
MIXED = {"qwen3": "all-linear", "qwen3_5_text": "all-linear", "olmo3": "all-linear",
         "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize("fam,order", [("qwen3", "apply_first"), ("qwen3", "peft_first"), ("qwen3_5_text", "apply_first"),
                                       ("olmo3", "peft_first"), ("glm4_moe", "apply_first")])
def test_mixed_batch_adapter_names_match_peft(fam, order):
    """PEFT's mixed-batch inference (one adapter per sample, "__base__" for none: ``adapter_names=``, given to
    the LoRA layers by forward pre-hooks) computed by the block: logits and greedy generation as PEFT's without
    fusedqkv (session 41: refused as "a forward pre-hook" before)."""
    m, ref = _two_adapter_pair(fam, order, MIXED[fam])
    ids = _ids(m.config.vocab_size, 7, shape=(4, 6))
    outs = {}
    for names in (["default", "second", "__base__", "second"], ["second"] * 4, ["__base__"] * 4):
        got, want = m(input_ids=ids, adapter_names=names).logits, ref(input_ids=ids, adapter_names=names).logits
        assert _rel(got, want) <= TOL, names
        outs[tuple(names)] = want
    assert _rel(outs[("second",) * 4], ref(input_ids=ids).logits) > 1e-3  # the names, not the active adapter
    assert _rel(outs[("__base__",) * 4], ref(input_ids=ids).logits) > 1e-3
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL  # and after them, the active one
    names = ["second", "default", "__base__", "default"]
    kw = dict(max_new_tokens=4, do_sample=False, adapter_names=names)
    if fam == "qwen3":  # beam search: PEFT repeats each sample's name per beam
        kw["num_beams"] = 2
    assert torch.equal(m.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


def test_mixed_batch_refusals():
    """Under adapter_names: PEFT's own errors where PEFT raises them (merged adapters, a wrong length); a hook of
    the user's beside PEFT's refused, also when it comes in PEFT's place between two calls (the kept plan's
    fingerprint holds the hooks' functions); modules_to_save on a norm the block computes refused by name.
    (A fresh pair after each error: PEFT leaves its adapter_names hooks on the layers when the forward raises.)"""
    ids = _ids(97, 8, shape=(2, 5))
    for model in _two_adapter_pair("qwen3", "apply_first"):
        with pytest.raises(ValueError, match="Length of `adapter_names` should be the same"):
            model(input_ids=ids, adapter_names=["default"] * 3)
    for model in _two_adapter_pair("qwen3", "apply_first"):
        model.merge_adapter(["default"])
        with pytest.raises(ValueError, match="Cannot pass `adapter_names` when there are merged adapters"):
            model(input_ids=ids, adapter_names=["default", "second"])
    m, ref = _two_adapter_pair("qwen3", "apply_first")
    m(input_ids=ids, adapter_names=["default", "second"])  # a plan kept with PEFT's hook function
    attn = m.base_model.model.model.layers[0].self_attn
    handles = [getattr(attn, p).register_forward_pre_hook(lambda mod, args: None) for p in ("q_proj", "k_proj", "v_proj")]
    with pytest.raises(UnsupportedModuleError, match=r"q_proj has a forward pre-hook"):
        m(input_ids=ids)
    for handle in handles:
        handle.remove()
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    m, _ = _two_adapter_pair("qwen3", "apply_first")
    m.base_model.model.model.layers[1].self_attn.v_proj.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(UnsupportedModuleError, match=r"v_proj has a forward pre-hook"):
        m(input_ids=ids, adapter_names=["default", "second"])
    saved, _, _ = _pair("qwen3", _lora(["q_proj", "v_proj"], modules_to_save=["q_norm"]), "apply_first")
    saved.add_adapter("second", _lora(["q_proj", "v_proj"], modules_to_save=["q_norm"]))
    saved.eval()
    saved(input_ids=ids)
    with pytest.raises(UnsupportedModuleError, match=r"q_norm is PEFT's modules_to_save under mixed-batch inference"):
        saved(input_ids=ids, adapter_names=["default", "second"])


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_hotswap_pissa_olora_and_layer_replication_match_peft(tmp_path, order):
    """PEFT's workflows that write the adapters' or the base's weights in place, as PEFT's without fusedqkv:
    hotswapping an adapter of another rank and alpha (with prepare_model_for_compiled_hotswap: the scalings
    become tensors written in place), PiSSA and OLoRA (they rewrite the base weight: the fused rows), and
    layer_replication (layers sharing the base weights, own adapters)."""
    from peft import PeftModel
    from peft.utils.hotswap import hotswap_adapter, prepare_model_for_compiled_hotswap

    base = build(family("qwen3"), bias=True, seed=0)
    ids = _ids(base.config.vocab_size, 9)
    for seed, cfg, d in ((1, _lora("all-linear"), tmp_path / "a"), (2, _lora(["q_proj", "v_proj"], r=8, lora_alpha=32),
                                                                    tmp_path / "b")):
        torch.manual_seed(seed)
        get_peft_model(copy.deepcopy(base), cfg).save_pretrained(d)

    def load(fuse):
        b = copy.deepcopy(base)
        if fuse and order == "apply_first":
            fusedqkv.apply_to(b)
        m = PeftModel.from_pretrained(b, tmp_path / "a")
        if fuse and order == "peft_first":
            fusedqkv.apply_to(m)
        prepare_model_for_compiled_hotswap(m, target_rank=8)
        return m

    m, ref = load(True), load(False)
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    for model in (m, ref):
        hotswap_adapter(model, tmp_path / "b", "default")
    want = ref(input_ids=ids).logits
    assert _rel(m(input_ids=ids).logits, want) <= TOL
    assert _rel(want, PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "b")(input_ids=ids).logits) <= TOL
    for init in ("pissa_niter_2", "olora"):  # (randomised SVD: both from one seed)
        cfg = LoraConfig(target_modules="all-linear", r=4, init_lora_weights=init)
        torch.manual_seed(3)
        ref = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg))
        torch.manual_seed(3)
        if order == "peft_first":
            m = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg))
            fusedqkv.apply_to(m)
        else:
            m = copy.deepcopy(base)
            fusedqkv.apply_to(m)
            m = get_peft_model(m, copy.deepcopy(cfg))
        q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
        plain = base.state_dict()["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(m.state_dict()[q], ref.state_dict()[q]) and not torch.equal(ref.state_dict()[q], plain)
        assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    replicated = _lora("all-linear", layer_replication=[[0, 2], [1, 2]])
    if order == "peft_first":
        with pytest.raises(Exception, match="is tied"):
            _pair("qwen3", replicated, order)
        return
    m, ref, _ = _pair("qwen3", replicated, order)
    for model in (m, ref):  # (PEFT leaves HF's per-layer list at the old depth)
        model.base_model.model.model.config.layer_types = ["full_attention"] * 3
    layers = m.base_model.model.model.layers
    assert layers[1].self_attn.qkv_proj.weight is layers[2].self_attn.qkv_proj.weight
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL and sorted(g) == sorted(w)
    assert all(_rel(g[n], w[n]) <= TOL for n in w)


def test_gradient_checkpointing_and_compile():
    m, ref, _ = _pair("qwen3", _lora("all-linear"), "apply_first")
    ids = _ids(m.config.vocab_size, 6)
    for model in (m, ref):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL and all(_rel(g[n], w[n]) <= TOL for n in w)
    m.gradient_checkpointing_disable()
    ref.gradient_checkpointing_disable()
    # each fused attention of the PEFT model as one graph (raises on a graph break), through AOT autograd
    attns = [mod for mod in m.modules() if hasattr(mod, "_fusedqkv")]
    assert attns
    for mod in attns:
        mod.compile(backend="aot_eager", fullgraph=True)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL and all(_rel(g[n], w[n]) <= TOL for n in w)


def _hook(mod, kind="forward_hook"):
    return add_hook(mod, kind)


class _Undo:
    """A change to a module and how to take it back (``remove()``, as a hook handle's)."""

    def __init__(self, do, undo):
        do()
        self.remove = undo


def _forward_set(mod):
    return _Undo(lambda: setattr(mod, "forward", lambda x: x), lambda: mod.__dict__.pop("forward"))


def _swap(attn, name, new):
    old = attn._modules[name]
    return _Undo(lambda: attn._modules.__setitem__(name, new), lambda: attn._modules.__setitem__(name, old))


# (label, peft, what is changed after the compiled model ran once, the error's words)
COMPILED_CHANGES = [
    ("forward hook on q_proj", False, lambda a: _hook(a.q_proj), "q_proj has a forward hook"),
    ("pre-hook on qkv_proj", False, lambda a: _hook(a.qkv_proj, "forward_pre_hook"),
     "qkv_proj has a forward pre-hook"),
    ("backward hook on k_proj", False, lambda a: _hook(a.k_proj, "full_backward_hook"),
     "k_proj has a backward hook"),
    ("foreign k_proj", False, lambda a: _swap(a, "k_proj", nn.Linear(a.k_proj.in_features, a.k_proj.out_features)),
     "k_proj is a torch.nn.modules.linear.Linear"),
    ("forward hook on the LoRA layer", True, lambda a: _hook(a.q_proj), "q_proj has a forward hook"),
    ("forward hook on lora_A", True, lambda a: _hook(a.q_proj.lora_A["default"]), "has a forward hook"),
    ("forward set on the LoRA layer", True, lambda a: _forward_set(a.q_proj), "q_proj has a replaced forward"),
    ("forward set on lora_A", True, lambda a: _forward_set(a.q_proj.lora_A["default"]), "has a replaced forward"),
    ("pre-hook on the rows under LoRA", True, lambda a: _hook(a.v_proj.base_layer, "forward_pre_hook"),
     "v_proj.base_layer has a forward pre-hook"),
]


@pytest.mark.parametrize("peft", [False, True], ids=["rows", "lora"])
def test_changes_after_compiling_are_refused_not_bypassed(peft):
    """A hook or a module put in the projection's place after the compiled model ran (torch.compile's
    default, graph breaks allowed): the next call raises as in eager -- the checks are traced, and
    torch.compile guards on what they read (compiled graphs would otherwise run the fused block past
    the new module) -- and once the change is taken back the model runs as before. fusedqkv's own
    modules refuse a hook or a forward as it is registered or set (a hook written into their hook
    dicts is refused at the next call); a PEFT layer or its lora_A with a hook or a forward set, at the
    next call. On torch 2.11, whose torch.compile guards no empty module hook dict unless
    ``skip_nnmodule_hook_guards`` is off, with that setting off (the warned remedy: the test below)."""
    m = build(family("qwen3"), bias=True)
    fusedqkv.apply_to(m)
    if peft:
        m = get_peft_model(m, _lora("all-linear"))
    ids = _ids(m.config.vocab_size)
    want = m(input_ids=ids).logits
    graphs = []

    def eager_recorded(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # the first layer's attention compiled (the second one, eager, runs the same checks untraced)
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=GUARDS_HOOK_DICT_READS):
        attn.compile(backend=eager_recorded)
        assert torch.equal(m(input_ids=ids).logits, want)
        assert len(graphs) == 1
        rows = attn.v_proj.base_layer if peft else attn.v_proj
        for mod in (rows, attn.qkv_proj):  # a forward set on the fused modules is refused as it is set
            with pytest.raises(UnsupportedModuleError, match="forward cannot be set"):
                mod.forward = lambda x: x
        for label, on_peft, change, words in COMPILED_CHANGES:
            if on_peft != peft:
                continue
            handle = change(attn)
            with pytest.raises(UnsupportedModuleError, match=words):
                m(input_ids=ids)
            handle.remove()
            assert torch.equal(m(input_ids=ids).logits, want), label
    # Dynamo runs a frame that raised without its graph from then on (the attention traced in pieces);
    # torch.compiler.reset() has each attention compiled as one graph again (the README says so)
    torch.compiler.reset()
    graphs.clear()
    assert torch.equal(m(input_ids=ids).logits, want)
    assert len(graphs) == 1


@pytest.mark.parametrize("peft", [False, True], ids=["rows", "lora"])
def test_compiling_where_torch_would_not_see_new_hooks_is_warned(peft):
    """torch 2.11's torch.compile guards no module hook dict that was empty when it compiled (its default
    ``skip_nnmodule_hook_guards``): compiling a fused attention with a PEFT layer in a projection's place
    warns once, naming the setting that has such hooks refused (fusedqkv's own modules refuse hooks as
    they are registered: nothing to warn of). Torch 2.12 on: no warning."""
    m = build(family("qwen3"), bias=True)
    fusedqkv.apply_to(m)
    if peft:
        m = get_peft_model(m, _lora(["q_proj", "v_proj"]))
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    torch._dynamo.reset()  # (a compiled frame that raised in an earlier test is skipped from then on)
    attn.compile(backend="eager", fullgraph=True)  # (the announcement runs as torch.compile traces: no break)
    _ANNOUNCED_UNGUARDED.discard(type(attn).__name__)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m(input_ids=_ids(m.config.vocab_size))
    said = [str(w.message) for w in seen if "skip_nnmodule_hook_guards" in str(w.message)]
    assert len(said) == (1 if peft and not GUARDS_HOOK_DICT_READS else 0), said



@pytest.mark.parametrize("where", ["lora_layer", "base_layer"])
def test_a_backward_hook_under_peft_is_refused_by_apply_to(where):
    """PEFT first, then a backward hook on the LoRA layer or the Linear under it: apply_to refuses it (session 37:
    only forward hooks were looked for there; the base layer and its hook were then replaced by the fused rows)."""
    m = get_peft_model(build(family("qwen3"), bias=True), _lora(["v_proj"]))
    v = m.base_model.model.model.layers[0].self_attn.v_proj
    (v if where == "lora_layer" else v.base_layer).register_full_backward_hook(lambda mod, gi, go: None)
    name = "v_proj" if where == "lora_layer" else "v_proj.base_layer"
    with pytest.raises(fusedqkv.UnsupportedModelError, match=rf"self_attn\.{name} has a backward hook"):
        fusedqkv.apply_to(m)


def test_dora_is_refused():
    m, _, _ = _pair("qwen3", _lora(["q_proj", "v_proj"], use_dora=True), "apply_first")
    with pytest.raises(UnsupportedModuleError, match="DoRA"):
        m(input_ids=_ids(m.config.vocab_size))


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_other_lora_variants_are_refused_by_name(order):
    """A PEFT LoRA variant other than DoRA (here aLoRA: the adapter applies from an invocation token on) is named
    in the refusal, with the variant's own reason (session 39: the message gave DoRA's)."""
    if not hasattr(peft.tuners.lora.variants, "ALoraLinearVariant"):
        pytest.skip("this PEFT has no aLoRA")
    m, _, _ = _pair("qwen3", _lora(["q_proj", "v_proj"], alora_invocation_tokens=[5]), order)
    with pytest.raises(UnsupportedModuleError, match=r"q_proj adapter 'default' is ALoraLinearVariant") as e:
        m(input_ids=_ids(m.config.vocab_size))
    assert "DoRA" not in str(e.value)


# ------------------------------------------------------------------ nothing bypassed


def _fused_qwen3():
    m = build(family("qwen3"), bias=True)
    fusedqkv.apply_to(m)
    return m, m.model.layers[0].self_attn


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("where", ["q_proj", "qkv_proj"])
def test_a_foreign_module_in_the_projections_place_is_refused(where):
    m, attn = _fused_qwen3()
    old = attn._modules[where]
    attn._modules[where] = _ScaledLinear(old.in_features, old.out_features)
    with pytest.raises(UnsupportedModuleError, match=rf"self_attn|{where}.*_ScaledLinear|_ScaledLinear"):
        m(input_ids=_ids(m.config.vocab_size))


@pytest.mark.parametrize("where", ["q_proj", "v_proj", "qkv_proj"])
@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook"])
def test_a_hook_on_the_projection_is_refused(where, kind):
    """Refused as it is registered, and at the forward where written into the hook dict (add_hook)."""
    m, attn = _fused_qwen3()
    add_hook(attn._modules[where], kind)
    with pytest.raises(UnsupportedModuleError, match=rf"{where} has a forward"):
        m(input_ids=_ids(m.config.vocab_size))


@pytest.mark.parametrize("where, change, words", [
    ("qkv_proj", "foreign", "qkv_proj is a test_hf_peft._ScaledLinear"),
    ("qkv_proj", "hook", "qkv_proj has a forward hook"),
    ("qkv_fused", "foreign", "qkv_fused is a test_hf_peft._ScaledLinear"),
    ("qkv_fused", "hook", "qkv_fused has a forward hook"),
])
def test_changes_in_hfs_own_joined_qkv_proj_place_are_refused(where, change, words):
    """Ergo: the rows module under HF's qkv_proj and the fused projection (qkv_fused) are checked as every
    family's are."""
    m = build(family("ergo"))
    fusedqkv.apply_to(m)
    attn = m.model.layers[0].self_attn
    old = attn._modules[where]
    if change == "foreign":
        attn._modules[where] = _ScaledLinear(old.in_features, old.out_features)
    else:
        add_hook(old)
    with pytest.raises(UnsupportedModuleError, match=words):
        m(input_ids=_ids(m.config.vocab_size))


_OTHER_METHODS = {  # PEFT's methods other than LoRA over q/v_proj (IA3, VeRA, LoKr and OFT's layers are all `Linear`)
    "ia3": lambda: peft.IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[]),
    "loha": lambda: peft.LoHaConfig(r=2, target_modules=["q_proj", "v_proj"]),
    "vera": lambda: peft.VeraConfig(r=8, target_modules=["q_proj", "v_proj"]),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"]),
    "adalora": lambda: peft.AdaLoraConfig(init_r=4, target_r=2, total_step=10, target_modules=["q_proj", "v_proj"]),
}


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
@pytest.mark.parametrize("method", list(_OTHER_METHODS))
def test_other_peft_methods_are_refused_naming_the_layer(method, order):
    """Refused in either order, naming PEFT's layer by its module (PEFT's IA3/VeRA/OFT layers are all called
    `Linear`: apply_to said "q_proj is a Linear; only a plain torch.nn.Linear ...") and what fusedqkv takes.
    AdaLoRA's layer freezes the base weight as get_peft_model wraps the rows: that error names PEFT's module."""
    m, _ = _fused_qwen3() if order == "apply_first" else (build(family("qwen3"), bias=True), None)
    layer = r"q_proj is a peft\.tuners\.[\w.]+; .*of PEFT's methods fusedqkv computes LoRA \(lora\.Linear\) only"
    if order == "peft_first":
        pm = get_peft_model(m, _OTHER_METHODS[method]())
        with pytest.raises(fusedqkv.UnsupportedModelError, match=layer):
            fusedqkv.apply_to(pm)
    elif method == "adalora":
        with pytest.raises(UnsupportedModuleError, match=r"requires_grad=False on rows .*set by "
                           r"peft\.tuners\.adalora\.layer as it wrapped the projection: of PEFT's methods fusedqkv "
                           r"computes LoRA only"):
            get_peft_model(m, _OTHER_METHODS[method]())
    else:
        pm = get_peft_model(m, _OTHER_METHODS[method]())
        with pytest.raises(UnsupportedModuleError, match=layer):
            pm(input_ids=_ids(m.config.vocab_size))


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_prompt_learning_methods_train_as_unfused(order):
    """PEFT's prefix tuning (its past key/values in every attention), prompt tuning and P-tuning leave q/k/v
    alone: logits and the trained parameters' gradients equal to the same PEFT model without fusedqkv."""
    base = build(family("qwen3"), bias=True)
    ids = _ids(base.config.vocab_size)
    configs = (peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
               peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
               peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16))
    for cfg in configs:
        torch.manual_seed(1)
        want = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg))
        torch.manual_seed(1)
        if order == "apply_first":
            m = copy.deepcopy(base)
            fusedqkv.apply_to(m)
            m = get_peft_model(m, copy.deepcopy(cfg))
        else:
            m = get_peft_model(copy.deepcopy(base), copy.deepcopy(cfg))
            fusedqkv.apply_to(m)
        assert any(hasattr(mod, "_fusedqkv") for mod in m.modules())
        outs = []
        for model in (want, m):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            outs.append((out.logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        (lw, gw), (lm, gm) = outs
        assert _rel(lm, lw) <= TOL and gw.keys() == gm.keys() and gw, type(cfg).__name__
        for n in gw:
            assert _rel(gm[n], gw[n]) <= TOL, (type(cfg).__name__, n)


def test_peft_on_the_fused_projection_by_name_is_refused_by_peft():
    m, _ = _fused_qwen3()
    with pytest.raises((ValueError, TypeError), match="qkv_proj|not supported|FusedQKVProjection"):
        get_peft_model(m, _lora(["qkv_proj"]))


@pytest.mark.parametrize("order", ["apply_first", "quantize_first"])
def test_torchao_inference_quantization_of_q_k_v_is_refused_naming_it(order):
    """torchao's quantize_ with an inference config (int8 weight-only here): after apply_to its swap of q_proj's
    weight is refused before anything is swapped (was a bare AttributeError naming rows), naming quantize_ and the
    filter_fn way out; before apply_to, apply_to refuses the quantized weight naming it. Leaving q/k/v out works."""
    quant = pytest.importorskip("torchao.quantization")
    base = build(family("qwen3"), bias=True)
    m = copy.deepcopy(base)
    words = r"torchao's quantize_ with an inference config .* filter_fn that leaves q/k/v_proj out"
    if order == "apply_first":
        fusedqkv.apply_to(m)
        with pytest.raises(UnsupportedModuleError, match=r"ProjectionRows.weight cannot be replaced: .*" + words):
            quant.quantize_(m, quant.Int8WeightOnlyConfig())
        assert not any(type(p) is not nn.Parameter for p in m.parameters())  # nothing swapped before it
        with pytest.raises(AttributeError):  # (an AttributeError too)
            m.model.layers[0].self_attn.k_proj.bias = None
    else:
        quant.quantize_(m, quant.Int8WeightOnlyConfig())
        with pytest.raises(fusedqkv.UnsupportedModelError, match=r"q_proj.weight is a Int8Tensor .*" + words):
            fusedqkv.apply_to(m)
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    quant.quantize_(m, quant.Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn.endswith(("o_proj", "mlp.up_proj")))
    ids = _ids(m.config.vocab_size)
    want = copy.deepcopy(base)
    quant.quantize_(want, quant.Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn.endswith(("o_proj", "mlp.up_proj")))
    assert _rel(m(input_ids=ids).logits, want(input_ids=ids).logits) <= TOL


def test_a_float8_linear_not_over_the_fused_rows_is_refused():
    """torchao's conversion of apply_to's rows runs in the block (tests/test_fp8.py); a Float8Linear
    of weights of its own in q_proj's place would be bypassed: refused."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    m, attn = _fused_qwen3()
    old = attn.q_proj
    own = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    attn._modules["q_proj"] = Float8Linear.from_float(own)
    with pytest.raises(UnsupportedModuleError, match=r"q_proj is a torchao Float8Linear whose weight is not rows"):
        m(input_ids=_ids(m.config.vocab_size))


def _mx_config():
    pytest.importorskip("torchao.prototype.moe_training")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

    return MXFP8TrainingOpConfig()  # torchao 0.18's MX training: RCEIL scales


@needs_torchao_mx_training
def test_lora_then_mx_training_over_qkv_proj_runs_both_in_the_block():
    """get_peft_model after apply_to, then quantize_ with torchao's MX training config over qkv_proj: the
    adapters inside the block and the fused GEMM in mxfp8_rceil (emulated on the CPU), as the same PEFT
    model over apply_to(fp8='mxfp8_rceil'): outputs and every gradient equal."""
    from torchao.quantization import quantize_

    config = _mx_config()
    base = build(family("qwen3"), bias=True)
    want = copy.deepcopy(base)
    fusedqkv.apply_to(want, fp8="mxfp8_rceil")
    torch.manual_seed(1)
    want = get_peft_model(want, _lora(["q_proj", "v_proj"]))
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    m = get_peft_model(m, _lora(["q_proj", "v_proj"]))
    set_peft_model_state_dict(m, get_peft_model_state_dict(want))
    quantize_(m, config, filter_fn=lambda mod, fqn: fqn.endswith("qkv_proj"))
    ids = _ids(m.config.vocab_size)
    y, w = m(input_ids=ids).logits, want(input_ids=ids).logits
    assert torch.equal(y, w)
    y.pow(2).mean().backward()
    w.pow(2).mean().backward()
    got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    ref = {n: p.grad for n, p in want.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in got)


@pytest.mark.filterwarnings("ignore:TorchaoLoraLinear was instantiated")
@needs_torchao_mx_training
def test_lora_over_rows_of_an_mx_wrapped_qkv_proj_is_refused():
    """quantize_ over qkv_proj first: PEFT then sees torchao tensors in the rows and makes its own
    TorchaoLoraLinear, which the block does not compute: refused by name (LoRA first works, above)."""
    from torchao.quantization import quantize_

    m, attn = _fused_qwen3()
    quantize_(m, _mx_config(), filter_fn=lambda mod, fqn: fqn.endswith("qkv_proj"))
    m = get_peft_model(m, _lora(["q_proj", "v_proj"]))
    with pytest.raises(UnsupportedModuleError, match=r"q_proj is a peft\.tuners\.lora\.torchao\.TorchaoLoraLinear"):
        m(input_ids=_ids(m.config.vocab_size))


def test_bitsandbytes_layers_are_refused():
    bnb = pytest.importorskip("bitsandbytes")
    m, attn = _fused_qwen3()
    old = attn.q_proj
    attn._modules["q_proj"] = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=True)
    with pytest.raises(UnsupportedModuleError, match="bitsandbytes"):
        m(input_ids=_ids(m.config.vocab_size))


def test_rows_views_follow_the_fused_weight():
    m, attn = _fused_qwen3()
    w = attn.qkv_proj.weight
    q = attn.q_proj.weight
    assert q.data_ptr() == w.data_ptr() and q.shape == (attn.q_proj.out_features, w.shape[1])
    with torch.no_grad():
        attn.k_proj.weight.data += 1.0  # in place through the view: the fused weight
    assert torch.equal(w[q.shape[0]:q.shape[0] + attn.k_proj.out_features], attn.k_proj.weight)
    new = torch.zeros_like(attn.v_proj.weight)
    v = attn.v_proj.weight
    v.data = new  # an assigned .data (PEFT's safe merge) is written into the fused rows at once
    assert float(w[-attn.v_proj.out_features:].abs().max()) == 0.0
    assert attn.v_proj.weight is v and v.data_ptr() != new.data_ptr()  # the view still shows the rows
    with pytest.raises(UnsupportedModuleError, match=r"shape \(3, 64\)"):
        v.data = torch.zeros(3, w.shape[1])
    with pytest.raises(AttributeError, match="rows"):
        attn.q_proj.weight = nn.Parameter(torch.zeros(1))
    m.to(torch.float64)
    assert attn.q_proj.weight.dtype == torch.float64 and attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()


def _word_tokenizer(vocab):
    """A word-level tokenizer over the tiny vocabulary ("t0" ... ; nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t0")


def test_trl_sft_trainer_with_peft_config_trains_like_unfused(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tokenizer = _word_tokenizer

    def losses(fused, out):
        m = build(family("qwen3"), bias=True)
        if fused:
            fusedqkv.apply_to(m)
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, m.config.vocab_size, (12,), generator=g).tolist() for _ in range(20)]
        args = trl.SFTConfig(output_dir=str(out), max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                             bf16=False, fp16=False, disable_tqdm=True)
        torch.manual_seed(1)
        trainer = trl.SFTTrainer(model=m, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                                 processing_class=tokenizer(m.config.vocab_size),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        trainer.train()
        if fused:  # the adapters sit on the rows of the fused projection
            attn = next(mod for mod in trainer.model.modules() if hasattr(mod, "_fusedqkv"))
            assert type(attn.q_proj.base_layer) is ProjectionRows
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    want = losses(False, tmp_path / "unfused")
    got = losses(True, tmp_path / "fused")
    assert len(got) == len(want) == 5
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 * max(abs(x) for x in want)


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_trl_preference_and_rl_trainers_with_peft_config_train_like_unfused(tmp_path, kind):
    """TRL's DPOTrainer (the reference log-probs through PEFT's disabled adapters) and GRPOTrainer
    (completions from ``generate`` with the KV cache, a KL term against the reference) with a LoRA
    peft_config on a fused model: every logged loss, reward and KL the unfused model's (fp32, within
    rounding of the fused GEMM's sums)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    def history(fused, out):
        m = build(family("qwen3"))
        if fused:
            fusedqkv.apply_to(m)
        V = m.config.vocab_size
        g = torch.Generator().manual_seed(0)

        def words(n):
            return " ".join(f"t{i}" for i in torch.randint(3, V, (n,), generator=g).tolist())

        common = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                      logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
                      bf16=False, fp16=False, disable_tqdm=True)
        peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        torch.manual_seed(1)
        if kind == "dpo":
            data = Dataset.from_dict({"prompt": [words(6) for _ in range(12)], "chosen": [words(4) for _ in range(12)],
                                      "rejected": [words(4) for _ in range(12)]})
            trainer = trl.DPOTrainer(model=m, args=trl.DPOConfig(**common), train_dataset=data,
                                     processing_class=_word_tokenizer(V), peft_config=peft)
        else:
            data = Dataset.from_dict({"prompt": [words(6) for _ in range(12)]})
            args = trl.GRPOConfig(**common, num_generations=4, max_completion_length=6, generation_batch_size=8,
                                  beta=0.1)
            def length(completions, **kw):  # a reward that differs between completions
                return [float(len(c)) for c in completions]

            trainer = trl.GRPOTrainer(model=m, reward_funcs=length, args=args, train_dataset=data,
                                      processing_class=_word_tokenizer(V), peft_config=peft)
        trainer.train()
        if fused:
            attn = next(mod for mod in trainer.model.modules() if hasattr(mod, "_fusedqkv"))
            assert type(attn.q_proj.base_layer) is ProjectionRows
        keys = ("loss", "rewards/chosen", "rewards/rejected", "reward", "kl")
        return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]

    want = history(False, tmp_path / "unfused")
    got = history(True, tmp_path / "fused")
    assert len(got) == len(want) == 3 and [sorted(h) for h in got] == [sorted(h) for h in want]
    assert any(h.get("kl", 0) > 0 or h.get("rewards/chosen", 0) != 0 for h in want)  # the reference took part
    for a, b in zip(got, want):
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])


# ------------------------------------------------------------------ the adapters inside the op


def _block_call(attn, x, residual, lora, backend=None):
    spec = attn._fusedqkv
    cos, sin = (t.expand(x.shape[0], -1, -1) for t in attn._test_rope)
    return fusedqkv.gqa_qkv_rope_qk_norm(x, attn.qkv_proj.weight, attn.q_norm.weight, attn.k_norm.weight, cos, sin,
                                         num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, eps=spec.eps,
                                         qkv_residual=residual, qkv_lora=lora, backend=backend, **spec.block_kwargs)


@pytest.mark.parametrize("backend", [None, "triton"])  # the CPU path, and the Triton stages (interpreted)
def test_in_place_lora_op_matches_the_residual_path(backend):
    """qkv_lora (the adapters' GEMMs accumulated into the projection output and dX in place, dA/dB
    from the op's backward) against qkv_residual (R = U B^T through autograd) on the same layers:
    two adapters, one with a live dropout, frozen and trainable B."""
    from fusedqkv.integrations.fused_projection import projection_slots
    from fusedqkv.integrations.peft import lora_operands, lora_residual
    from fusedqkv.ops.lora import LoRAUpdate

    m, _ = _fused_qwen3()
    m = get_peft_model(m, _lora("all-linear"))
    m.add_adapter("drop", _lora(["q_proj", "v_proj"], lora_dropout=0.3))
    m.base_model.set_adapter(["default", "drop"])
    m.train()
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    attn.k_proj.lora_B["default"].weight.requires_grad_(False)
    spec = attn._fusedqkv
    d = spec.head_dim
    ang = torch.arange(7)[None, :, None] / 10 ** (torch.arange(d) % (d // 2) / (d // 2))
    attn._test_rope = (ang.cos(), ang.sin())
    slots = projection_slots(attn, spec.projs)
    named = [(n, p) for n, p in attn.named_parameters() if p.requires_grad and "o_proj" not in n]
    params = [p for _, p in named]
    x0 = torch.randn(2, 7, m.config.hidden_size)
    results = []
    for inplace in (True, False):
        x = x0.clone().requires_grad_()
        torch.manual_seed(3)
        if inplace:
            residual, lora = lora_operands(x, slots, spec.split, sum(spec.split))
            assert residual is None and isinstance(lora, LoRAUpdate) and len(lora.xds) == 2
        else:
            residual, lora = lora_residual(x, slots, spec.split, sum(spec.split)), None
        q, k, v = _block_call(attn, x, residual, lora, backend)
        loss = (q * q.detach()).sum() + k.sum() + (v * 0.5).pow(2).sum()
        results.append([q, k, v] + list(torch.autograd.grad(loss, [x] + params)))
    assert any("lora_B.drop" in n for n, _ in named) and not any(".k_proj.lora_B.default" in n for n, _ in named)
    for name, a, b in zip(["q", "k", "v", "x"] + [n for n, _ in named], *results):
        assert _rel(a, b) <= 1e-6, name


def test_lora_gemm_operands_are_the_update_as_more_inner_columns():
    """``LoRAUpdate.gemm_operands`` (what the one-launch Hopper forward takes: qkv = [x | U] [W | B]^T)
    gives the in-place update's values: two adapters on q/v and k, one with a live dropout, scales
    that are not powers of two; B is zero outside each pair's rows and U's columns."""
    from fusedqkv.integrations.fused_projection import projection_slots
    from fusedqkv.integrations.peft import lora_operands

    m, _ = _fused_qwen3()
    m = get_peft_model(m, _lora("all-linear", lora_alpha=12))
    m.add_adapter("drop", _lora(["q_proj", "v_proj"], lora_dropout=0.3, lora_alpha=5))
    m.base_model.set_adapter(["default", "drop"])
    m.train()
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    spec = attn._fusedqkv
    n_tot = sum(spec.split)
    x = torch.randn(2, 7, m.config.hidden_size)
    _, lora = lora_operands(x, projection_slots(attn, spec.projs), spec.split, n_tot)
    x2d = x.reshape(14, -1)
    base = torch.randn(14, n_tot)
    in_place = base.clone()
    lora.forward(in_place, x2d)
    u, b = lora.gemm_operands(x2d)
    assert u.shape == (14, lora.rank) and b.shape == (n_tot, lora.rank)
    assert _rel(base + u @ b.t(), in_place) <= 1e-6
    mask = torch.zeros_like(b, dtype=torch.bool)
    for (row, rows, *_), c, r in zip(lora.pairs, lora.cols, lora.ranks):
        mask[row:row + rows, c:c + r] = True
    assert not b[~mask].any() and b[mask].abs().min() > 0


def test_bf16_model_with_fp32_adapters_takes_the_residual():
    """PEFT's default (autocast_adapter_dtype) keeps fp32 adapters on a bf16 model: PEFT rounds their
    update to bf16 before adding it, which the in-place op would not; the residual path does, and
    matches PEFT (the three-way rule against the same model in fp32)."""
    from fusedqkv.integrations.fused_projection import projection_slots
    from fusedqkv.integrations.peft import lora_operands

    base = build(family("qwen3"), bias=True).to(torch.bfloat16)
    torch.manual_seed(10)
    ref = get_peft_model(copy.deepcopy(base), _lora("all-linear"))
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    m = get_peft_model(m, _lora("all-linear"))
    set_peft_model_state_dict(m, get_peft_model_state_dict(ref))
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    assert attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(1, 3, m.config.hidden_size, dtype=torch.bfloat16)
    residual, lora = lora_operands(x, projection_slots(attn, attn._fusedqkv.projs), attn._fusedqkv.split,
                                   sum(attn._fusedqkv.split))
    assert lora is None and residual.dtype == torch.bfloat16
    ids = _ids(m.config.vocab_size, 7)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    want32, w32 = _step(copy.deepcopy(ref).float(), ids)
    assert_bf16_like_peft(got, g, want, w, want32, w32)


def test_autocast_runs_the_in_place_op_like_peft():
    """Under autocast (the Trainer's bf16=True) PEFT's fp32 adapters compute in bf16, as the block
    does: the in-place op runs, and matches PEFT under autocast by the three-way rule against the
    model without autocast (fp32)."""
    from fusedqkv.integrations.fused_projection import projection_slots
    from fusedqkv.integrations.peft import lora_operands
    from fusedqkv.ops.lora import LoRAUpdate

    m, ref, _ = _pair("qwen3", _lora("all-linear"), "apply_first")
    attn = next(mod for mod in m.modules() if hasattr(mod, "_fusedqkv"))
    ids = _ids(m.config.vocab_size, 8)
    want32, w32 = _step(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(1, 3, m.config.hidden_size)
        _, lora = lora_operands(x, projection_slots(attn, attn._fusedqkv.projs), attn._fusedqkv.split,
                                sum(attn._fusedqkv.split))
        assert isinstance(lora, LoRAUpdate) and lora.dtype == torch.bfloat16
        got, g = _step(m, ids)
        want, w = _step(ref, ids)
    assert_bf16_like_peft(got, g, want, w, want32, w32)


@needs_cpu_row_scales
@pytest.mark.parametrize("how", ["merge_adapter", "safe_merge"])
def test_fp8_frozen_weight_cache_follows_peft_merge_and_unmerge(monkeypatch, how):
    """config.fp8_frozen_weight_cache with LoRA over apply_to(fp8='rowwise'): PEFT's merge and unmerge write
    the fused weight through .data (its version counter stays), so the kept casts of the frozen weight must
    go with them: every forward equals the same model without the cache (the interpreter's casts)."""
    from fusedqkv.ops import config, fp8

    monkeypatch.setattr(fp8, "_triton", lambda t: t.dtype in (torch.bfloat16, torch.float16, torch.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = build(family("qwen3"))
    torch.manual_seed(1)
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m, fp8="rowwise")
    m = get_peft_model(m, _lora(["q_proj", "v_proj"]))
    m.get_input_embeddings().weight.requires_grad_(True)  # every layer's x needs a gradient, merged or not
    ids = _ids(m.config.vocab_size)
    fp8.forget_frozen_weight_casts()

    def logits(cache: bool):
        with config.override(fp8_frozen_weight_cache=cache):
            return m(input_ids=ids).logits.detach()

    assert torch.equal(logits(True), logits(False))
    assert len(fp8.FROZEN_WEIGHT_CASTS) == 2  # one frozen fused weight a layer
    assert torch.equal(logits(True), logits(False))
    if how == "merge_adapter":
        m.merge_adapter()
    else:  # PEFT's safe merge: each LoRA layer's merge(safe_merge=True) replaces the weight's .data
        for mod in m.modules():
            if hasattr(mod, "merge") and hasattr(mod, "lora_A"):
                mod.merge(safe_merge=True)
    merged = logits(True)
    assert torch.equal(merged, logits(False))
    m.unmerge_adapter()
    assert torch.equal(logits(True), logits(False))
    fp8.forget_frozen_weight_casts()


def test_eva_initialisation_before_apply_to_matches_peft_and_after_is_refused_naming_it():
    """PEFT's EVA (``init_lora_weights="eva"``, ``initialize_lora_eva_weights``) reads the LoRA layers' inputs
    through forward hooks: run before apply_to, the adapters and logits equal PEFT's without fusedqkv; run after,
    the hooks are refused at the first forward, saying that EVA goes before apply_to."""
    eva = pytest.importorskip("peft.tuners.lora.eva")
    base = build(family("qwen3"), bias=True)
    ids = torch.randint(0, base.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in (0, 2)]

    def eva_lora():
        return LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights="eva",
                          eva_config=peft.EvaConfig(rho=1.0))

    torch.manual_seed(1)
    want = get_peft_model(copy.deepcopy(base), eva_lora(), low_cpu_mem_usage=True)
    eva.initialize_lora_eva_weights(want, loader, show_progress_bar=False)
    torch.manual_seed(1)
    m = get_peft_model(copy.deepcopy(base), eva_lora(), low_cpu_mem_usage=True)
    eva.initialize_lora_eva_weights(m, loader, show_progress_bar=False)
    fusedqkv.apply_to(m)
    adapters = {k: v for k, v in want.state_dict().items() if "lora_" in k}
    got = m.state_dict()
    assert adapters and all(torch.equal(got[k], v) for k, v in adapters.items())
    assert _rel(m(input_ids=ids).logits, want(input_ids=ids).logits) <= TOL
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    m = get_peft_model(m, eva_lora(), low_cpu_mem_usage=True)
    with pytest.raises(UnsupportedModuleError, match=r"q_proj has a forward hook .*run initialize_lora_eva_weights "
                       r"before apply_to"):
        eva.initialize_lora_eva_weights(m, loader, show_progress_bar=False)


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
@pytest.mark.parametrize("name, task", [("embedding_gemma2_text", "FEATURE_EXTRACTION"),
                                        ("t5gemma2_decoder", "SEQ_2_SEQ_LM")], ids=["encoder", "encoder_decoder"])
def test_lora_on_an_encoder_or_encoder_decoder_matches_peft(name, task, order, tmp_path):
    """An encoder (EmbeddingGemma 2: bidirectional, no KV cache, the global layer at head_dim 512; PEFT's
    FEATURE_EXTRACTION task, as an embedding model is fine-tuned) and an encoder-decoder (T5Gemma 2, SEQ_2_SEQ_LM: the
    decoder's k_proj / v_proj adapters also reach the encoder's states, outside the block) with LoRA on the
    attention's projections: the fused model's outputs and every adapter's gradient are PEFT's without fusedqkv (an
    fp32 gradient worse than TOL: at most twice PEFT's own fp32 error against float64, plus TOL), merged and disabled
    adapters too, and the adapters saved from one load into the other. (Not all-linear: with random adapters on every layer, PLE's
    included, this tiny model turns fp32 rounding into ~3e-5 of gradient -- against float64, PEFT's worst adapter
    gradient is 2.3e-5 off, the same model with its adapted layers' base GEMMs in float64 2.8e-5, fusedqkv's
    4.5e-5 (a PLE gate's) -- so the three-way rule would judge rounding orders, not the block.)"""
    fam = family(name)
    m, ref, base = _pair(name, _lora(["q_proj", "k_proj", "v_proj", "o_proj"], task_type=task), order)
    inputs = fam.inputs(_ids(base.config.vocab_size, shape=(3, 9)))

    def run(x):
        x.zero_grad(set_to_none=True)
        out = x(**inputs)
        fam.loss(out).backward()
        return fam.outputs(out).detach(), {n: p.grad for n, p in x.named_parameters() if p.requires_grad}

    (got, g), (want, w) = run(m), run(ref)
    assert _rel(got, want) <= TOL
    assert _rel(got, fam.outputs(base(**inputs))) > 1e-3  # the adapters are live
    assert sorted(g) == sorted(w) and any(".q_proj.lora_A." in n for n in g)
    unreached = [n for n in w if w[n] is None]  # (T5Gemma 2's vision tower: text inputs only)
    assert [n for n in g if g[n] is None] == unreached and all(".vision_tower." in n for n in unreached)
    ill = [n for n in w if n not in unreached and _rel(g[n], w[n]) > TOL]
    if ill:
        _, w64 = run(copy.deepcopy(ref).double())
    for pname in w:
        if pname in ill:
            assert _rel(g[pname], w64[pname]) <= 2 * _rel(w[pname], w64[pname]) + TOL, pname
    with torch.no_grad():
        with m.disable_adapter(), ref.disable_adapter():
            assert _rel(fam.outputs(m(**inputs)), fam.outputs(ref(**inputs))) <= TOL
        m.save_pretrained(tmp_path / "fused")
        unfused = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "fused")
        assert _rel(fam.outputs(unfused(**inputs)), want) <= TOL
        merged, merged_ref = m.merge_and_unload(), ref.merge_and_unload()
        assert _rel(fam.outputs(merged(**inputs)), fam.outputs(merged_ref(**inputs))) <= TOL
