"""Tiny Hugging Face models for the integration tests (random init, nothing downloaded):
one builder per supported architecture, 2 layers, hidden 64, GQA 4:2 heads of 16."""

import torch

ARCHS = ["qwen3", "qwen3_moe", "hunyuan_v1_dense", "gemma3_text"]
VOCAB = 97


def config(arch, bias=False, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attention_bias=bias, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        kw = dict(common, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
        cls = tf.Qwen3Config
    elif arch == "qwen3_moe":
        # Qwen3-MoE has no head_dim field: hidden / heads = 16
        kw = dict(common, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        cls = tf.Qwen3MoeConfig
    elif arch == "hunyuan_v1_dense":
        kw = dict(common, head_dim=16, rms_norm_eps=1e-5)
        cls = tf.HunYuanDenseV1Config
    elif arch == "gemma3_text":
        # a sliding layer (window 5 < the test sequences) and a full one; logit soft-capping
        kw = dict(common, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=20.0,
                  final_logit_softcapping=30.0)
        cls = tf.Gemma3TextConfig
    else:
        raise ValueError(arch)
    kw.update(over)
    return cls(**kw)


def model_class(arch):
    import transformers as tf

    return {"qwen3": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
            "hunyuan_v1_dense": tf.HunYuanDenseV1ForCausalLM, "gemma3_text": tf.Gemma3ForCausalLM}[arch]


def build(arch, bias=False, seed=0, attn="eager", dtype=torch.float32, **over):
    """A tiny model; every norm weight is randomised (HF inits them to 1, Gemma3's to 0, which
    would hide a wrong weight form) and so are the biases."""
    cfg = config(arch, bias, **over)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    m = model_class(arch)(cfg)
    perturb_norms_and_biases(m, seed + 1)
    return m.to(dtype)


def perturb_norms_and_biases(m, seed):
    """Every norm weight and bias moved by 0.3 N(0, 1) (reproducible from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))


def batch(b=2, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (b, s), generator=g)


def copy_unsaved_buffers(m, built):
    """HF's non-persistent buffers (the rotary ``inv_freq``, Gemma's ``embed_scale``) are in no state dict, so a
    model built on meta takes them from a built one (the same with or without fusedqkv); returns ``m``."""
    src, saved = dict(built.named_buffers()), built.state_dict()
    for name, _ in list(m.named_buffers()):
        if name not in saved:
            path, _, attr = name.rpartition(".")
            m.get_submodule(path)._buffers[attr] = src[name].clone()
    return m
