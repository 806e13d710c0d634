"""The fused forward's kept decisions (integrations.projection_plan) never go stale: every change
between two forwards -- a hook, a swapped module, a replaced forward, PEFT's adapter state, a
replaced parameter or ``.data``, requires_grad, dropout, dtype -- is seen at the next forward, which
refuses what it refused before anything was kept, and otherwise matches the same PEFT model without
fusedqkv given the same change. Tiny Qwen3, fp32, CPU."""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations import projection_plan  # noqa: E402
from fusedqkv.integrations.fused_projection import (FusedQKVProjection, ProjectionRows,  # noqa: E402
                                                     UnsupportedModuleError)

from _hf_families import build, family, fused_modules  # noqa: E402
from _fp8_cpu import needs_torchao_mx_training  # noqa: E402
from _lora_checks import add_hook, rel as _rel, step as _step  # noqa: E402

TOL = 1e-5


def _lora(targets="all-linear", **kw):
    # init_lora_weights=False: B random, so that every adapter changes the output
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kw)


def _pair(config=None):
    """(PEFT model with fusedqkv, the same PEFT model without), equal adapters."""
    base = build(family("qwen3"), bias=True)
    torch.manual_seed(10)
    ref = get_peft_model(copy.deepcopy(base), copy.deepcopy(config or _lora()))
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    m = get_peft_model(m, copy.deepcopy(config or _lora()))
    set_peft_model_state_dict(m, get_peft_model_state_dict(ref))
    return m, ref


def _ids(vocab, seed=0):
    return torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))


def _attn(m):
    return fused_modules(m)[0]


def _ref_attn(ref):
    return ref.base_model.model.model.layers[0].self_attn


def _module(attn, path):
    for part in path.split("."):
        attn = getattr(attn, part)
    return attn


def test_the_plan_is_kept_while_nothing_changes_and_rebuilt_after_a_change():
    m, _ = _pair()
    ids = _ids(m.config.vocab_size)
    attn = _attn(m)
    m(input_ids=ids)
    plan = projection_plan._PLANS.get(attn)
    assert plan is not None and plan.key is not None
    m(input_ids=ids)
    assert projection_plan._PLANS.get(attn) is plan  # kept: the checks were not redone
    attn.q_proj.scaling["default"] *= 2
    m(input_ids=ids)
    assert projection_plan._PLANS.get(attn) is not plan


# ------------------------------------------------------------------ refusals after a first forward

_WHERE = ["q_proj", "q_proj.base_layer", "v_proj.base_layer", "qkv_proj"]


@pytest.mark.parametrize("where", _WHERE)
@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook"])
def test_a_hook_added_after_a_forward_is_refused_and_its_removal_seen(where, kind):
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 1)
    m(input_ids=ids)
    handle = add_hook(_module(_attn(m), where), kind)
    with pytest.raises(UnsupportedModuleError, match=rf"{where} has a forward"):
        m(input_ids=ids)
    with pytest.raises(UnsupportedModuleError):  # every forward, not only the first
        m(input_ids=ids)
    handle.remove()
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL


@pytest.mark.parametrize("where", ["q_proj.base_layer", "v_proj.base_layer", "qkv_proj"])
@pytest.mark.parametrize("how", ["prune", "register_parameter", "assign_parameter"])
def test_a_reparametrised_weight_is_refused_before_anything_changes(where, how):
    """torch.nn.utils.prune (and weight_norm) first registers the weight's original under a new name: refused
    there, so the module keeps its parameters and the fused output (before, pruning qkv_proj left it without
    its weight and with an untracked pruned one, and pruning a rows module added a stray parameter)."""
    import torch.nn.utils.prune as prune

    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 1)
    mod = _module(_attn(m), where)
    names, keys = [n for n, _ in m.named_parameters()], list(m.state_dict())
    extra = nn.Parameter(torch.zeros(3))
    change = {"prune": lambda: prune.l1_unstructured(mod, "weight", 0.5),
              "register_parameter": lambda: mod.register_parameter("weight_orig", extra),
              "assign_parameter": lambda: setattr(mod, "scale", extra)}[how]
    with pytest.raises(UnsupportedModuleError, match=rf"{type(mod).__name__} refuses a parameter '(weight_orig|scale)'"):
        change()
    assert [n for n, _ in m.named_parameters()] == names and list(m.state_dict()) == keys
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL


@pytest.mark.parametrize("where", _WHERE)
@pytest.mark.parametrize("kind", ["full_backward_hook", "full_backward_pre_hook"])
def test_a_backward_hook_in_the_place_is_refused(where, kind):
    """A backward hook on a module the block never calls would never fire: refused, also after a
    first forward (the kept plan sees it)."""
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 4)
    m(input_ids=ids)
    handle = add_hook(_module(_attn(m), where), kind)
    with pytest.raises(UnsupportedModuleError, match=rf"{where} has a backward"):
        m(input_ids=ids)
    handle.remove()
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL


@pytest.mark.parametrize("part", ["lora_A", "lora_B", "lora_dropout"])
@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook"])
def test_a_hook_on_an_adapter_module_is_refused(part, kind):
    """The block computes an adapter from its weights (and calls its dropout only where live):
    a hook on A, B or the dropout would not run. Refused at the first forward, and after a kept
    plan; fine again once removed."""
    for first_forward in (False, True):
        m, ref = _pair()
        ids = _ids(m.config.vocab_size, 5)
        if first_forward:
            m(input_ids=ids)
        handle = getattr(getattr(_attn(m).k_proj, part)["default"], f"register_{kind}")(lambda *a: None)
        with pytest.raises(UnsupportedModuleError, match=rf"k_proj\.{part}\['default'\] has a"):
            m(input_ids=ids)
        handle.remove()
        assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL


def test_an_adapter_module_replaced_or_with_its_forward_set_is_refused():
    m, _ = _pair()
    ids = _ids(m.config.vocab_size, 6)
    m(input_ids=ids)
    lora = _attn(m).v_proj
    lora.lora_B["default"].forward = lambda x: x  # noqa: E731 - a replaced forward the block would skip
    with pytest.raises(UnsupportedModuleError, match=r"v_proj\.lora_B\['default'\] has a replaced forward"):
        m(input_ids=ids)
    del lora.lora_B["default"].forward
    m(input_ids=ids)
    old = lora.lora_A["default"]
    lora.lora_A["default"] = _ScaledA(old.in_features, old.out_features)
    with pytest.raises(UnsupportedModuleError, match=r"v_proj\.lora_A\['default'\] is a .*_ScaledA"):
        m(input_ids=ids)


class _ScaledA(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("where", _WHERE)
def test_a_forward_set_after_a_forward_is_refused(where):
    m, _ = _pair()
    ids = _ids(m.config.vocab_size, 2)
    m(input_ids=ids)
    mod = _module(_attn(m), where)
    new_forward = lambda x, *a, **k: 2 * type(mod).forward(mod, x, *a, **k)  # noqa: E731
    if isinstance(mod, (FusedQKVProjection, ProjectionRows)):  # the fused modules refuse it as it is set
        with pytest.raises(UnsupportedModuleError, match="forward cannot be set"):
            mod.forward = new_forward
        return
    mod.forward = new_forward
    with pytest.raises(UnsupportedModuleError, match=rf"{where} has a replaced forward"):
        m(input_ids=ids)


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize("where", ["q_proj", "k_proj.base_layer", "qkv_proj"])
def test_a_module_swapped_after_a_forward_is_refused(where):
    m, _ = _pair()
    ids = _ids(m.config.vocab_size, 3)
    m(input_ids=ids)
    owner_path, _, name = where.rpartition(".")
    owner = _module(_attn(m), owner_path) if owner_path else _attn(m)
    old = owner._modules[name]
    owner._modules[name] = _ScaledLinear(old.in_features, old.out_features)
    with pytest.raises(UnsupportedModuleError, match="_ScaledLinear"):
        m(input_ids=ids)


def test_a_module_swapped_after_a_forward_is_refused_without_peft():
    m = build(family("qwen3"), bias=True)
    fusedqkv.apply_to(m)
    ids = _ids(m.config.vocab_size, 4)
    m(input_ids=ids)
    attn = _attn(m)
    old = attn.v_proj
    attn._modules["v_proj"] = _ScaledLinear(old.in_features, old.out_features)
    with pytest.raises(UnsupportedModuleError, match=r"v_proj is a .*_ScaledLinear"):
        m(input_ids=ids)
    attn._modules["v_proj"] = old
    m(input_ids=ids)
    add_hook(old, "forward_pre_hook")
    with pytest.raises(UnsupportedModuleError, match="v_proj has a forward pre-hook"):
        m(input_ids=ids)


@needs_torchao_mx_training
def test_qkv_proj_parameters_wrapped_after_a_forward_are_seen():
    """torchao's MX training (quantize_ over qkv_proj) swaps qkv_proj's parameters for wrapped ones, the
    module and its rows unchanged: the fingerprint holds the parameters' classes and the config, so
    the next forward plans again and runs the config's recipe (as apply_to(fp8='mxfp8_rceil'))."""
    pytest.importorskip("torchao.prototype.moe_training")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_

    base = build(family("qwen3"), bias=True)
    want = copy.deepcopy(base)
    fusedqkv.apply_to(want, fp8="mxfp8_rceil")
    m = copy.deepcopy(base)
    fusedqkv.apply_to(m)
    ids = _ids(m.config.vocab_size, 8)
    attn = _attn(m)
    plain = m(input_ids=ids).logits
    plan = projection_plan._PLANS.get(attn)
    assert plan is not None and plan.key is not None and plan.fp8 is None
    quantize_(m, MXFP8TrainingOpConfig(), filter_fn=lambda mod, fqn: fqn.endswith("qkv_proj"))
    got = m(input_ids=ids).logits
    new = projection_plan._PLANS.get(attn)
    assert new is not plan and new.key is not None and new.fp8.key == "mxfp8_rceil"
    assert torch.equal(got, want(input_ids=ids).logits) and not torch.equal(got, plain)
    m(input_ids=ids)
    assert projection_plan._PLANS.get(attn) is new  # kept while nothing changes


def test_a_dora_adapter_set_after_a_forward_is_refused():
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 5)
    m(input_ids=ids)
    m.add_adapter("dora", _lora(["q_proj", "v_proj"], use_dora=True))
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL  # "default" still the active one
    m.base_model.set_adapter("dora")
    with pytest.raises(UnsupportedModuleError, match="DoRA"):
        m(input_ids=ids)
    m.base_model.set_adapter("default")
    assert _rel(m(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL


def test_adapters_of_different_dtypes_after_a_forward_are_refused():
    m, _ = _pair()
    ids = _ids(m.config.vocab_size, 6)
    m(input_ids=ids)
    a = _attn(m).k_proj.lora_A["default"].weight
    a.data = a.data.to(torch.float64)  # the same parameter, another dtype
    with pytest.raises(UnsupportedModuleError, match="different dtypes"):
        m(input_ids=ids)


# ------------------------------------------------------------------ changes that compute, as PEFT does


def _changes():
    """(what, change(model, attn of layer 0)): each applied to the fused model and to PEFT's, in
    order, a forward of both after each."""

    def set_scale(m, attn):
        attn.q_proj.set_scale("default", 3.0)

    def second_adapter(m, attn):
        torch.manual_seed(20)
        m.add_adapter("second", _lora(["q_proj", "v_proj"]))
        m.base_model.set_adapter("second")

    def both_adapters(m, attn):
        m.base_model.set_adapter(["default", "second"])

    def merge(m, attn):
        m.base_model.merge_adapter()

    def unmerge(m, attn):
        m.base_model.unmerge_adapter()

    def disable(m, attn):
        m.base_model.disable_adapter_layers()

    def enable(m, attn):
        m.base_model.enable_adapter_layers()

    def dropout_all(m, attn):  # a dropout that drops everything: k's adapter adds nothing
        m.train()
        attn.k_proj.lora_dropout["default"] = nn.Dropout(p=1.0)

    def dropout_p_none(m, attn):  # the same module, p changed in place
        attn.k_proj.lora_dropout["default"].p = 0.0

    def dropout_p_all(m, attn):
        attn.k_proj.lora_dropout["default"].p = 1.0

    def dropout_eval(m, attn):  # p=1 still, but an eval-mode dropout is the identity
        m.eval()

    def bfloat16(m, attn):
        m.to(torch.bfloat16)

    return [("set_scale", set_scale), ("second adapter", second_adapter), ("both adapters", both_adapters),
            ("merge", merge), ("unmerge", unmerge), ("disable", disable), ("enable", enable),
            ("dropout p=1", dropout_all), ("dropout p=0 in place", dropout_p_none),
            ("dropout p=1 in place", dropout_p_all), ("dropout eval", dropout_eval),
            ("bfloat16", bfloat16)]


def test_peft_state_changed_between_forwards_computes_as_peft():
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 7)
    before = ref(input_ids=ids).logits
    assert _rel(m(input_ids=ids).logits, before) <= TOL
    for what, change in _changes():
        change(m, _attn(m))
        change(ref, _ref_attn(ref))
        want = ref(input_ids=ids).logits
        # every other change moves the output, so that a stale decision could not match it; merge
        # and unmerge keep it, where a stale plan would add the adapters twice, or not at all
        if what not in ("merge", "unmerge"):
            assert _rel(want.double(), before.double()) > 1e-4, what
        got = m(input_ids=ids).logits
        tol = 2e-2 if what == "bfloat16" else TOL  # two bf16 computations of a 2-layer model
        assert got.dtype == want.dtype and _rel(got, want) <= tol, what
        before = want


def test_parameters_and_data_replaced_between_forwards():
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 8)
    _step(m, ids)
    _step(ref, ids)
    g = torch.Generator().manual_seed(3)
    new_a = torch.randn(_attn(m).q_proj.lora_A["default"].weight.shape, generator=g)
    new_b = torch.randn(_attn(m).v_proj.lora_B["default"].weight.shape, generator=g)
    new_k = torch.randn(_attn(m).k_proj.base_layer.weight.shape, generator=g)
    for attn in (_attn(m), _ref_attn(ref)):
        attn.q_proj.lora_A["default"].weight = nn.Parameter(new_a.clone())  # a new parameter
        attn.v_proj.lora_B["default"].weight.data = new_b.clone()  # new storage, the same parameter
        attn.k_proj.base_layer.weight.data = new_k.clone()  # PEFT's safe merge does this
    got, gm = _step(m, ids)
    want, gr = _step(ref, ids)
    assert _rel(got, want) <= TOL
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert gm[name] is not None and gm[name] is _attn(m).q_proj.lora_A["default"].weight.grad  # the new one trains
    for n in gr:
        assert _rel(gm[n], gr[n]) <= TOL, n


def test_requires_grad_toggled_between_forwards():
    m, ref = _pair()
    ids = _ids(m.config.vocab_size, 9)
    _step(m, ids)
    _step(ref, ids)
    attn, rattn = _attn(m), _ref_attn(ref)
    for model_attn in (attn, rattn):
        model_attn.q_proj.lora_A["default"].weight.requires_grad_(False)
    attn.qkv_proj.weight.requires_grad_(True)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(rattn, name).base_layer.weight.requires_grad_(True)
    got, gm = _step(m, ids)
    want, gr = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert attn.q_proj.lora_A["default"].weight.grad is None
    want_w = torch.cat([getattr(rattn, name).base_layer.weight.grad for name in ("q_proj", "k_proj", "v_proj")])
    assert _rel(attn.qkv_proj.weight.grad, want_w) <= TOL
    for n in gr:
        if n.endswith("lora_A.default.weight") or n.endswith("lora_B.default.weight"):
            assert _rel(gm[n], gr[n]) <= TOL, n
