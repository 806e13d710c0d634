"""Tiny random Hugging Face models of every family in fusedqkv's SUPPORTED table (nothing
downloaded): 2 decoder layers (hybrids: one of them attention), hidden 64, GQA 4:2 heads of 16
(32 where a partial rotary width needs it), vocab 97. Each family names its model class (one
with ``generate``) and how many attention layers apply_to fuses."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from _hf_models import VOCAB, batch, perturb_norms_and_biases  # noqa: F401 (batch: the families' tests use H.batch)

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(linear_conv_kernel_dim=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4)
QWEN_VIT = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                num_position_embeddings=16, deepstack_visual_indexes=[0])
HUNYUAN_VIT = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, out_hidden_size=64,
                   patch_size=4, text_hidden_size=64)

OMNI_AUDIO = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=32,
                  output_dim=64, downsample_hidden_size=8, max_source_positions=16)
MUSE_VIT = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                intermediate_size=32, max_position_embeddings=16)
MUSE_AUDIO = dict(patch_sizes=(2, 2), hidden_sizes=(16, 32), depths=(1, 1), num_hidden_layers=2, out_hidden_size=64)
SIGLIP = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
STEP_VIT = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14, max_position_embeddings=4)


def rope(partial=None, **extra):
    p = {"rope_type": "default", "rope_theta": 10000.0, **extra}
    if partial is not None:
        p["partial_rotary_factor"] = partial
    return p


MROPE = rope(mrope_section=[4, 2, 2], mrope_interleaved=True)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                    # the model_type of the SUPPORTED row
    config: dict                 # the config's arguments beyond COMMON (None values drop a COMMON key)
    n_fused: int = 2             # attention layers apply_to fuses
    n_calls: Optional[int] = None  # block calls in one forward, where not n_fused (a layer run more than once)
    bias: bool = True            # the config has attention_bias
    model: Optional[str] = None  # model class (default: AutoModelForCausalLM's)
    composite: Optional[tuple] = None   # (config class, its other sub-configs): the text config goes in text_config
    min_version: str = "5.17"  # the oldest transformers the family is tested on
    no_compile: Optional[str] = None  # why torch.compile is not tested (an HF limitation)
    # why the fused attention module compiles with graph breaks (in HF's own code that the fused forward calls), or
    # None: it compiles as one graph (fullgraph=True)
    graph_breaks: Optional[str] = None
    sdpa: bool = True  # whether HF's model takes attn_implementation="sdpa" (generate and compile use it)
    # why HF's own bf16 gradients of the block's parameters are too far from fp32's for the GPU three-way test to
    # judge the block on the tiny model (test_gpu_hf_families; the fp32 tests judge it), or None
    bf16_grad_noise: Optional[str] = None
    # inputs HF's model requires in training beyond input_ids (Molmo2's mm_token_type_ids): zeros like input_ids
    # (text tokens)
    train_inputs: tuple = ()
    # where a composite config takes the text settings, where not in text_config (an encoder-decoder: T5Gemma 2's
    # "encoder.text_config" and "decoder")
    text_in: tuple = ("text_config",)
    # a model without an LM head (EmbeddingGemma 2, an encoder; Qwen3-Omni's code predictor): no generate(); the tests
    # read last_hidden_state, train on a fixed regression target and pad the batch (an encoder's mask then matters)
    base_model: bool = False
    # the model takes inputs_embeds only (Qwen3-Omni's code predictor): a fixed random embedding of the ids
    inputs_embeds: bool = False

    @property
    def fast_attn(self) -> str:
        return "sdpa" if self.sdpa else "eager"

    def inputs(self, ids, dtype=torch.float32) -> dict:
        """The keyword inputs of a training forward on ``ids`` (with labels; an encoder's: a padded batch); ``dtype``:
        the model's, for inputs_embeds."""
        if self.base_model:
            if self.inputs_embeds:
                table = torch.randn(VOCAB, COMMON["hidden_size"], generator=torch.Generator().manual_seed(13))
                return dict(inputs_embeds=table.to(ids.device, dtype)[ids], attention_mask=padding_mask(ids))
            return dict(input_ids=ids, attention_mask=padding_mask(ids))
        return dict(input_ids=ids, labels=ids, **{name: torch.zeros_like(ids) for name in self.train_inputs})

    def outputs(self, out) -> torch.Tensor:
        """What the model computes per token: the logits, or an encoder's last hidden state."""
        return out.last_hidden_state if self.base_model else out.logits

    def loss(self, out) -> torch.Tensor:
        """The training loss of ``out``: the LM loss, or an encoder's mean squared error against a fixed target
        (as an embedding distillation trains)."""
        if not self.base_model:
            return out.loss
        h = out.last_hidden_state
        target = torch.randn(h.shape, generator=torch.Generator().manual_seed(11)).to(h.device, h.dtype)
        return (h - target).square().mean()


def padding_mask(ids) -> torch.Tensor:
    """An attention mask that pads the last row's final third (right padding, as tokenizers of encoders pad)."""
    mask = torch.ones_like(ids)
    mask[-1, ids.shape[1] - ids.shape[1] // 3:] = 0
    return mask


FAMILIES = [
    # Qwen3's recipe
    Family("qwen3", dict(sliding_window=5, use_sliding_window=True,
                         layer_types=["sliding_attention", "full_attention"]), min_version="5.0"),
    Family("qwen3_moe", dict(MOE, head_dim=None), min_version="5.0"),
    Family("dots1", dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, num_experts=None,
                         moe_intermediate_size=32, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"]), min_version="5.0"),
    Family("mellum", dict(MOE, sliding_window=5, layer_types=["sliding_attention", "full_attention"])),
    Family("apertus", dict(), min_version="5.0"),
    Family("apertus1p5_text", dict(), min_version="5.25"),
    Family("lfm3", dict(norm_eps=1e-5, num_hidden_layers=3, sliding_window=5, use_attention_gate=True,
                        layer_types=["sliding_attention", "conv", "full_attention"]), min_version="5.25"),
    Family("hy_v3", dict(MOE, num_shared_experts=1, mlp_layer_types=["dense", "sparse"])),
    Family("lfm2", dict(norm_eps=1e-5, head_dim=None, layer_types=["full_attention", "full_attention"]), bias=False, min_version="5.0"),
    Family("lfm2_moe", dict(MOE, norm_eps=1e-5, head_dim=None, num_dense_layers=1,
                            layer_types=["full_attention", "full_attention"]), bias=False, min_version="5.0"),
    Family("exaone4", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]), bias=False, min_version="5.0"),
    Family("exaone_moe", dict(MOE, num_shared_experts=1, first_k_dense_replace=1, sliding_window=5,
                              layer_types=["sliding_attention", "full_attention"]), bias=False),
    Family("kolibri1", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]), bias=False,
           min_version="5.24", bf16_grad_noise="HF's bf16 model alone is 0.11-0.35 off fp32 in every q/k/v and norm "
                                               "gradient on this tiny model (seeds 0-2, CPU; session 29)"),
    Family("beam", dict(MOE, sliding_window=5, layer_types=["sliding_attention", "full_attention"]), min_version="5.25"),
    # one weightless q/k norm module, q scaled after it, o_norm and a sigmoid gate after attention; NoPE on full layers
    Family("muse_spark_text", dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   moe_hidden_size=32, sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"]),
           composite=("MuseSparkConfig", dict(vision_config=MUSE_VIT, audio_config=MUSE_AUDIO, out_hidden_size=32,
                                               projector_hidden_size=32)),
           model="MuseSparkForConditionalGeneration", min_version="5.25"),
    # MuseSpark's attention without o_norm (a sigmoid gate_proj gate per channel)
    Family("muse_glimmer_text", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
           composite=("MuseGlimmerConfig", dict(vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4,
                                                                  num_attention_heads=2, num_hidden_layers=1,
                                                                  hidden_size=32, intermediate_size=32,
                                                                  max_position_embeddings=16),
                                                out_hidden_size=32, projector_hidden_size=32)),
           model="MuseGlimmerForConditionalGeneration"),
    Family("flint", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]), min_version="5.25",
           sdpa=False),  # (its attention sinks: HF's eager attention only)
    Family("lara_mini", dict(**MOE, **HYBRID, num_hidden_layers=3, shared_expert_intermediate_size=32, sliding_window=5,
                             layer_types=["sliding_attention", "linear_attention", "full_attention"]),
           min_version="5.25"),
    Family("doge", dict(head_dim=None, keep_window_size=6),
           no_compile="HF's DogeAttention itself fails in torch.compile's AOT backward (a view of its dynamic mask's "
                      "gradient), fused or not", min_version="5.0"),
    Family("hunyuan_v1_moe", dict(num_experts=2, moe_topk=1), min_version="5.0"),
    # HF's own joined qkv_proj (its rows module keeps the name; the fused parameter is qkv_fused), q/k scaled by
    # sqrt(global_attention_scale) on the global layers, which are NoPE
    Family("ergo", dict(head_dim=None, intermediate_size=None, num_experts=4, num_experts_per_tok=1,
                        moe_intermediate_size=32, first_dense_intermediate_size=48, shared_intermediate_size=32,
                        sliding_window=5, global_attention_every_n_layers=2, global_attention_scale=2.5),
           bias=False, min_version="5.25"),
    # nGPT: L2 norms of q and k (the block's RMSNorm at eps / head_dim, weight head_dim^-1/2), q scaled per channel after
    # RoPE, a scaled gate and an L2 sub-norm after attention; its middle layer runs twice a step (a cache of its own
    # per loop)
    Family("dory", dict(n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                        num_hidden_layers=3, sliding_window=5,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
           n_fused=3, n_calls=4, min_version="5.25"),
    # RoPE on the sliding layers; the indexed-attention ones NoPE, their indexer narrowing the mask (a pool of 8 keys,
    # top 4, at 12 tokens: the selection bites), k/v rounded to NVFP4; the third layer reads the second's k/v (q only:
    # stays HF's)
    Family("kolibri1_1", dict(MOE, shared_expert_intermediate_size=32, num_hidden_layers=3, sliding_window=5,
                              layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
                              index_layers=[1], kv_source_layers=[0, 1, 1], index_topk=4, index_pool_size=8,
                              index_compression=2, index_num_heads=2, index_num_local_tokens=2, index_num_sink_tokens=1,
                              mlp_only_layers=[0], mlp_only_intermediate_size=48),
           bias=False, min_version="5.25",
           graph_breaks="HF's own indexer, which the indexed layers call: query groups from .unique().tolist() per batch "
                        "row (data-dependent)",
           bf16_grad_noise="HF's bf16 model alone is more than 10 % off fp32 in every q/k/v and norm gradient on this "
                           "tiny model (GPU, session 32: the indexed layer's NVFP4 rounding of k and v and its top-4 "
                           "selection move with bf16 inputs)"),
    Family("glm4_moe", dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, num_experts=None,
                            use_qk_norm=True, rope_parameters=rope(0.5)), min_version="5.0"),
    # RoPE on the sliding layers only; a sigmoid gate per channel from gate_proj
    Family("afmoe", dict(MOE, num_shared_experts=1, num_dense_layers=1, sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"])),
    Family("laguna", dict(MOE, shared_expert_intermediate_size=32, sliding_window=5, gating="per-head",
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={t: rope(0.5) for t in ("sliding_attention", "full_attention")})),
    # mRoPE (sections merged into per-token cos/sin by the rotary embedding)
    Family("qwen3_vl_text", dict(rope_parameters=MROPE), composite=("Qwen3VLConfig", dict(vision_config=QWEN_VIT)),
           model="Qwen3VLForConditionalGeneration", min_version="5.0"),
    Family("qwen3_vl_moe_text", dict(**MOE, rope_parameters=MROPE),
           composite=("Qwen3VLMoeConfig", dict(vision_config=QWEN_VIT)), model="Qwen3VLMoeForConditionalGeneration", min_version="5.0"),
    Family("qwen3_omni_moe_text", dict(**MOE, rope_parameters=MROPE),
           composite=("Qwen3OmniMoeThinkerConfig", dict(vision_config=QWEN_VIT, audio_config=OMNI_AUDIO,
                                                        vision_start_token_id=90)),
           model="Qwen3OmniMoeThinkerForConditionalGeneration", min_version="5.0"),
    # Qwen3-Omni's talker code predictor (Qwen3's attention), its base model: it takes inputs_embeds only, and HF's
    # model has no sliding layers' mask
    Family("qwen3_omni_moe_talker_code_predictor", dict(), model="Qwen3OmniMoeTalkerCodePredictorModel",
           base_model=True, inputs_embeds=True),
    # RMSNorm after RoPE
    Family("hunyuan_v1_dense", dict(), min_version="5.0"),
    Family("hunyuan_vl_text", dict(rope_parameters=rope(mrope_section=[4, 2, 2])),
           composite=("HunYuanVLConfig", dict(vision_config=HUNYUAN_VIT)), model="HunYuanVLForConditionalGeneration"),
    Family("nanochat", dict(), min_version="5.0"),
    Family("llama4_text", dict(MOE, num_local_experts=2, num_experts_per_tok=1, num_experts=None,
                               moe_intermediate_size=None, intermediate_size_mlp=96, no_rope_layers=[1, 0],
                               attention_chunk_size=64, attn_temperature_tuning=True, rope_parameters=rope()),
           n_fused=1, min_version="5.0"),
    # 1 + w
    Family("gemma3_text", dict(query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=20.0,
                               final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"]), min_version="5.0"),
    # ... partial RoPE; a sparse layer whose indexer picks 2 of the 3 key blocks of 4 at 12 tokens (the pick bites)
    Family("minimax_m3_vl_text", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                      dense_intermediate_size=48, shared_intermediate_size=32, rotary_dim=8,
                                      mlp_layer_types=["dense", "sparse"],
                                      layer_types=["minimax_m3_sparse", "full_attention"], index_n_heads=2,
                                      index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1),
           bias=False),
    # ... and an output gate from g_proj
    Family("step3p5", dict(MOE, num_experts=None, num_local_experts=4, n_routed_experts=4, share_expert_dim=32,
                           sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"]),
           composite=("Step3p7Config", dict(vision_config=STEP_VIT)), model="Step3p7ForConditionalGeneration"),
    # gated q
    Family("qwen3_next", dict(**MOE, **HYBRID, head_dim=32, shared_expert_intermediate_size=32,
                              layer_types=["linear_attention", "full_attention"], rope_parameters=rope(0.25)),
           n_fused=1, min_version="5.0"),
    Family("qwen3_5_text", dict(**HYBRID, head_dim=32, layer_types=["linear_attention", "full_attention"],
                                rope_parameters=rope(0.25, mrope_section=[2, 1, 1], mrope_interleaved=True)),
           n_fused=1),
    Family("qwen3_5_moe_text", dict(**MOE, **HYBRID, head_dim=32, shared_expert_intermediate_size=32,
                                    layer_types=["linear_attention", "full_attention"],
                                    rope_parameters=rope(0.25, mrope_section=[2, 1, 1], mrope_interleaved=True)),
           n_fused=1),
    # v norm; the last layer shares the KV of an earlier one and stays HF's
    Family("gemma3n_text", dict(num_hidden_layers=3, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                                laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=1, sliding_window=5,
                                layer_types=["sliding_attention", "full_attention", "full_attention"],
                                activation_sparsity_pattern=[0.0, 0.0, 0.0])),
    # ... and head_dim 16 / 512 on sliding / full layers (512: the released models' global layers, with their
    # proportional RoPE rotating a quarter of it), whose v is the k projection (attention_k_eq_v)
    Family("gemma4_text", dict(num_hidden_layers=3, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                               num_kv_shared_layers=1, sliding_window=5, global_head_dim=512, attention_k_eq_v=True,
                               num_global_key_value_heads=1,
                               layer_types=["sliding_attention", "full_attention", "full_attention"])),
    # Gemma 4's attention in its unified (text, vision, audio) release: the same recipe as gemma4_text
    Family("gemma4_unified_text", dict(num_hidden_layers=3, vocab_size_per_layer_input=VOCAB,
                                       hidden_size_per_layer_input=8, num_kv_shared_layers=1, sliding_window=5,
                                       global_head_dim=512, attention_k_eq_v=True, num_global_key_value_heads=1,
                                       layer_types=["sliding_attention", "full_attention", "full_attention"])),
    # an encoder-decoder (1 + w): the encoder's self-attention, the decoder's merged self- and cross-attention (its
    # k_proj / v_proj also project the encoder's states); one model for both rows
    *[Family(name, dict(query_pre_attn_scalar=16, sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
             n_fused=4, composite=("T5Gemma2Config", dict(encoder=dict(vision_config=SIGLIP))),
             text_in=("encoder.text_config", "decoder"),
             model="T5Gemma2ForConditionalGeneration") for name in ("t5gemma2_text", "t5gemma2_decoder")],
    # an encoder (bidirectional, no KV cache): Gemma 4's attention per layer (head_dim 16 / 512, the v norm)
    Family("embedding_gemma2_text", dict(num_hidden_layers=3, hidden_size_per_layer_input=8, embedding_dim=32,
                                         global_head_dim=512, num_global_key_value_heads=1,
                                         sliding_window=3, layer_types=["sliding_attention", "sliding_attention",
                                                                        "full_attention"]),
           n_fused=3, model="EmbeddingGemma2TextModel", min_version="5.25", base_model=True,
           bf16_grad_noise="HF's bf16 model alone is 0.09-0.55 off fp32 in every q/k/v and norm gradient of this tiny "
                           "encoder on the GPU (seeds 0-2, H100; fusedqkv's within 0.03 of HF's in each; session 45)"),
    Family("qwen4_exp_text", dict(**MOE, **HYBRID, head_dim=32, shared_expert_intermediate_size=32, hc_count=2,
                                  hc_lowrank=8, layer_types=["linear_attention", "qwen_sparse_attention"],
                                  indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                                  indexer_compress_ratio=2, rope_parameters=rope(0.25, mrope_section=[1, 1, 0])),
           n_fused=1, graph_breaks="HF's sparse-attention indexer (the row's prologue calls it) selects tokens with "
                                   "torch.nonzero per query: data-dependent shapes"),
    # norm over all heads
    Family("olmo2", dict(head_dim=None), min_version="5.0"),
    Family("olmo3", dict(head_dim=None, sliding_window=5, layer_types=["sliding_attention", "full_attention"]), min_version="5.0"),
    Family("olmoe", dict(MOE, head_dim=None, moe_intermediate_size=None), min_version="5.0"),
    Family("flex_olmo", dict(MOE, head_dim=None, moe_intermediate_size=None), min_version="5.0"),
    Family("minimax_m2", dict(MOE, num_local_experts=4, num_experts=None, rope_parameters=rope(0.5)),
           bias=False, min_version="5.0"),
    # the per-head norm (qk_norm_type "qwen3"); the "olmo" type (over all heads) in test_hf_families
    Family("molmo2_text", dict(additional_vocab_size=8),
           composite=("Molmo2Config", dict(vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                              num_attention_heads=2, num_key_value_heads=2,
                                                              head_dim=16, image_size=[28, 28], patch_size=14),
                                           adapter_config=dict(hidden_size=32, num_attention_heads=2,
                                                               num_key_value_heads=2, head_dim=16,
                                                               intermediate_size=32, text_hidden_size=64,
                                                               vision_feature_layer=[-1]))),
           model="Molmo2ForConditionalGeneration", bias=True, min_version="5.25", train_inputs=("mm_token_type_ids",)),
    Family("olmo_hybrid", dict(**HYBRID, head_dim=None, layer_types=["linear_attention", "full_attention"]),
           n_fused=1),
]


def config(fam: Family, bias=False, **over):
    import transformers as tf

    kw = dict(COMMON)
    kw.update(fam.config)
    kw.update(over)
    kw = {k: v for k, v in kw.items() if v is not None}
    if fam.bias:
        kw["attention_bias"] = bias
    if fam.composite is not None:
        cls, others = fam.composite
        kw.pop("tie_word_embeddings")
        nested = copy.deepcopy(others)
        for path in fam.text_in:
            *outer, last = path.split(".")
            d = nested
            for key in outer:
                d = d.setdefault(key, {})
            d[last] = dict(kw)
        cfg = getattr(tf, cls)(**nested)
    else:
        cfg = tf.AutoConfig.for_model(fam.name, **kw)
    return cfg


def model_class(fam: Family):
    import transformers as tf

    if fam.model is not None:
        return getattr(tf, fam.model)
    return tf.AutoModelForCausalLM._model_mapping[type(config(fam))]


def build(fam: Family, bias=False, seed=0, attn="eager", dtype=torch.float32, **over):
    """A tiny model; every norm weight and bias is randomised (HF inits norms to 1 or 0, which
    would hide a wrong weight form)."""
    cfg = config(fam, bias, **over)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    m = model_class(fam)(cfg)
    perturb_norms_and_biases(m, seed + 1)
    return m.to(dtype).eval()



# --------------------------------------------------------------------------- shared by the tests


def version(v):
    return tuple(int(x) for x in v.split(".")[:2])


def _tf_version():
    try:
        import transformers
    except ImportError:
        return (0, 0)
    return version(transformers.__version__)


TF_VERSION = _tf_version()


def params():
    """pytest parameters, one per family; those newer than the installed transformers skip."""
    import pytest

    out = []
    for fam in FAMILIES:
        marks = []
        if TF_VERSION < version(fam.min_version):
            marks.append(pytest.mark.skip(reason=f"{fam.name} needs transformers >= {fam.min_version}"))
        out.append(pytest.param(fam, id=fam.name, marks=marks))
    return out


# the fields of a SUPPORTED row that name things (the module, classes, attributes): two families
# whose rows differ only there run the fused attention's same code
_NAMING = ("model_type", "modeling", "attention", "norm_class", "q_norm", "k_norm", "out_proj")


def _partial_rotary(fam: Family) -> bool:
    rp = fam.config.get("rope_parameters") or {}
    per_type = [v for v in rp.values() if isinstance(v, dict)]  # per layer type (Laguna)
    return any("partial_rotary_factor" in p for p in [rp, *per_type])


def recipe(fam: Family) -> tuple:
    """What the fused attention of the family runs: its SUPPORTED row less the names (the hooks by
    identity; v_norm and k_eq_v as present or not), and the tiny config's switches of the block
    (q/k/v biases, partial rotary). Families of one recipe trace the same fused forward."""
    import dataclasses

    from fusedqkv.integrations import transformers as fqt

    row = next(a for a in fqt.SUPPORTED if a.model_type == fam.name)
    key = tuple((f.name, getattr(row, f.name) is not None if f.name in ("v_norm", "k_eq_v") else getattr(row, f.name))
                for f in dataclasses.fields(row) if f.name not in _NAMING)
    return key + (("bias", fam.bias), ("partial_rotary", _partial_rotary(fam)))


def recipe_params():
    """pytest parameters, one family per recipe: the first of its recipe that the installed
    transformers has (else the first, which skips)."""
    groups: dict = {}
    for p in params():
        groups.setdefault(recipe(p.values[0]), []).append(p)
    return [next((p for p in ps if not p.marks), ps[0]) for ps in groups.values()]


def family(name):
    """the family of that name; the test skips when the installed transformers is older"""
    import pytest

    fam = next(f for f in FAMILIES if f.name == name)
    if TF_VERSION < version(fam.min_version):
        pytest.skip(f"{name} needs transformers >= {fam.min_version}")
    return fam


def fused_modules(m):
    return [mod for mod in m.modules() if hasattr(mod, "_fusedqkv")]


def patched_pair(fam, bias=False, device="cpu", **kw):
    """(patched, unpatched deep copy) of a tiny model of the family."""
    import fusedqkv

    ref = build(fam, bias, **kw).to(device)
    m = copy.deepcopy(ref)
    assert fusedqkv.apply_to(m) == fam.n_fused
    assert len(fused_modules(m)) == fam.n_fused
    return m, ref


def _fused_param(m, name):
    """``(attention path, spec, kind)`` where ``name`` is a fused projection's parameter of the patched
    model ``m`` (``<attention>.qkv_proj.weight``; ``qkv_fused`` where HF's attention has its own
    ``qkv_proj``), else None."""
    path, _, kind = name.rpartition(".")
    base, _, child = path.rpartition(".")
    try:
        attn = m.get_submodule(base)
    except AttributeError:
        return None
    spec = getattr(attn, "_fusedqkv", None)
    if spec is None or child != spec.fused_name:
        return None
    return base, spec, kind


def hf_grad(m, name, params):
    """The gradient in ``params`` (another model's ``dict(named_parameters())``, HF's layout) of
    the patched model ``m``'s parameter ``name``: a fused weight's (or bias's) is HF's
    projections' gradients concatenated in the block's order."""
    fused = _fused_param(m, name)
    if fused is None:
        return params[name].grad
    base, spec, kind = fused
    return torch.cat([params[f"{base}.{proj}.{kind}"].grad for proj in spec.projs])


def check_grads(m, ref, tol, atol=1e-8):
    """every gradient of the patched model against the unpatched one; the fused weight's (and
    bias's) against the concatenation of HF's projection gradients."""
    got = dict(m.named_parameters())
    want = dict(ref.named_parameters())
    joined = 0
    for name, p in got.items():
        fused = _fused_param(m, name)
        if fused is not None:
            joined += len(fused[1].projs) - 1
        g = hf_grad(m, name, want)
        if g is None:  # a parameter that the loss does not reach (both models alike)
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        # atol: a router's gradient may be rounding noise (1e-12) in both models
        err = float((p.grad - g).abs().max())
        assert err <= tol * float(g.abs().max()) + atol, (name, err, float(g.abs().max()))
    assert len(want) - len(got) == joined  # HF's projections became one parameter (weight, bias) per layer
