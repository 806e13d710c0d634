"""QLoRA inside the fused block (integrations.qlora): tiny models saved and loaded 4-bit with
bitsandbytes (PEFT's recipe: BitsAndBytesConfig(load_in_4bit=True, NF4/FP4, double quantisation),
prepare_model_for_kbit_training, get_peft_model), against the same PEFT QLoRA model without
fusedqkv; fp32 compute on the CPU, both orders. Skipped where bitsandbytes is not installed (CI
does not install it: a 43 MB wheel) or cannot quantize 4-bit on this CPU."""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
from peft import (LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict,  # noqa: E402
                  prepare_model_for_kbit_training, set_peft_model_state_dict)
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations.fused_projection import UnsupportedModuleError  # noqa: E402

from _hf_families import build, family, fused_modules  # noqa: E402
from _lora_checks import assert_bf16_like_peft, dense_copy, rel as _rel, step as _step  # noqa: E402

TOL = 1e-5


def _cpu_4bit_works() -> str:
    """'' where bitsandbytes quantizes and dequantizes 4-bit on this CPU, else why not."""
    try:
        layer = bnb.nn.Linear4bit(64, 8, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(8, 64), requires_grad=False, quant_type="nf4").to("cpu")
        bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return f"bitsandbytes {bnb.__version__} cannot run 4-bit on this CPU: {type(e).__name__}: {e}"
    return ""


_WHY = _cpu_4bit_works()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "-")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family name -> a saved tiny model (fp32, random norms and biases)."""
    root, saved = tmp_path_factory.mktemp("qlora"), {}

    def get(name):
        if name not in saved:  # (remembered once saved: a family this transformers lacks skips every time)
            build(family(name), bias=True).save_pretrained(root / name)
            saved[name] = root / name
        return saved[name]
    return get


def _load(path, quant_type="nf4", bits=4, skip=None):
    if bits == 8:
        q = BitsAndBytesConfig(load_in_8bit=True)
    else:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu", dtype=torch.float32)


def _lora(targets="all-linear", **kw):
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kw)


def _pair(path, order, config=None, quant_type="nf4", skip=None):
    """(the PEFT QLoRA model with fusedqkv, the same without), equal adapters, in training mode
    (the recipe's gradient checkpointing on)."""
    config = config or _lora()
    torch.manual_seed(10)
    ref = get_peft_model(prepare_model_for_kbit_training(_load(path, quant_type, skip=skip)), copy.deepcopy(config))
    m = _load(path, quant_type, skip=skip)
    if order == "apply_first":
        assert fusedqkv.apply_to(m) > 0
        m = get_peft_model(prepare_model_for_kbit_training(m), copy.deepcopy(config))
    else:
        m = get_peft_model(prepare_model_for_kbit_training(m), copy.deepcopy(config))
        assert fusedqkv.apply_to(m) > 0
    set_peft_model_state_dict(m, get_peft_model_state_dict(ref))
    m.train()
    ref.train()
    return m, ref


def _ids(vocab, seed=0):
    return torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))


def _logits(m, ids):
    # in training mode (dropout 0: the same function): bitsandbytes' CPU inference path (eval, no
    # grad) repacks the 4-bit weight for its AVX-512 kernel, which fails on these tiny shapes
    m.train()
    return m(input_ids=ids).logits


CASES = [("qwen3", "nf4"), ("qwen3", "fp4"), ("qwen3_5_text", "nf4"), ("olmo3", "nf4"), ("glm4_moe", "nf4")]


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
@pytest.mark.parametrize("fam,quant_type", CASES, ids=[f"{f}-{q}" for f, q in CASES])
def test_qlora_logits_and_adapter_gradients_match_peft(checkpoints, fam, quant_type, order):
    m, ref = _pair(checkpoints(fam), order, quant_type=quant_type)
    attn = fused_modules(m)[0]
    assert type(attn.q_proj.base_layer) is bnb.nn.Linear4bit and "qkv_proj" not in attn._modules
    ids = _ids(m.config.vocab_size)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert sorted(g) == sorted(w) and any(".q_proj.lora_A." in n for n in g)
    ill = [n for n in w if g[n] is None or _rel(g[n], w[n]) > TOL]
    if ill:
        # OLMo 3's norm across heads: a gradient fp32 itself resolves worse than TOL (test_hf_peft):
        # the three-way rule against the same QLoRA model in float64 (the 4-bit weights dequantized
        # to the same values)
        _, w64 = _step(dense_copy(ref).double(), ids)
    for name in w:
        assert g[name] is not None, name
        if name in ill:
            assert _rel(g[name], w64[name]) <= 2 * _rel(w[name], w64[name]) + TOL, name


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_qlora_on_hfs_own_joined_qkv_proj(checkpoints, order):
    """Ergo's one qkv_proj Linear loaded 4-bit: the block dequantizes it as one slot of all rows, the adapter's B
    rows [Q | K | V]. (o_proj stays dense: HF's Ergo decoder casts the attention's input to o_proj's weight dtype,
    uint8 where it is 4-bit, which the block refuses by name.)"""
    m, ref = _pair(checkpoints("ergo"), order, skip=["o_proj", "lm_head"])
    attn = fused_modules(m)[0]
    assert type(attn.qkv_proj.base_layer) is bnb.nn.Linear4bit and "qkv_fused" not in attn._modules
    ids = _ids(m.config.vocab_size, 2)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert sorted(g) == sorted(w) and any(".qkv_proj.lora_A." in n for n in g)
    assert all(g[n] is not None and _rel(g[n], w[n]) <= TOL for n in w)


def test_qlora_q_v_subset_and_dropout(checkpoints):
    m, ref = _pair(checkpoints("qwen3"), "apply_first", _lora(["q_proj", "v_proj"], lora_dropout=0.2, use_rslora=True))
    ids = _ids(m.config.vocab_size, 1)
    torch.manual_seed(5)  # the same dropout masks, drawn in PEFT's order
    got, g = _step(m, ids)
    torch.manual_seed(5)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL and all(_rel(g[n], w[n]) <= TOL for n in w)
    assert not any(".k_proj.lora_" in n for n in g)


@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_qlora_fused_attention_compiles_as_one_graph(checkpoints, order):
    """PEFT QLoRA with the block (the recipe's gradient checkpointing on), each fused attention compiled with
    fullgraph=True (aot_eager): the logits and every adapter gradient equal the uncompiled PEFT model's."""
    torch._dynamo.reset()
    m, ref = _pair(checkpoints("qwen3"), order)
    ids = _ids(m.config.vocab_size)
    for mod in fused_modules(m):
        mod.compile(backend="aot_eager", fullgraph=True)
    got, g = _step(m, ids)
    want, w = _step(ref, ids)
    assert _rel(got, want) <= TOL
    assert sorted(g) == sorted(w) and all(g[n] is not None and _rel(g[n], w[n]) <= TOL for n in w)


def test_qlora_backward_rebuilds_the_dequantized_weight(checkpoints):
    """Nothing dense of the 4-bit q/k/v is kept between forward and backward: the block's backward
    dequantizes again (one call per fused layer) and no saved tensor has the fused weight's shape."""
    from fusedqkv.integrations import qlora

    m, _ = _pair(checkpoints("qwen3"), "apply_first")
    m.base_model.model.gradient_checkpointing_disable()
    attn = fused_modules(m)[0]
    n_tot = sum(attn._fusedqkv.split)
    calls, saved = [], []
    real = qlora.DequantizedQKV.__call__

    def counting(self):
        calls.append(torch.is_grad_enabled())
        return real(self)

    ids = _ids(m.config.vocab_size, 2)
    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        mp.setattr(qlora.DequantizedQKV, "__call__", counting)
        loss = m(input_ids=ids, labels=ids).loss
        n_fused = len(fused_modules(m))
        assert len(calls) == n_fused
        loss.backward()
    assert len(calls) == 2 * n_fused
    assert (n_tot, m.config.hidden_size) not in saved


def test_qlora_kept_absmax_is_bitwise_and_follows_the_quant_state(checkpoints):
    """The kept plan keeps each 4-bit projection's dequantized absmax (config.qlora_absmax "keep"):
    the step is bitwise the "recompute" one, bitsandbytes' blockwise dequantization of the absmax runs
    once per projection (not twice per step), and a projection quantized again is read anew."""
    import bitsandbytes.functional as bf

    from fusedqkv.ops import config

    m, _ = _pair(checkpoints("qwen3"), "apply_first")
    m.base_model.model.gradient_checkpointing_disable()
    ids = _ids(m.config.vocab_size, 3)
    with config.override(qlora_absmax="recompute"):
        want, w = _step(m, ids)
    qkv_absmax = {id(a.get_submodule(f"{p}.base_layer").weight.quant_state.absmax)
                  for a in fused_modules(m) for p in ("q_proj", "k_proj", "v_proj")}
    n_4bit = len(qkv_absmax)
    calls = []  # the blockwise dequantizations of a q/k/v absmax (o_proj and the MLP are 4-bit too)
    real = bf.dequantize_blockwise
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bf, "dequantize_blockwise", lambda a, *r, **k: (id(a) in qkv_absmax and calls.append(1)) or
                   real(a, *r, **k))
        got, g = _step(m, ids)
        assert len(calls) == n_4bit  # made by the first forward, read by its backward
        got2, g2 = _step(m, ids)
        assert len(calls) == n_4bit  # kept
    assert torch.equal(got, want) and torch.equal(got2, want)
    assert all(torch.equal(g[n], w[n]) and torch.equal(g2[n], w[n]) for n in w)
    # q_proj quantized again from other values: a new quantization state, so a new absmax
    q = fused_modules(m)[0].q_proj.base_layer
    dense = bf.dequantize_4bit(q.weight.data, q.weight.quant_state)
    q.weight = bnb.nn.Params4bit(1.5 * dense, requires_grad=False, quant_type="nf4", compress_statistics=True).to("cpu")
    with config.override(qlora_absmax="recompute"):
        want3, w3 = _step(m, ids)
    got3, g3 = _step(m, ids)
    assert not torch.equal(want3, want)
    assert torch.equal(got3, want3) and all(torch.equal(g3[n], w3[n]) for n in w3)
    # the absmax written in place (its version counter moves): read anew too
    with torch.no_grad():
        q.weight.quant_state.absmax.copy_(q.weight.quant_state.absmax.flip(0))
    with config.override(qlora_absmax="recompute"):
        want4, _ = _step(m, ids)
    got4, _ = _step(m, ids)
    assert not torch.equal(want4, want3) and torch.equal(got4, want4)


def test_qlora_adapters_round_trip_and_state_dict(checkpoints, tmp_path):
    path = checkpoints("qwen3")
    m, ref = _pair(path, "apply_first")
    ids = _ids(m.config.vocab_size, 3)
    assert list(m.state_dict()) == list(ref.state_dict())  # bitsandbytes' own keys (absmax, quant_map...)
    m.save_pretrained(tmp_path / "fused")
    unfused = PeftModel.from_pretrained(_load(path), tmp_path / "fused")
    assert _rel(_logits(unfused, ids), _logits(m, ids)) <= TOL
    ref.save_pretrained(tmp_path / "unfused")
    fused_base = _load(path)
    fusedqkv.apply_to(fused_base)
    fused = PeftModel.from_pretrained(fused_base, tmp_path / "unfused")
    assert _rel(_logits(fused, ids), _logits(ref, ids)) <= TOL


@pytest.mark.filterwarnings("ignore:Merge lora module to 4-bit linear")
def test_qlora_merge_disable_and_unload_match_peft(checkpoints):
    m, ref = _pair(checkpoints("qwen3"), "apply_first")
    ids = _ids(m.config.vocab_size, 4)
    with m.disable_adapter(), ref.disable_adapter():
        assert _rel(_logits(m, ids), _logits(ref, ids)) <= TOL
    merged, merged_ref = m.merge_and_unload(), ref.merge_and_unload()  # requantized by PEFT: the same values
    assert type(fused_modules(merged)[0].q_proj) is bnb.nn.Linear4bit
    assert _rel(_logits(merged, ids), _logits(merged_ref, ids)) <= TOL


def test_8bit_projections_are_refused_by_apply_to(checkpoints):
    m = _load(checkpoints("qwen3"), bits=8)
    with pytest.raises(fusedqkv.UnsupportedModelError, match=r"Linear8bitLt computes LLM\.int8\(\)"):
        fusedqkv.apply_to(m)
    assert not fused_modules(m)  # nothing changed


@pytest.mark.parametrize("after_a_forward", [False, True], ids=["first_forward", "after_a_forward"])
@pytest.mark.parametrize("what", ["dense", "hook", "quant_state"])
def test_a_replaced_or_hooked_4bit_projection_is_refused(checkpoints, what, after_a_forward):
    m = _load(checkpoints("qwen3"))
    fusedqkv.apply_to(m)
    attn = fused_modules(m)[0]
    if after_a_forward:  # the decisions kept by that forward (projection_plan) are not reused
        _logits(m, _ids(m.config.vocab_size))
    if what == "dense":
        attn._modules["k_proj"] = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features)
        match = r"k_proj is a torch\.nn\.modules\.linear\.Linear; this attention was fused over bitsandbytes 4-bit"
    elif what == "hook":
        attn.v_proj.register_forward_hook(lambda *a: None)
        match = r"v_proj has a forward hook"
    else:  # its quantization state lost (checked every call: the plan does not hold it)
        attn.q_proj.weight.quant_state = None
        attn.q_proj.__dict__.pop("quant_state", None)
        match = r"q_proj \(Linear4bit\) has no quantization state"
    with pytest.raises(UnsupportedModuleError, match=match):
        m(input_ids=_ids(m.config.vocab_size))


def test_unquantized_4bit_layers_are_refused_by_apply_to():
    m = build(family("qwen3"), bias=True)
    attn = m.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = attn._modules[name]
        attn._modules[name] = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=True,
                                                compute_dtype=torch.float32)  # never moved: not quantized
    with pytest.raises(fusedqkv.UnsupportedModelError, match=r"q_proj \(Linear4bit\) has no quantization state"):
        fusedqkv.apply_to(m)
    assert not fused_modules(m)


def test_qlora_under_autocast_matches_peft(checkpoints):
    """Under bf16 autocast (the Trainer's bf16=True) the block dequantizes into bf16 and runs the
    adapters in bf16, as PEFT's QLoRA does there: the three-way rule against the run without
    autocast (fp32)."""
    m, ref = _pair(checkpoints("qwen3"), "apply_first")
    ids = _ids(m.config.vocab_size, 6)
    want32, w32 = _step(ref, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, g = _step(m, ids)
        want, w = _step(ref, ids)
    assert_bf16_like_peft(got, g, want, w, want32, w32)
