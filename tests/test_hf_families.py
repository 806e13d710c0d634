"""fusedqkv.apply_to on every family of the SUPPORTED table (issue 25), on the CPU, from tiny
random configs (tests/_hf_families.py): one parametrised harness, each family against an
unpatched deep copy in fp32 -- the number of layers fused, logits, loss and every gradient
(the fused weight's against the concatenation of HF's projections'), HF state-dict keys and
values, an HF state dict of other values loading into the patched model, generate() with the
KV cache (left padding, sliding windows, hybrids' linear-attention caches) giving the same
tokens; and torch.compile once per recipe (``H.recipe``: families whose SUPPORTED rows differ only
in names, with the same biases and rotary width, trace the same fused forward). Plus mRoPE with
distinct sections, the per-family errors, and the table itself (one row per family, each row
tested)."""

import copy
import importlib
import pathlib
import re

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import _hf_families as H  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations import transformers as fqt  # noqa: E402


FAMILIES = H.params()
COMPILE_BACKEND = "eager"
TF_VERSION, _version = H.TF_VERSION, H.version
fused_modules, patched_pair, check_grads = H.fused_modules, H.patched_pair, H.check_grads


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_fp32_outputs_gradients_and_state_dict(fam, monkeypatch):
    bias = fam.bias
    m, ref = patched_pair(fam, bias)
    m.train()
    ref.train()
    calls = []
    fused = fqt.gqa_qkv_rope_qk_norm
    monkeypatch.setattr(fqt, "gqa_qkv_rope_qk_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))
    ids = H.batch(2, 12)
    out = m(**fam.inputs(ids))
    out_ref = ref(**fam.inputs(ids))
    assert len(calls) == (fam.n_calls or fam.n_fused)  # the fused block ran in each fused layer
    torch.testing.assert_close(fam.outputs(out), fam.outputs(out_ref), rtol=1e-5, atol=1e-5)
    loss, loss_ref = fam.loss(out), fam.loss(out_ref)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    loss_ref.backward()
    check_grads(m, ref, 1e-4)

    # state dict: HF's keys, order and values
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert sd[k].dtype == sd_ref[k].dtype and torch.equal(sd[k], sd_ref[k]), k
    # an HF state dict of other values loads into the patched model
    other = H.build(fam, bias, seed=7)
    result = m.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(fam.outputs(m(**fam.inputs(ids))), fam.outputs(other(**fam.inputs(ids))), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_generate_same_tokens(fam):
    m, ref = patched_pair(fam, fam.bias, attn=fam.fast_attn)
    if fam.base_model:  # no generate(): its inference, a padded batch under the fast attention
        ids = H.batch(3, 9, seed=5)
        with torch.no_grad():
            torch.testing.assert_close(fam.outputs(m(**fam.inputs(ids))), fam.outputs(ref(**fam.inputs(ids))),
                                       rtol=1e-5, atol=1e-5)
        return
    ids = H.batch(2, 7, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    a = m.generate(ids, **kw)
    b = ref.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):  # every decode step (seq 1) agrees too
        torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fam", H.recipe_params())
def test_family_torch_compile(fam):
    """Each fused attention module compiled (dynamo through the family's forward and the
    block; AOT autograd of the block's custom ops is test_hf_block_options'); the rest of the
    model is HF's business. One family per recipe: the others of it run the same fused forward
    (their outputs, gradients and generate are tested above, each)."""
    if fam.no_compile:
        pytest.skip(fam.no_compile)
    torch._dynamo.reset()
    m, ref = patched_pair(fam, fam.bias, attn=fam.fast_attn)
    m.train()
    ref.train()
    for mod in fused_modules(m):
        # one graph (raises on any break) unless HF's own code that the fused forward calls breaks it
        mod.compile(backend=COMPILE_BACKEND, fullgraph=fam.graph_breaks is None)
    ids = H.batch(2, 8)
    out = m(**fam.inputs(ids))
    fam.loss(out).backward()
    out_ref = ref(**fam.inputs(ids))
    fam.loss(out_ref).backward()
    torch.testing.assert_close(fam.outputs(out), fam.outputs(out_ref), rtol=1e-5, atol=1e-5)
    check_grads(m, ref, 1e-4)


# --------------------------------------------------------------------------- the table


def _model_types(cfg) -> set:
    """the model_type of a config and of every config inside it (T5Gemma 2: its encoder's text config, its decoder)"""
    out = {cfg.model_type}
    for value in vars(cfg).values():
        if isinstance(value, transformers.PretrainedConfig):
            out |= _model_types(value)
    return out


def test_every_row_has_a_family_test_and_exists():
    import importlib

    rows = {a.model_type: a for a in fqt.SUPPORTED}
    assert len(rows) == len(fqt.SUPPORTED)  # one row per family
    assert set(rows) == {f.name for f in H.FAMILIES}
    for f in H.FAMILIES:
        if TF_VERSION < _version(f.min_version):
            continue
        a = rows[f.name]
        cls = getattr(importlib.import_module(a.modeling), a.attention)  # the row names a real class ...
        assert f.name in _model_types(H.config(f))  # ... of this model_type (the text config's, or a sub-config's)
        assert cls.__name__ == a.attention
    # the README's coverage table names every family
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    table = readme[readme.index("| family (`model_type`)"):readme.index("Every family takes q/k/v biases")]
    assert set(re.findall(r"`(\w+)`", table)) >= set(rows)


# --------------------------------------------------------------------------- mRoPE


@pytest.mark.parametrize("name", ["qwen3_vl_text", "hunyuan_vl_text"])
def test_mrope_sections_merged_into_cos_sin(name):
    """Multimodal RoPE: distinct temporal/height/width positions (an image's) give per-token
    cos/sin that differ from the text positions'; the fused text model matches HF's with them,
    outputs and gradients."""
    fam = H.family(name)
    m, ref = patched_pair(fam, True)
    lm, lm_ref = m.model.language_model, ref.model.language_model
    b, s = 2, 10
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, s, 64, generator=g)
    axes = len(lm_ref.rotary_emb.mrope_section)
    pos = torch.stack([torch.arange(s) * (i + 1) % 7 for i in range(axes)])[:, None, :].expand(axes, b, s)
    text_pos = torch.arange(s)[None, None, :].expand(axes, b, s)
    w = torch.randn(b, s, 64, generator=g)
    outs = []
    for model in (lm, lm_ref):
        xi = x.clone().requires_grad_()
        h = model(inputs_embeds=xi, position_ids=pos).last_hidden_state
        (h * w).sum().backward()
        outs.append((h.detach(), xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-6)
    check_grads(m, ref, 1e-4)
    with torch.no_grad():  # the sections matter: text positions give other outputs
        assert not torch.allclose(lm(inputs_embeds=x, position_ids=text_pos).last_hidden_state, outs[0][0], atol=1e-3)


# --------------------------------------------------------------------------- errors


def _tiny(model_type, model_cls=None, **kw):
    base = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**base, **kw})
    cls = getattr(transformers, model_cls) if model_cls else transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    return cls(cfg)


_CHAMELEON = dict(vq_config=dict(embed_dim=4, num_embeddings=8, base_channels=32, channel_multiplier=[1],
                                 num_res_blocks=1, attn_resolutions=[], latent_channels=32, resolution=8),
                  vocabulary_map={"<image>": 5, "IMGIMGBA": 6})


@pytest.mark.parametrize("model_type, cls, kw, words", [
    ("cohere", None, dict(use_qk_norm=True), r"'cohere'\): its QK norm \(use_qk_norm\) is a LayerNorm"),
    ("chameleon", "ChameleonForConditionalGeneration", _CHAMELEON, r"'chameleon'\): its QK norm is a LayerNorm"),
    ("persimmon", None, dict(qk_layernorm=True), r"'persimmon'\): its QK layernorm is a LayerNorm"),
    ("phi", None, dict(qk_layernorm=True), r"'phi'\): its QK layernorm is a LayerNorm"),
    ("stablelm", None, dict(qk_layernorm=True), r"'stablelm'\): its QK layernorm is a per-head LayerNorm"),
], ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None)
def test_layernorm_qk_norm_families_are_named(model_type, cls, kw, words):
    with pytest.raises(fqt.UnsupportedModelError, match=words):
        fusedqkv.apply_to(_tiny(model_type, cls, **kw))


@pytest.mark.parametrize("model_type, cls, kw, words", [
    ("esmc", "EsmcModel", dict(num_key_value_heads=4), r"'esmc'\): its QK norm is a LayerNorm"),
    ("inkling_text", "InklingTextModel", dict(), r"'inkling_text'\): its k and v pass through short convolutions"),
    ("zaya", "ZayaForCausalLM", dict(), r"'zaya'\): its q/k/v projection is Compressed Convolutional Attention"),
    ("muse_glimmer_assistant", "MuseGlimmerAssistantModel", dict(),
     r"'muse_glimmer_assistant'\): its k and v project the drafted block's context"),
], ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None)
def test_qk_norm_families_the_block_cannot_take_are_named(model_type, cls, kw, words):
    """Families of transformers 5.17 with a QK norm that apply_to cannot fuse: the reason, not only "no
    attention module of a supported family"."""
    with pytest.raises(fqt.UnsupportedModelError, match=words):
        fusedqkv.apply_to(_tiny(model_type, cls, **kw))


def test_molmo2_norm_over_all_heads_follows_its_config():
    """Molmo2's qk_norm_type "olmo" norms the whole q and k projections (OLMo 2's way), "qwen3" each head (the
    family's test config): one row, the scope read per layer."""
    fam = H.family("molmo2_text")
    m, ref = patched_pair(fam, fam.bias, qk_norm_type="olmo")
    assert all(mod._fusedqkv.block_kwargs.get("norm_scope") == "all_heads" for mod in fused_modules(m))
    m.train()
    ref.train()
    ids = H.batch(2, 12)
    out, out_ref = m(**fam.inputs(ids)), ref(**fam.inputs(ids))
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    check_grads(m, ref, 1e-4)


def test_family_settings_without_a_block_are_named():
    m = H.build(H.family("glm4_moe"), use_qk_norm=False, rope_parameters=H.rope(1.0))
    with pytest.raises(fqt.UnsupportedModelError, match=r"'glm4_moe'\): no attention layer can be fused; .*"
                                                         r"no QK norm \(use_qk_norm=False\)"):
        fusedqkv.apply_to(m)
    m = H.build(H.family("llama4_text"), use_qk_norm=False)
    with pytest.raises(fqt.UnsupportedModelError, match=r"llama4_text .*no QK norm"):
        fusedqkv.apply_to(m)
    m = H.build(H.family("olmoe"), clip_qkv=4.0)
    with pytest.raises(fqt.UnsupportedModelError, match=r"clip_qkv=4.0 clamps q/k/v"):
        fusedqkv.apply_to(m)
    assert not fused_modules(m)  # nothing changed


def test_flint_attention_gets_hfs_arguments_sinks_included(monkeypatch):
    """Flint's attention function receives what HF's forward gives it, its sinks as ``s_aux`` among them
    (HF's eager function reads ``module.sinks`` itself; kernels that take sinks read ``s_aux``)."""
    fam = H.family("flint")
    if TF_VERSION < _version(fam.min_version):
        pytest.skip(f"flint needs transformers >= {fam.min_version}")
    modeling = importlib.import_module("transformers.models.flint.modeling_flint")
    calls = []
    eager = modeling.eager_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, {k: v for k, v in kwargs.items() if k != "position_ids"}))
        return eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    m, ref = patched_pair(fam, fam.bias)
    ids = H.batch(2, 8)
    ref(input_ids=ids)
    want, calls[:] = list(calls), []
    m(input_ids=ids)
    assert [i for i, _ in calls] == [i for i, _ in want] == [0, 1]
    for (_, got), (i, exp) in zip(calls, want):
        assert sorted(got) == sorted(exp), i
        assert got["s_aux"] is m.model.layers[i].self_attn.sinks and exp["s_aux"] is ref.model.layers[i].self_attn.sinks
        assert got["sliding_window"] == exp["sliding_window"]


def test_beam_nope_layers_scale_the_query_by_position():
    """Beam's full-attention layers (NoPE) scale q by (1 + position / 2048) ** 0.1 (the decoder's
    attention_scaling), ~1.0006 at the family test's positions: at positions past 50k it is ~1.48, and the
    fused model must still match HF."""
    fam = H.family("beam")
    if TF_VERSION < _version(fam.min_version):
        pytest.skip(f"beam needs transformers >= {fam.min_version}")
    m, ref = patched_pair(fam, fam.bias)
    m.train()
    ref.train()
    ids = H.batch(2, 12)
    pos = (torch.arange(12) + 50_000).expand(2, 12)
    out, out_ref = m(input_ids=ids, labels=ids, position_ids=pos), ref(input_ids=ids, labels=ids, position_ids=pos)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    check_grads(m, ref, 1e-4)


def test_a_forward_parameter_no_hook_reads_is_refused(monkeypatch):
    """An HF attention forward naming an input the row does not read (a release giving a supported family a
    new one) is refused by name: the fused forward would hand it to the attention function, which drops it."""
    from transformers.models.qwen3 import modeling_qwen3

    hf_forward = modeling_qwen3.Qwen3Attention.forward

    def forward(self, hidden_states, position_embeddings, attention_mask, query_gain=None, **kwargs):
        return hf_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)

    m = H.build(H.family("qwen3"))
    fusedqkv.apply_to(copy.deepcopy(m))  # the fused class exists before the forward changes
    monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "forward", forward)
    with pytest.raises(fqt.UnsupportedModelError, match=r"Qwen3Attention.forward takes query_gain, which the fused "
                                                         r"forward does not apply"):
        fusedqkv.apply_to(m)
    assert not fused_modules(m)


def _weightless_rms_norm_class(name: str, eps_attr: str) -> type:
    """HF's weightless RMSNorm of Llama 4 (fp32, rounded once to the input's dtype) under a class name and
    an eps attribute of choice: transformers 5.25 calls it Llama4TextWeightlessRMSNorm with
    ``variance_epsilon``, 5.17 Llama4TextL2Norm with ``eps``."""
    def __init__(self, eps):
        torch.nn.Module.__init__(self)
        setattr(self, eps_attr, eps)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + getattr(self, eps_attr))).type_as(x)

    return type(name, (torch.nn.Module,), dict(__init__=__init__, forward=forward))


@pytest.mark.parametrize("name, fused", [("Llama4TextWeightlessRMSNorm", True), ("Llama4TextOtherNorm", False)])
def test_llama4_norm_under_its_transformers_5_25_name(name, fused):
    """transformers 5.25 renamed Llama 4's q/k norm (same math, eps under another attribute): the
    table takes both names, computes with the module's own eps, and refuses any other class naming both."""
    fam = H.family("llama4_text")
    ref = H.build(fam)
    cls = _weightless_rms_norm_class(name, "variance_epsilon")
    m = copy.deepcopy(ref)
    eps = 3e-5  # not the config's: the block must read the module's
    for mod in list(m.modules()):
        if "qk_norm" in mod._modules:
            mod.qk_norm = cls(eps)
    for mod in list(ref.modules()):
        if "qk_norm" in mod._modules:  # HF's own class, whichever release: its eps attribute
            setattr(mod.qk_norm, "variance_epsilon" if hasattr(mod.qk_norm, "variance_epsilon") else "eps", eps)
    if not fused:
        with pytest.raises(fqt.UnsupportedModelError,
                           match=r"qk_norm is a Llama4TextOtherNorm; the fused block computes Llama4TextL2Norm or "
                                 r"Llama4TextWeightlessRMSNorm"):
            fusedqkv.apply_to(m)
        return
    assert fusedqkv.apply_to(m) == fam.n_fused
    ids = H.batch(2, 12)
    out, out_ref = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    out_ref.loss.backward()
    check_grads(m, ref, 1e-4)


def test_gemma4_every_attention_layer_fused_global_head_dim_512():
    """Gemma 4's global layers (head_dim 512, v the k projection, proportional RoPE) are fused like
    its sliding layers; only the KV-shared layer stays HF's. A head_dim above the block's 512 is
    refused naming the layer, before anything changes."""
    fam = H.family("gemma4_text")
    m, _ = patched_pair(fam)
    dims = {mod.layer_type: (mod._fusedqkv.head_dim, mod._fusedqkv.k_eq_v) for mod in fused_modules(m)}
    assert dims == {"sliding_attention": (16, False), "full_attention": (512, True)}
    unfused = [mod for mod in m.modules() if type(mod).__name__ == "Gemma4TextAttention"]
    assert [mod.is_kv_shared_layer for mod in unfused] == [True]
    big = H.build(fam, global_head_dim=520)
    with pytest.raises(fqt.UnsupportedModelError, match=r"model.layers.1.self_attn .*head_dim=520; the fused block "
                                                         r"needs an even head_dim <= 512"):
        fusedqkv.apply_to(big)
    assert not fused_modules(big)


@pytest.mark.parametrize("name", ["qwen3_next", "olmo2", "llama4_text", "nanochat", "gemma4_text", "exaone4", "ergo", "dory"])
def test_cpu_autocast_bf16_three_way(name):
    """Under autocast the block runs in bf16 as HF's Linear layers do (one family per switch):
    the patched model's loss and every gradient of the fp32 master weights are at most twice
    as far from the fp32 values (relative, Frobenius) as the unpatched model's under autocast,
    plus 1e-2."""
    fam = H.family(name)
    # Gemma 4's global layers at head_dim 32: at 512 unit-RMS q.k logits (scaling 1) are ~20 wide, a near
    # one-hot softmax that bf16 roundings flip, so both models' gradients are 3-10% off fp32 at random
    m, ref = patched_pair(fam, fam.bias, **(dict(global_head_dim=32) if name == "gemma4_text" else {}))
    exact = copy.deepcopy(ref)
    for x in (m, ref, exact):
        x.train()
    ids = H.batch(2, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = m(input_ids=ids, labels=ids).loss
        b = ref(input_ids=ids, labels=ids).loss
    c = exact(input_ids=ids, labels=ids).loss
    assert abs(a.item() - c.item()) <= 2 * abs(b.item() - c.item()) + 1e-2 * abs(c.item())
    for x in (a, b, c):
        x.backward()
    ours, hf, ex = dict(m.named_parameters()), dict(ref.named_parameters()), dict(exact.named_parameters())
    for name_, p in ours.items():
        g_hf, g_exact = H.hf_grad(m, name_, hf), H.hf_grad(m, name_, ex)
        if g_exact is None or not float(g_exact.norm()):
            continue
        assert p.grad.dtype == torch.float32
        e_ours = float((p.grad - g_exact).norm() / g_exact.norm())
        e_hf = float((g_hf - g_exact).norm() / g_exact.norm())
        assert e_ours <= 2 * e_hf + 1e-2, (name_, e_ours, e_hf)


def test_bf16_model_whose_rotary_stays_fp32():
    """OLMo 2's rotary embedding returns fp32 cos/sin beside bf16 activations (HF rotates in fp32
    and rounds after): the patched bf16 model runs, its loss within the bf16 three-way rule of the
    fp32 model's, and the block's own gradients too."""
    fam = next(f for f in H.FAMILIES if f.name == "olmo2")
    exact = H.build(fam, fam.bias, attn=fam.fast_attn).train()
    ref = copy.deepcopy(exact).to(torch.bfloat16)
    m = copy.deepcopy(ref)
    assert fusedqkv.apply_to(m) == fam.n_fused
    ids = H.batch(2, 24)
    losses = [x(input_ids=ids, labels=ids).loss for x in (m, ref, exact)]
    a, b, c = (float(x) for x in losses)
    assert abs(a - c) <= 2 * abs(b - c) + 1e-2 * abs(c), (a, b, c)
    for x in losses:
        x.backward()
    base = "model.layers.0.self_attn"
    for norm in ("q_norm", "k_norm"):
        g, g_hf, g_exact = (d.get_parameter(f"{base}.{norm}.weight").grad.float() for d in (m, ref, exact))
        e, e_hf = float((g - g_exact).norm() / g_exact.norm()), float((g_hf - g_exact).norm() / g_exact.norm())
        assert e <= 2 * e_hf + 1e-2, (norm, e, e_hf)
