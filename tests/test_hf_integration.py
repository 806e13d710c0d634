"""fusedqkv.apply_to on Hugging Face models (issue 16), on the CPU: tiny random models of
every supported architecture (Qwen3, Qwen3-MoE, HunYuan dense V1, Gemma3 text), with and
without q/k/v biases, against an unpatched deep copy in fp32 -- logits, loss and every
gradient (the fused weight's against the concatenation of HF's three), state-dict identity
and HF state dicts loading into a patched model, save_pretrained, 30 AdamW steps with equal
losses per step, generate() with the KV cache, autocast, gradient checkpointing,
torch.compile, and clear errors for what cannot be fused."""

import copy
import pickle

import pytest
import torch

pytest.importorskip("transformers")

import _hf_models as H  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations import transformers as fqt  # noqa: E402

ATTN_PATH = {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def attn_modules(m):
    return [mod for name, mod in m.named_modules() if name.endswith("self_attn")]


def patched_pair(arch, bias=False, **kw):
    ref = H.build(arch, bias, **kw)
    m = copy.deepcopy(ref)
    assert fusedqkv.apply_to(m) == 2
    return m, ref


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_grads(m, ref, tol):
    """every gradient of the patched model against the unpatched one; the fused weight's
    (and bias's) against the concatenation of HF's q/k/v gradients."""
    got = dict(m.named_parameters())
    want = dict(ref.named_parameters())
    n_fused = 0
    for name, p in got.items():
        assert p.grad is not None, name
        if ".qkv_proj." in name:
            base, kind = name.split(".qkv_proj.")
            g = torch.cat([want[f"{base}.{proj}.{kind}"].grad for proj in ("q_proj", "k_proj", "v_proj")])
            n_fused += 1
        else:
            g = want[name].grad
        assert rel(p.grad, g) < tol, (name, rel(p.grad, g))
    assert n_fused == (4 if m.config.attention_bias else 2)
    assert len(got) == len(want) - 2 * n_fused


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_fp32_equivalence_logits_loss_gradients(arch, bias, attn, monkeypatch):
    m, ref = patched_pair(arch, bias, attn=attn)
    calls = []
    fused = fqt.gqa_qkv_rope_qk_norm
    monkeypatch.setattr(fqt, "gqa_qkv_rope_qk_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))
    ids = H.batch(2, 12)
    out = m(input_ids=ids, labels=ids)
    out_ref = ref(input_ids=ids, labels=ids)
    assert len(calls) == 2  # the fused block ran in both layers
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-7)
    out.loss.backward()
    out_ref.loss.backward()
    check_grads(m, ref, 1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "hunyuan_v1_dense"])
def test_attention_mask_with_padding(arch):
    m, ref = patched_pair(arch, True, attn="sdpa")
    ids = H.batch(2, 10, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding of the first row
    a = m(input_ids=ids, attention_mask=mask).logits
    b = ref(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-5, atol=1e-6)


def test_structure_repr_and_named_parameters():
    m, ref = patched_pair("qwen3", True)
    a = m.model.layers[0].self_attn
    assert type(a).__name__ == "FusedQKVQwen3Attention"
    assert isinstance(a, type(ref.model.layers[0].self_attn))
    # q/k/v_proj stay, as rows of qkv_proj with no parameters of their own (PEFT and module filters find them)
    assert list(a._modules) == ["qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
    assert [type(a._modules[n]).__name__ for n in ("qkv_proj", "q_proj")] == ["FusedQKVProjection", "ProjectionRows"]
    assert not list(a.q_proj.parameters()) and a.v_proj.weight.data_ptr() == a.qkv_proj.weight[(4 + 2) * 16:].data_ptr()
    assert a.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64) and a.qkv_proj.bias.shape == ((4 + 2 * 2) * 16,)
    assert "fusedqkv" in repr(a) and "before rope" in repr(a)
    r = ref.model.layers[0].self_attn
    torch.testing.assert_close(a.qkv_proj.weight, torch.cat([r.q_proj.weight, r.k_proj.weight, r.v_proj.weight]),
                               rtol=0, atol=0)
    # the norm modules are the model's own (weights read in place)
    assert a.q_norm.weight.data_ptr() == dict(m.named_parameters())["model.layers.0.self_attn.q_norm.weight"].data_ptr()
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in ref.parameters())
    assert fusedqkv.apply_to(m) == 0  # idempotent: nothing left to fuse


# --------------------------------------------------------------------------- state dict


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_state_dict_keys_and_values_are_hf(arch, bias):
    m, ref = patched_pair(arch, bias)
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)  # the same keys in the same order
    for k in sd_ref:
        assert sd[k].dtype == sd_ref[k].dtype and torch.equal(sd[k], sd_ref[k]), k
    assert set(sd._metadata) == set(sd_ref._metadata)
    # the split entries own their memory (save_pretrained would take shared storage for tied weights)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert q.untyped_storage().data_ptr() != m.model.layers[0].self_attn.qkv_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", H.ARCHS)
def test_hf_state_dict_loads_into_patched_model(arch):
    m, _ = patched_pair(arch, True, seed=0)
    other = H.build(arch, True, seed=7)  # an unpatched model with other values
    result = m.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in other.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    ids = H.batch(1, 9)
    torch.testing.assert_close(m(input_ids=ids).logits, other(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    # assign=True takes the merged tensors as the parameters
    m.load_state_dict(H.build(arch, True, seed=8).state_dict(), assign=True)
    assert isinstance(m.model.layers[0].self_attn.qkv_proj.weight, torch.nn.Parameter)


def test_load_state_dict_missing_unexpected_and_mismatch():
    m, ref = patched_pair("qwen3", False)
    sd = ref.state_dict()
    before = m.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    del sd["model.layers.0.self_attn.k_proj.weight"]
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.full_like(sd["model.layers.0.self_attn.q_proj.weight"], 2.0)
    result = m.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["model.layers.0.self_attn.k_proj.weight"] and not result.unexpected_keys
    w = m.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(w[:64], torch.full((64, 64), 2.0))  # the q rows loaded
    assert torch.equal(w[64:96], before[64:96])  # the absent k rows kept
    with pytest.raises(RuntimeError, match="k_proj.weight"):
        m.load_state_dict(sd, strict=True)
    # all three of a layer absent: reported as the model without fusedqkv reports them, not as qkv_proj
    sd = ref.state_dict()
    for p in ("q", "k", "v"):
        del sd[f"model.layers.1.self_attn.{p}_proj.weight"]
    assert m.load_state_dict(sd, strict=False) == ref.load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError, match="Missing key.*model.layers.1.self_attn.q_proj.weight") as e:
        m.load_state_dict(sd)
    assert "qkv_proj" not in str(e.value)
    sd = ref.state_dict()
    sd["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(5, 64)
    with pytest.raises(RuntimeError, match="size mismatch for model.layers.1.self_attn.v_proj.weight"):
        m.load_state_dict(sd)
    sd = ref.state_dict()
    sd["model.layers.1.self_attn.v_proj.bias"] = torch.zeros(32)  # no biases in this model
    with pytest.raises(RuntimeError, match="v_proj.bias"):
        m.load_state_dict(sd)


def test_save_pretrained_round_trip(tmp_path):
    m, ref = patched_pair("qwen3", True)
    with torch.no_grad():
        m.model.layers[1].self_attn.qkv_proj.weight.mul_(1.5)  # trained values reach the checkpoint
    m.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path)  # a plain HF model
    for k, v in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = H.batch(1, 7)
    torch.testing.assert_close(loaded(input_ids=ids).logits, m(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_deepcopy_and_pickle_keep_the_fusion():
    m, ref = patched_pair("gemma3_text", True)
    ids = H.batch(1, 8)
    want = m(input_ids=ids).logits
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(clone.model.layers[0].self_attn).__name__ == "FusedQKVGemma3Attention"
        torch.testing.assert_close(clone(input_ids=ids).logits, want, rtol=0, atol=0)
        assert list(clone.state_dict()) == list(ref.state_dict())

# --------------------------------------------------------------------------- HF's weight init


def _forget_init_flags(model):
    """As a model built without HF's init (meta device, ``_init_weights`` overridden...): no module or
    tensor carries ``_is_hf_initialized``."""
    for x in list(model.modules()) + list(model.parameters()) + list(model.buffers()):
        x.__dict__.pop("_is_hf_initialized", None)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_init_weights_after_apply_to_is_hfs(arch):
    """``init_weights()`` (``post_init()`` calls it) on a fused model does what it does on HF's: nothing
    on an initialized model -- before, the fused projection and its rows modules, new to HF, were
    initialized again, so a loaded model's q/k/v weights were redrawn and their biases zeroed -- and on
    a model no init has touched, HF's draws from the same seed."""
    m, ref = patched_pair(arch, True)
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    for x in (m, ref):
        torch.manual_seed(5)
        x.init_weights()
    for k, v in want.items():
        assert torch.equal(ref.state_dict()[k], v), k  # (HF's own: a no-op)
        assert torch.equal(m.state_dict()[k], v), k
    for x in (m, ref):
        _forget_init_flags(x)
        torch.manual_seed(6)
        x.init_weights()
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert not torch.equal(sd_ref["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"])
    for k in sd_ref:
        assert torch.equal(sd[k], sd_ref[k]), k
    ids = H.batch(1, 7)
    torch.testing.assert_close(m(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def _built_on_meta(arch, bias, fuse):
    with torch.device("meta"):
        m = H.model_class(arch)(H.config(arch, bias))
    if fuse:
        assert fusedqkv.apply_to(m) == 2
    return m


@pytest.mark.parametrize("how", ["assign", "to_empty_then_load", "to_empty_then_init"])
@pytest.mark.parametrize("arch, bias", [("qwen3", True), ("gemma3_text", False)])
def test_a_model_built_on_meta_is_fused_then_materialised(arch, bias, how):
    """Deferred init (``torch.device("meta")``, then ``load_state_dict(assign=True)``, or ``to_empty`` and a
    load or HF's ``init_weights``): apply_to between the two, as FSDP2 recipes and accelerate's low-memory
    loading do, gives what the model without fusedqkv gives through the same steps. apply_to used to refuse
    meta weights."""
    built = H.build(arch, bias, seed=3)
    m, ref = _built_on_meta(arch, bias, True), _built_on_meta(arch, bias, False)
    assert m.model.layers[0].self_attn.qkv_proj.weight.is_meta
    for x in (m, ref):
        if how == "assign":
            result = x.load_state_dict(built.state_dict(), assign=True)
        else:
            x.to_empty(device="cpu")
            if how == "to_empty_then_load":
                result = x.load_state_dict(built.state_dict())
            else:
                _forget_init_flags(x)
                torch.manual_seed(11)
                x.init_weights()
                result = None
        assert result is None or (not result.missing_keys and not result.unexpected_keys)
        H.copy_unsaved_buffers(x, built)
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert torch.equal(sd[k], sd_ref[k]), k
        if how != "to_empty_then_init":
            assert torch.equal(sd[k], built.state_dict()[k]), k
    w = m.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(w, torch.nn.Parameter) and w.device.type == "cpu" and w.requires_grad
    ids = H.batch(2, 9)
    out, out_ref = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    out_ref.loss.backward()
    check_grads(m, ref, 1e-4)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("arch, bias", [("qwen3", True), ("gemma3_text", False)])
def test_adamw_30_steps_losses_match(arch, bias):
    """Liger's mini-model convergence style: the same data, 30 AdamW steps each; the losses
    agree step by step within fp32 tolerance, and training makes progress."""
    m, ref = patched_pair(arch, bias)
    opts = [torch.optim.AdamW(x.parameters(), lr=3e-3, weight_decay=0.01) for x in (m, ref)]
    losses = [[], []]
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(3, H.VOCAB, (2, 10), generator=g) for _ in range(4)]
    for step in range(30):
        ids = data[step % len(data)]
        for i, (model, opt) in enumerate(zip((m, ref), opts)):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses[i].append(loss.item())
    for step, (a, b) in enumerate(zip(*losses)):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-5, (step, a, b)
    assert losses[0][-1] < losses[0][0] - 0.5
    # the trained weights still agree (state dicts in HF form)
    sd, sd_ref = m.state_dict(), ref.state_dict()
    for k in sd_ref:
        assert rel(sd[k], sd_ref[k]) < 1e-3, k


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_gradient_checkpointing(arch):
    m, ref = patched_pair(arch, True)
    for x in (m, ref):
        x.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        x.train()
    ids = H.batch(2, 8)
    m(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    check_grads(m, ref, 1e-5)


def test_frozen_projection_weights():
    m, ref = patched_pair("qwen3", True)
    for x in (m, ref):
        for name, p in x.named_parameters():
            if "_proj" in name and "self_attn" in name and "o_proj" not in name:
                p.requires_grad_(False)
    m2 = H.build("qwen3", True)
    for name, p in m2.named_parameters():
        if "self_attn" in name and ("q_proj" in name or "k_proj" in name or "v_proj" in name):
            p.requires_grad_(False)
    assert fusedqkv.apply_to(m2) == 2
    assert not m2.model.layers[0].self_attn.qkv_proj.weight.requires_grad
    ids = H.batch(1, 6)
    m2(input_ids=ids, labels=ids).loss.backward()
    assert m2.model.layers[0].self_attn.qkv_proj.weight.grad is None
    assert m2.model.layers[0].self_attn.q_norm.weight.grad is not None


@pytest.mark.parametrize("how", ["requires_grad_", "attribute"])
@pytest.mark.parametrize("part", ["weight", "bias"])
def test_freezing_one_projection_after_apply_to_is_refused(how, part):
    """q/k/v are one parameter after apply_to: ``q_proj.weight.requires_grad_(False)`` would be set back to the
    fused parameter's flag at the next access and q would train on (logits 1.2 off HF's after one AdamW step,
    before the check). Refused, naming the way; the fused parameter's own flag is accepted through the rows."""
    m, _ = patched_pair("qwen3", True)
    a = m.model.layers[0].self_attn
    view = getattr(a.q_proj, part)
    with pytest.raises(fqt.UnsupportedModuleError, match=r"rows 0:64 of the fused q/k/v projection's parameter.*"
                                                     r"qkv_proj\.weight"):
        if how == "requires_grad_":
            view.requires_grad_(False)
        else:
            view.requires_grad = False
    assert getattr(a.q_proj, part).requires_grad and getattr(a.qkv_proj, part).requires_grad
    view.requires_grad_(True)  # the fused parameter's flag: nothing to refuse
    getattr(a.qkv_proj, part).requires_grad_(False)  # the way: q, k and v together ...
    assert not getattr(a.v_proj, part).requires_grad  # ... which the rows follow
    getattr(a.k_proj, part).requires_grad = False
    with pytest.raises(fqt.UnsupportedModuleError, match="requires_grad=True"):
        getattr(a.k_proj, part).requires_grad_(True)
    # a view that no longer shows the fused rows (the parameter moved) is a tensor of its own
    m.half()
    view.requires_grad_(True)


def test_freezing_one_projection_module_after_apply_to_is_refused():
    """``q_proj.requires_grad_(False)`` on the rows module: nn.Module's would find no parameters of its own and do
    nothing (q trained on). Refused as its weight's is; the fused parameter's flag is accepted."""
    m, _ = patched_pair("qwen3", True)
    a = m.model.layers[0].self_attn
    with pytest.raises(fqt.UnsupportedModuleError, match=r"requires_grad=False on rows 0:64 .*qkv_proj\.weight"):
        a.q_proj.requires_grad_(False)
    assert a.q_proj.requires_grad_(True) is a.q_proj
    a.qkv_proj.requires_grad_(False)
    a.v_proj.requires_grad_(False)
    assert not a.v_proj.weight.requires_grad and not a.qkv_proj.bias.requires_grad
    m.requires_grad_(True)  # the model's own: its parameters, the fused one among them
    assert a.q_proj.weight.requires_grad


def test_a_projection_called_directly_trains_the_fused_parameter():
    """User code that calls ``k_proj(x)`` itself after apply_to (keys of other states, as T5Gemma 2's cross-attention
    computes them): HF's values, and the gradient reaches the fused parameter's rows -- before, nn.Linear's forward
    read the rows views, leaves of their own, so the optimizer's parameter got none of it."""
    m, ref = patched_pair("qwen3", True)
    a, r = m.model.layers[0].self_attn, ref.model.layers[0].self_attn
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        y, y_ref = getattr(a, proj)(x), getattr(r, proj)(x)
        assert torch.equal(y, y_ref)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(i))
        (y * w).sum().backward()
        (y_ref * w).sum().backward()
    for kind in ("weight", "bias"):
        want = torch.cat([getattr(getattr(r, proj), kind).grad for proj in ("q_proj", "k_proj", "v_proj")])
        torch.testing.assert_close(getattr(a.qkv_proj, kind).grad, want, rtol=0, atol=0)
        assert all(getattr(getattr(a, proj), kind).grad is None for proj in ("q_proj", "k_proj", "v_proj"))


def test_a_loss_on_a_projections_weight_view_is_refused_not_lost():
    """A penalty on ``q_proj.weight`` after apply_to (a regulariser written against HF's names): that weight is a view
    of the fused parameter's rows, a leaf no optimizer holds, so its gradient would stay there -- refused as the
    backward reaches it, also through a view made while the fused parameter was frozen and used once it trains again. The same penalty on the fused
    parameter's rows gives HF's gradient."""
    m, ref = patched_pair("qwen3", True)
    a, r = m.model.layers[0].self_attn, ref.model.layers[0].self_attn
    ids = H.batch(1, 6)
    with pytest.raises(fqt.UnsupportedModuleError, match=r"rows 64:96 of the fused q/k/v projection's weight .*"
                                                         r"qkv_proj\.weight\[64:96\]"):
        (m(input_ids=ids, labels=ids).loss + a.k_proj.weight.square().sum()).backward()
    a.qkv_proj.requires_grad_(False)
    assert not a.v_proj.bias.requires_grad  # (a view made while frozen: no gradient, nothing to refuse)
    a.qkv_proj.requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with pytest.raises(fqt.UnsupportedModuleError, match=r"rows 96:128 of the fused q/k/v projection's bias"):
        (m(input_ids=ids, labels=ids).loss + a.v_proj.bias.square().sum()).backward()
    m.zero_grad(set_to_none=True)
    (m(input_ids=ids, labels=ids).loss + a.qkv_proj.weight[64:96].square().sum()).backward()
    (ref(input_ids=ids, labels=ids).loss + r.k_proj.weight.square().sum()).backward()
    torch.testing.assert_close(a.qkv_proj.weight.grad[64:96], r.k_proj.weight.grad, rtol=1e-5, atol=1e-6)


def test_torch_func_grad_over_a_fused_model_is_refused_with_the_reason():
    """``torch.func.grad`` over ``functional_call`` of a fused model (functional training, MAML-style
    inner loops): refused naming torch.func and the unfused model, where HF's own model takes it."""
    m, ref = patched_pair("qwen3")
    ids = H.batch(1, 6)

    def grads(x):
        params = {k: v.detach() for k, v in x.named_parameters()}
        return torch.func.grad(lambda p: torch.func.functional_call(x, p, (), {"input_ids": ids,
                                                                               "labels": ids}).loss)(params)

    assert grads(ref)["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    with pytest.raises(RuntimeError, match="torch.func transforms .* not supported by the fused block.*without "
                                           "apply_to"):
        grads(m)


def test_gradient_penalty_is_refused_with_the_reason():
    """A gradient penalty (the input gradient's norm, from backward(create_graph=True)) needs the
    block's backward differentiated: refused with the reason; the first-order gradients are HF's."""
    m, ref = patched_pair("qwen3", True)
    ids = H.batch(1, 6)
    grads = []
    for x in (m, ref):
        e = x.get_input_embeddings()(ids).detach().requires_grad_()
        (g,) = torch.autograd.grad(x(inputs_embeds=e, labels=ids).loss, e, create_graph=True)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    grads[1].square().sum().backward()  # HF's own: differentiable twice
    with pytest.raises(RuntimeError, match="fused block's backward is not itself differentiable"):
        grads[0].square().sum().backward()

@pytest.mark.parametrize("arch", ["qwen3", "hunyuan_v1_dense", "gemma3_text"])
def test_cpu_autocast_bf16(arch):
    """Under autocast the fused block runs in the autocast dtype as HF's Linear layers do.
    Three-way: the patched model's loss and every gradient of the fp32 master weights are at
    most twice as far from the fp32 values (relative, Frobenius) as the unpatched model's
    under autocast, plus 1e-2."""
    m, ref = patched_pair(arch, True)
    exact = copy.deepcopy(ref)
    ids = H.batch(2, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = m(input_ids=ids, labels=ids).loss
        b = ref(input_ids=ids, labels=ids).loss
    c = exact(input_ids=ids, labels=ids).loss
    assert abs(a.item() - c.item()) <= 2 * abs(b.item() - c.item()) + 1e-2 * abs(c.item())
    for x in (a, b, c):
        x.backward()
    assert m.model.layers[0].self_attn.qkv_proj.weight.grad.dtype == torch.float32
    ours, hf = dict(m.named_parameters()), dict(ref.named_parameters())
    for name, p in exact.named_parameters():
        if ".q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            base = name.split(".q_proj.")[0]
            g = ours[f"{base}.qkv_proj.{kind}"].grad
            parts = [f"{base}.{proj}.{kind}" for proj in ("q_proj", "k_proj", "v_proj")]
            g_hf = torch.cat([hf[n].grad for n in parts])
            g_exact = torch.cat([dict(exact.named_parameters())[n].grad for n in parts])
        elif ".k_proj." in name or ".v_proj." in name:
            continue
        else:
            g, g_hf, g_exact = ours[name].grad, hf[name].grad, p.grad
        e_ours = float((g - g_exact).norm() / g_exact.norm())
        e_hf = float((g_hf - g_exact).norm() / g_exact.norm())
        assert e_ours <= 2 * e_hf + 1e-2, (name, e_ours, e_hf)


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_generate_with_kv_cache_same_tokens(arch, attn):
    m, ref = patched_pair(arch, True, attn=attn)
    m.eval()
    ref.eval()
    ids = H.batch(2, 6, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    a = m.generate(ids, **kw)
    b = ref.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):  # every decode step (seq 1) agrees too
        torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-5)


def test_torch_compile_of_patched_model():
    torch._dynamo.reset()
    m, ref = patched_pair("qwen3", True, attn="sdpa")
    ids = H.batch(2, 8)
    cm = torch.compile(m, backend="aot_eager")
    out = cm(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-6)
    check_grads(m, ref, 1e-5)


# --------------------------------------------------------------------------- errors


def test_unsupported_architecture_is_named():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(fqt.UnsupportedModelError, match=r"LlamaForCausalLM \(model_type 'llama'\).*qwen3"):
        fusedqkv.apply_to(tf.LlamaForCausalLM(cfg))
    with pytest.raises(ValueError, match="unsupported architecture Linear"):
        fusedqkv.apply_to(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="model"):
        fusedqkv.apply_to("Qwen/Qwen3-0.6B")


def _expect_unchanged_error(m, match):
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(fqt.UnsupportedModelError, match=match):
        fusedqkv.apply_to(m)
    # nothing was changed, not even the layers before the offending one
    assert all(type(a).__name__ == "Qwen3Attention" for a in attn_modules(m))
    assert list(m.state_dict()) == list(sd)


def test_unsupported_configuration_is_named():
    m = H.build("qwen3", head_dim=514)
    _expect_unchanged_error(m, r"head_dim=514")
    m = H.build("qwen3")

    class LoRALinear(torch.nn.Linear):
        pass

    old = m.model.layers[1].self_attn.v_proj
    m.model.layers[1].self_attn.v_proj = LoRALinear(old.in_features, old.out_features, bias=False)
    _expect_unchanged_error(m, r"model.layers.1.self_attn.v_proj is a [\w.<>]*\.LoRALinear;")

    m = H.build("qwen3")
    m.model.layers[1].self_attn.k_norm.forward = lambda x: x
    _expect_unchanged_error(m, r"model.layers.1.self_attn.k_norm.forward was replaced")

    m = H.build("qwen3")
    m.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    _expect_unchanged_error(m, r"model.layers.0.self_attn: q/k/v_proj weights differ")

    m = H.build("qwen3")
    m.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(16)
    _expect_unchanged_error(m, r"model.layers.1.self_attn.q_norm is a LayerNorm")

    m = H.build("qwen3")
    m.model.layers[0].self_attn.forward = lambda *a, **k: None
    _expect_unchanged_error(m, r"model.layers.0.self_attn.forward was replaced")

    m = H.build("qwen3", num_key_value_heads=3, num_attention_heads=4)
    _expect_unchanged_error(m, r"num_heads=4 .*is not a multiple of num_kv_heads=3")


def test_hooked_norms_are_refused_by_apply_to():
    for kind in ("register_forward_hook", "register_forward_pre_hook"):
        m = H.build("qwen3")
        fn = (lambda mod, i, o: o * 2) if kind == "register_forward_hook" else (lambda mod, i: None)
        getattr(m.model.layers[1].self_attn.k_norm, kind)(fn)
        what = "forward hook" if kind == "register_forward_hook" else "forward pre-hook"
        _expect_unchanged_error(m, rf"model.layers.1.self_attn.k_norm has a {what}; the fused block computes the "
                                   r"norm in its kernel and never calls the module")



PROJECTION_HOOKS = [
    ("forward_hook", lambda v: v.register_forward_hook(lambda mod, i, o: o * 2), " has a forward hook"),
    ("forward_pre_hook", lambda v: v.register_forward_pre_hook(lambda mod, i: (i[0] * 2,)), " has a forward pre-hook"),
    ("backward_hook", lambda v: v.register_full_backward_hook(lambda mod, gi, go: None), " has a backward hook"),
    ("forward", lambda v: setattr(v, "forward", lambda x, f=v.forward: 2 * f(x)), r"\.forward was replaced by"),
]


@pytest.mark.parametrize("change", PROJECTION_HOOKS, ids=[c[0] for c in PROJECTION_HOOKS])
def test_hooked_projections_are_refused_by_apply_to(change):
    """A hook or a replaced forward on q/k/v_proj before apply_to (session 37: accepted, then dropped with the
    module it sat on: v doubled by a hook, the fused logits 0.066 off HF's)."""
    _, register, words = change
    m = H.build("qwen3")
    register(m.model.layers[1].self_attn.v_proj)
    _expect_unchanged_error(m, r"model\.layers\.1\.self_attn\.v_proj" + words)


@pytest.mark.parametrize("tie", ["module", "weight"])
def test_tied_projections_are_refused_by_apply_to(tie):
    """q/k/v weights tied across layers (one module in two layers, or one weight Parameter): the fused projection
    copies them, so apply_to would untie them (session 37: accepted; after one SGD step the logits were 1.19 (module)
    and 0.215 (weight) off the tied HF model's, with 2,048 more parameters)."""
    m = H.build("qwen3")
    a0, a1 = m.model.layers[0].self_attn, m.model.layers[1].self_attn
    if tie == "module":
        a1.v_proj = a0.v_proj
        name = "v_proj"
    else:
        a1.k_proj.weight = a0.k_proj.weight
        name = "k_proj"
    _expect_unchanged_error(m, rf"model\.layers\.0\.self_attn\.{name}\.weight is tied: it is the one tensor of "
                               rf"model\.layers\.0\.self_attn\.{name}\.weight, model\.layers\.1\.self_attn\.{name}\.weight")


TENSOR_HOOKS = {"gradient": (lambda t, seen: t.register_hook(lambda g: seen.append(g.shape)),
                             r"gradient hook \(register_hook\)"),
                "post_accumulate": (lambda t, seen: t.register_post_accumulate_grad_hook(lambda p: seen.append(p.shape)),
                                    "post-accumulate-grad hook")}


@pytest.mark.parametrize("hook", list(TENSOR_HOOKS))
@pytest.mark.parametrize("part", ["weight", "bias"])
def test_tensor_hooks_on_projection_weights_are_refused_by_apply_to(hook, part):
    """A tensor hook on a q/k/v weight or bias (gradient masking, an optimizer step in backward) never ran: the fused
    parameter is a copy without it (session 38: accepted, the hook silently never called). Refused before anything
    changes; registered on the fused parameter after apply_to, it runs."""
    register, kind = TENSOR_HOOKS[hook]
    m = H.build("qwen3", bias=True)
    register(getattr(m.model.layers[1].self_attn.v_proj, part), [])
    _expect_unchanged_error(m, rf"model\.layers\.1\.self_attn\.v_proj\.{part} has a {kind}; the fused projection "
                               rf"holds a copy")
    m, _ = patched_pair("qwen3", True)
    a = m.model.layers[0].self_attn
    seen = []
    register(getattr(a.qkv_proj, part), seen)
    ids = H.batch(1, 6)
    m(input_ids=ids, labels=ids).loss.backward()
    assert seen == [getattr(a.qkv_proj, part).shape]


def test_a_model_inside_ddp_is_refused_by_apply_to(tmp_path):
    """apply_to on a model already wrapped in DDP (``accelerate.prepare``'s result, say): DDP's reducer holds the
    q/k/v weights it wrapped, so the fused weight's gradient would never be all-reduced -- each rank training its own
    q/k/v, silently where ``find_unused_parameters=True`` (HF Trainer's default; session 39: accepted, the ranks'
    gradients differed after the first step). Refused before anything changes, naming the wrapper; a model already
    fused inside DDP is left as it is (0)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of the session's own")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        m = H.build("qwen3")
        ddp = DDP(m)
        with pytest.raises(fqt.UnsupportedModelError, match=r"model is a DistributedDataParallel, which recorded the "
                                                            r"q/k/v weights when it wrapped the model.*before wrapping"):
            fusedqkv.apply_to(ddp)
        assert all(type(a).__name__ == "Qwen3Attention" for a in attn_modules(m))
        fused = H.build("qwen3")
        fusedqkv.apply_to(fused)
        assert fusedqkv.apply_to(DDP(fused)) == 0
    finally:
        dist.destroy_process_group()


def test_an_optimizer_made_before_apply_to_is_refused_at_its_step():
    """An optimizer made before apply_to holds the q/k/v parameters apply_to replaced: they never get a gradient
    again, and the fused one, absent from it, never steps (session 39: accepted, q/k/v silently stopped training
    while the fused gradient, never zeroed, grew). Its step raises naming both -- also when it stepped before
    apply_to; one made after apply_to trains the fused weight; an optimizer of a PEFT model's trainable adapters
    (the replaced base weights frozen) is left alone."""
    m = H.build("qwen3", bias=True)
    before = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = H.batch(2, 6)
    m(input_ids=ids, labels=ids).loss.backward()
    before.step()  # checked once: nothing replaced yet
    fusedqkv.apply_to(m)
    m(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(fqt.UnsupportedModelError, match=r"AdamW holds model\.layers\.0\.self_attn\.q_proj\.weight, "
                                                        r"which fusedqkv\.apply_to replaced by "
                                                        r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*after apply_to"):
        before.step()
    with pytest.raises(fqt.UnsupportedModelError, match=r"AdamW holds model\.layers\.0\.self_attn\.q_proj\.weight"):
        torch.compile(before.step, backend="eager")()  # traced: looked through as the step is traced
    after = torch.optim.AdamW(m.parameters(), lr=1e-2)
    w = m.model.layers[0].self_attn.qkv_proj.weight
    w0 = w.detach().clone()
    after.step()
    assert not torch.equal(w0, w)
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(H.build("qwen3", bias=True), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    fusedqkv.apply_to(m)
    m(input_ids=ids, labels=ids).loss.backward()
    adapters.step()


# what HF's norms are after apply_to, followed or refused at the next forward (session 36: a hook, another module
# in q_norm's place or another eps were silently passed over; the block went on with apply_to's)
NORM_CHANGES = [
    ("forward_hook", lambda a: a.q_norm.register_forward_hook(lambda mod, i, o: o * 2),
     r"^fusedqkv: FusedQKVQwen3Attention.q_norm has a forward hook; the fused block computes the norm in its kernel"),
    ("backward_hook", lambda a: a.k_norm.register_full_backward_hook(lambda mod, gi, go: None),
     r"^fusedqkv: FusedQKVQwen3Attention.k_norm has a backward hook"),
    ("replaced_forward", lambda a: setattr(a.q_norm, "forward", lambda h: h),
     r"^fusedqkv: FusedQKVQwen3Attention.q_norm.forward was replaced"),
    ("another_module", lambda a: setattr(a, "k_norm", torch.nn.LayerNorm(16)),
     r"^fusedqkv: FusedQKVQwen3Attention.k_norm is a LayerNorm; the fused block computes Qwen3RMSNorm"),
    ("one_eps", lambda a: setattr(a.q_norm, "variance_epsilon", 1e-2),
     r"^fusedqkv: FusedQKVQwen3Attention: the q and k norms have different eps \(0.01, 1e-06\)"),
]


@pytest.mark.parametrize("change", NORM_CHANGES, ids=lambda c: c[0])
def test_norm_changes_after_apply_to_are_refused_at_the_next_forward(change):
    _, do, pattern = change
    m, _ = patched_pair("qwen3")
    ids = H.batch()
    m(ids)  # a first forward: the checks kept
    handle = do(m.model.layers[1].self_attn)
    with pytest.raises(fqt.UnsupportedModuleError, match=pattern):
        m(ids)
    if hasattr(handle, "remove"):  # a hook taken off again: the block runs as before
        handle.remove()
        m(ids)


def test_norm_eps_changed_after_apply_to_is_followed():
    m, ref = patched_pair("qwen3")
    ids = H.batch()
    m(ids)
    for model in (m, ref):
        for a in attn_modules(model)[:1]:
            a.q_norm.variance_epsilon = a.k_norm.variance_epsilon = 0.5  # large: a block on the old eps differs
    assert rel(m(ids).logits, ref(ids).logits) < 1e-5


def test_a_replaced_rope_function_is_refused(monkeypatch):
    """The block rotates q and k itself: another function in the modeling module's apply_rotary_pos_emb would not
    run (found in session 36), before apply_to or after it; HF's own and Liger-Kernel's are taken."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    def my_rope(q, k, cos, sin, *args, **kwargs):
        return q, k

    hf_rope = mq.apply_rotary_pos_emb
    pattern = (r"transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb was replaced by .*my_rope.*; the fused "
               r"block computes this family's RoPE in its kernel and would not call it")
    m = H.build("qwen3")
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", my_rope)
    _expect_unchanged_error(m, pattern)
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", hf_rope)
    assert fusedqkv.apply_to(m) == 2
    ids = H.batch()
    m(ids)
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", my_rope)
    with pytest.raises(fqt.UnsupportedModuleError, match="^fusedqkv: " + pattern):
        m(ids)
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", hf_rope)
    m(ids)


def test_int_weights_rejected():
    m = H.build("qwen3")
    m.model.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(
        torch.zeros(64, 64, dtype=torch.float64), requires_grad=True)
    _expect_unchanged_error(m, r"q_proj.weight has dtype torch.float64")
