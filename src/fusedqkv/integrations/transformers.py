"""``fusedqkv.apply_to(model)``: the fused attention input block in a built Hugging Face model.

For every supported attention module of the model it

* joins ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (a
  :class:`~fusedqkv.integrations.fused_projection.FusedQKVProjection`, no ``nn.Linear``, whose
  weight rows are ``[Q | K | V]`` -- ``[Q | K]`` where v is k, Gemma 4 -- with the biases where the
  config has them), in ``q_proj``'s place, q/k/v_proj left as views of its rows (where HF's
  attention has one joined ``qkv_proj`` Linear already, Ergo, its parameters become
  ``qkv_fused``'s and ``qkv_proj`` stays as the view of all its rows);
  bitsandbytes 4-bit q/k/v stay as they are instead (dequantized per call into that layout:
  :mod:`fusedqkv.integrations.qlora`);
* swaps the module's class for a subclass whose ``forward`` computes q, k, v (and the output
  gate of gated-query families) with :func:`fusedqkv.gqa_qkv_rope_qk_norm` (projection + RoPE +
  RMSNorm, one GEMM and one fused kernel forward, the fused backward) and hands them to the
  model's own KV cache and attention backend (eager/sdpa/flash...) exactly as the original
  forward does;
* registers state-dict hooks so that ``state_dict()`` holds HF's ``q_proj``/``k_proj``/
  ``v_proj`` keys and values (and ``load_state_dict`` of an HF state dict merges them), so
  ``save_pretrained`` writes an ordinary HF checkpoint.

The attention module itself, its output projection and norm modules (whose weights the fused
block reads; Liger-Kernel may patch their forward) stay the objects the model references.

``SUPPORTED`` is the one table of what each HF family's attention computes, as the block's
switches (norm position and scope, weight form, gated query, RoPE style, v norm) plus the few
places where a family's forward differs from the common one (how it passes the sliding window,
NoPE layers, q/k scales after the block, an output gate from another projection, a dynamic mask,
shared KV, its own cache update, an indexer before attention, HF's own joined q/k/v Linear).
Adding a family whose forward follows the common pattern is one row. Anything else raises
:class:`UnsupportedModelError` naming the family and the reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

from ..autograd import gqa_qkv_rope_qk_norm
from ..ops.fp8 import (check_supported as fp8_check_supported, recipe as fp8_recipe, recipe_of_torchao_config,
                       recipe_of_torchao_mx_config)
from .fused_projection import (TORCHAO_QUANTIZED, FusedQKVProjection, ProjectionRows, UnsupportedModuleError,
                               _describe, _hint, _hooks, _is_float8_linear, _is_torchao_mx, _peft_names_hooks,
                               fused_weights, mx_plain, torchao_mx_config, unwrap_lora)
from .projection_plan import projection_plan
from . import qlora
from ..ops.validation import ALL_HEADS_MAX_HEAD_DIM as _ALL_HEADS_MAX_HEAD_DIM, MAX_HEAD_DIM as _MAX_HEAD_DIM

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TF = "transformers.models."


# defined without transformers, so that ``from fusedqkv import UnsupportedModelError`` needs none
from ..errors import UnsupportedModelError  # noqa: E402,F401


# --------------------------------------------------------------------------- per-family hooks
# Small functions a row names where its family's forward differs from the common one. Each
# mirrors the lines of the HF forward it replaces.


def _rope_hf(attn, hidden_states, position_embeddings):
    return position_embeddings


def _identity_rope(hidden_states):
    # NoPE through the block: a rotary part of 2 dims with cos 1, sin 0 rotates nothing
    # (x*1 + r*0 == x exactly); the rest of each head passes through
    s = hidden_states.shape[1]
    return hidden_states.new_ones(1, s, 2), hidden_states.new_zeros(1, s, 2)


def _rope_nope_on_global_layers(attn, hidden_states, position_embeddings):
    # EXAONE 4 / EXAONE-MoE / Kolibri: "global NoPE" on the full-attention layers of hybrid models
    if attn.sliding_window is None or attn.is_sliding:
        return position_embeddings
    return _identity_rope(hidden_states)


def _rope_only_on_sliding_layers(attn, hidden_states, position_embeddings):
    # Flint: RoPE on the sliding-window layers only; the full-attention layers get (and ignore) it: NoPE
    if attn.sliding_window is not None:
        return position_embeddings
    return _identity_rope(hidden_states)


def _rope_if_local_attention(attn, hidden_states, position_embeddings):
    # AFMoE: RoPE on the sliding-window (local) layers only; the global ones NoPE
    if attn.is_local_attention:
        return position_embeddings
    return _identity_rope(hidden_states)


def _rope_if_sliding(attn, hidden_states, position_embeddings):
    # Kolibri 1.1: RoPE on the sliding layers; the indexed-attention ones are NoPE
    if attn.is_sliding:
        return position_embeddings
    return _identity_rope(hidden_states)


def _rope_nope_if_none(attn, hidden_states, position_embeddings):
    # OLMo-Hybrid: no position embeddings -> NoPE
    if position_embeddings is None:
        return _identity_rope(hidden_states)
    return position_embeddings


def _rope_negated_sin(attn, hidden_states, position_embeddings):
    # NanoChat's rotate_half is cat(x2, -x1) = -(HF's): the same rotation with sin negated
    cos, sin = position_embeddings
    return cos, -sin


def _rope_complex_interleaved(attn, hidden_states, position_embeddings):
    # Llama 4: freqs_cis [B, S, D/2] complex, pairs (2i, 2i+1) -> per-element cos/sin [B, S, D]
    f = position_embeddings.to(hidden_states.device)
    dt = hidden_states.dtype
    return f.real.repeat_interleave(2, -1).to(dt), f.imag.repeat_interleave(2, -1).to(dt)


def _sw_attr(attn):
    return attn.sliding_window


def _sw_if_sliding(attn):
    return attn.sliding_window if attn.is_sliding else None


def _sw_config(attn):
    return getattr(attn.config, "sliding_window", None)


def _norm_scope_molmo2(attn):
    # Molmo2: qk_norm_type "olmo" norms the whole projection (all heads), "qwen3" each head
    return "all_heads" if attn.qk_norm_type == "olmo" else "head"


def _norm_scope(arch, attn) -> str:
    scope = arch.norm_scope
    return scope(attn) if callable(scope) else scope


def _gate_softplus_g_proj(attn, attn_output, hidden_states):
    # Laguna: softplus(g_proj(x)) per head or per channel
    gate = F.softplus(attn.g_proj(hidden_states).float()).to(attn_output.dtype)
    if attn.gate_per_head:
        shape = hidden_states.shape[:-1]
        return (attn_output.view(*shape, -1, attn.head_dim) * gate.unsqueeze(-1)).view(*shape, -1)
    return attn_output * gate


def _gate_sigmoid_g_proj_per_head(attn, attn_output, hidden_states):
    # Step 3.7 and LFM3: sigmoid(g_proj(x)) per head (LFM3 without use_attention_gate has no g_proj: no gate)
    if attn.g_proj is None:
        return attn_output
    shape = attn_output.shape
    out = attn_output.view(*shape[:-1], -1, attn.head_dim) * torch.sigmoid(attn.g_proj(hidden_states)).unsqueeze(-1)
    return out.view(*shape)


def _gate_sigmoid_gate_proj(attn, attn_output, hidden_states):
    # AFMoE and MuseGlimmer: sigmoid(gate_proj(x)) per channel
    return attn_output * torch.sigmoid(attn.gate_proj(hidden_states))


def _gate_sigmoid_gate_proj_with_head_bias(attn, attn_output, hidden_states):
    # Beam: sigmoid(gate_proj(x) + a bias per head), per channel
    shape = attn_output.shape
    out = attn_output.view(*shape[:-1], -1, attn.head_dim)
    gate = attn.gate_proj(hidden_states).view_as(out) + attn.gate_bias[None, None, :, None]
    return (out * torch.sigmoid(gate)).view(shape)


def _qk_scale_beam(attn, query, key, kwargs):
    # Beam: the NoPE layers' position-dependent query scale (the decoder's attention_scaling), in fp32 after the
    # block as HF applies it after RoPE; None on the RoPE layers
    scaling = kwargs.pop("attention_scaling", None)
    if scaling is None:
        return query, key
    return (query.float() * scaling).to(query.dtype), key


def _qk_scale_muse_spark(attn, query, key, kwargs):
    # MuseSpark and MuseGlimmer: q times qk_scale_factor after its weightless norm; HF scales before RoPE, a linear
    # map: the same
    return query * attn.qk_scale_factor, key


def _qk_scale_ergo(attn, query, key, kwargs):
    # Ergo: q and k times sqrt(global_attention_scale) on the global layers, after RoPE, the scale rounded to their
    # dtype first (HF's order and rounding: the block's outputs are HF's q and k there)
    if attn.qk_scale is None:
        return query, key
    scale = attn.qk_scale.to(query.dtype)
    return query * scale, key * scale


def _gate_o_norm_sigmoid_gate_proj(attn, attn_output, hidden_states):
    # MuseSpark: its weightless RMSNorm of each head's output (HF's module), then sigmoid(gate_proj(x)) per channel
    shape = attn_output.shape
    out = attn.o_norm(attn_output.view(*shape[:-1], -1, attn.head_dim)).reshape(shape)
    return out * torch.sigmoid(attn.gate_proj(hidden_states))


def _qk_scale_dory(attn, query, key, kwargs):
    # Dory (nGPT): q times (sqk * sqk_scale)^2 per channel after RoPE, as HF scales it
    return query * (attn.sqk * attn.sqk_scale).view(-1, 1, attn.head_dim).square(), key


def _gate_dory(attn, attn_output, hidden_states):
    # Dory: sigmoid(gate_proj(x) * (s_gate * s_gate_scale)^2) per channel, then its L2 sub-norm (HF's module)
    gate = torch.sigmoid(attn.gate_proj(hidden_states) * (attn.s_gate * attn.s_gate_scale).square())
    return attn.attn_sub_norm(attn_output * gate)


def _kv_update_dory(attn, cache, key, value, kwargs):
    # Dory: its recurrent loops write their own copies of a layer's cache, cache_offset layers on (HF passes no kwargs)
    offset = kwargs.pop("cache_offset", 0)
    if cache is None:
        return key, value
    return cache.update(key, value, attn.layer_idx + offset)


def _kv_update_layer_idx(attn, cache, key, value, kwargs):
    # Kolibri 1.1: cache.update(k, v, layer_idx), no kwargs
    if cache is None:
        return key, value
    return cache.update(key, value, attn.layer_idx)


def _indexer_kolibri1_1(attn, hidden_states, position_embeddings, cache, query, key, value, attention_mask, kwargs):
    # Kolibri 1.1's indexed-attention layers: the indexer narrows the mask from q and the cached k (after the KV
    # store), then k and v are rounded to NVFP4 with a straight-through gradient; every layer returns its index pool
    # (HF's lines, HF's functions)
    index_pool = kwargs.pop("index_pool", None)
    if attn.indexer is None:
        return key, value, attention_mask, (index_pool,)
    if attention_mask is None:
        raise ValueError("Sparse attention layers need an explicit 4D attention mask to overlay their selection.")
    selected, index_pool = attn.indexer(query, key, attention_mask, index_pool)
    if attention_mask.dtype == torch.bool:
        attention_mask = selected
    else:
        attention_mask = attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)
    quantize = attn._fusedqkv_modeling.nvfp4_fake_quantize
    key = key + (quantize(key) - key).detach()
    value = value + (quantize(value) - value).detach()
    return key, value, attention_mask, (index_pool,)


def _indexer_minimax_m3(attn, hidden_states, position_embeddings, cache, query, key, value, attention_mask, kwargs):
    # MiniMax M3's sparse layers: the indexer picks key blocks after the KV store (its index keys go to the cache
    # too); eager and SDPA take the pick as a block mask, every backend as block_indices (HF's lines)
    block_indices = None
    if attn.indexer is not None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)
        position_ids = (position_ids if position_ids.ndim > 1 else position_ids.unsqueeze(0)).expand(query.shape[0],
                                                                                                    -1)
        block_indices = attn.indexer(hidden_states, position_embeddings, cache, position_ids)
        if attn.config._attn_implementation in ("eager", "sdpa"):
            attention_mask = attn.indexer.build_block_mask(block_indices, attention_mask, key.shape[2], query.dtype,
                                                           query.device, position_ids)
    kwargs["block_indices"] = block_indices
    return key, value, attention_mask, ()


def _kv_update_self_attention_cache(attn, cache, key, value, kwargs):
    # T5Gemma 2's decoder: the self-attention half of an EncoderDecoderCache
    if cache is None:
        return key, value
    return cache.self_attention_cache.update(key, value, attn.layer_idx)


def _cross_attention_t5gemma2(attn, hidden_states, position_embeddings, cache, query, key, value, attention_mask,
                              kwargs):
    """T5Gemma 2's merged attention: the encoder's states through the same k_proj / v_proj (their keys normed, not
    rotated; once per generation in the cross half of the cache) after the decoder's own keys and values."""
    enc = kwargs.pop("encoder_hidden_states")
    if cache is not None:
        is_updated = cache.is_updated.get(attn.layer_idx)
        cross_cache = cache.cross_attention_cache
    if cache is None or not is_updated:
        # the rows modules called directly (the fused parameter's rows; a PEFT adapter on them applies as in HF)
        shape = (*enc.shape[:-1], -1, attn.head_dim)
        cross_key = attn.k_norm(attn.k_proj(enc).view(shape).transpose(1, 2))
        cross_value = attn.v_proj(enc).view(shape).transpose(1, 2)
        if cache is not None:
            cross_key, cross_value = cross_cache.update(cross_key, cross_value, attn.layer_idx)
            cache.is_updated[attn.layer_idx] = True
    else:
        cross_key = cross_cache.layers[attn.layer_idx].keys
        cross_value = cross_cache.layers[attn.layer_idx].values
    key = torch.cat([key, cross_key], dim=2)
    value = torch.cat([value, cross_value], dim=2)
    return key, value, attention_mask, (enc.shape[1],)


_NO_FP8_T5GEMMA2 = ("the cross-attention's keys and values of the encoder states go through k_proj / v_proj outside "
                    "the fused block, which has no FP8 path for them (they would run in 16 bits, or torchao's layers "
                    "over the rows would train their own copies)")


def _split_weights_t5gemma2(attn_weights, extra):
    # (self-attention weights, cross-attention weights), as HF's merged attention returns them
    if attn_weights is None:
        return None, None
    (cross,) = extra
    return attn_weights[..., :-cross], attn_weights[..., -cross:]


def _mask_doge_dynamic(attn, hidden_states, value_states, attention_mask):
    # Doge: the dynamic mask from the (cached) values, as DogeAttention.forward builds it
    dt_states = attn.dt_proj(value_states.transpose(1, 2).reshape(value_states.shape[0], value_states.shape[-2], -1))
    dt_states = torch.exp(attn.A * F.softplus(dt_states)).transpose(-1, -2)
    mask = attn.prepare_dynamic_mask(hidden_states=hidden_states, dt_states=dt_states,
                                     keep_window_size=attn.keep_window_size, attention_mask=attention_mask)
    return attn._fusedqkv_modeling.repeat_kv(mask, attn.num_key_value_groups)


def _prologue_qwen4_exp(attn, hidden_states, position_embeddings, attention_mask, cache):
    # Qwen4-Exp: the sparse-attention indexer narrows the mask; cos/sin cover the cached keys too
    selected = attn.indexer(hidden_states, position_embeddings, attention_mask, cache)
    if attention_mask.dtype == torch.bool:
        attention_mask = attention_mask & selected
    elif selected.dtype == torch.bool:  # transformers >= 5.2x: a boolean selection on the float mask
        attention_mask = attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)
    else:  # an additive selection mask
        attention_mask = attention_mask + selected
    n = hidden_states.shape[1]
    return tuple(x[:, -n:, :] for x in position_embeddings), attention_mask


def _shared_kv_key(attn):
    # Gemma 3n / 4 store a layer's full-length k/v for the KV-shared layers under its layer
    # index where those read it by kv_shared_layer_index (Gemma 3n before transformers 5.2x), else
    # under its layer type
    return attn.layer_idx if hasattr(attn, "kv_shared_layer_index") else attn.layer_type


def _shared_kv_layer_str(attn):
    # Kolibri 1.1: the full-length k/v stored under str(layer_idx)
    return str(attn.layer_idx)


def _skip_kv_shared(attn) -> Optional[str]:
    if getattr(attn, "is_kv_shared_layer", False):
        return "a KV-shared layer (it reuses an earlier layer's k/v and has no k_proj/v_proj)"
    return None


def _skip_llama4(attn) -> Optional[str]:
    if "qk_norm" not in attn._modules:
        return "no QK norm (a NoPE layer, or use_qk_norm=False)"
    return None


def _skip_glm4_moe(attn) -> Optional[str]:
    if not getattr(attn, "use_qk_norm", False):
        return "no QK norm (use_qk_norm=False)"
    return None


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Arch:
    """What one HF attention class computes, read from its source: the block's switches and
    the hooks where its forward differs from the common one."""

    model_type: str          # config.model_type of the (text) model
    modeling: str            # module of the attention class (under transformers.models.)
    attention: str           # attention class name
    norm_class: str          # the RMSNorm class of q and k (and v)
    norm_aliases: tuple = ()         # the same class's names in other transformers releases
    qk_norm_position: str = "before_rope"
    norm_weight_offset: float = 0.0  # the norm scales by offset + weight
    norm_weight: bool = True         # False: RMSNorm without a weight (Llama 4, NanoChat)
    l2_norm: bool = False            # x / sqrt(sum x^2 + eps), no weight (Dory): the block's RMSNorm at eps / head_dim
                                     # with a constant weight head_dim^-1/2 (L2_SCALE)
    norm_scope: Union[str, Callable] = "head"  # "all_heads": one RMS over all heads' channels (OLMo 2); or
                                               # (attn) -> either, where the config chooses (Molmo2)
    q_gate: bool = False             # q_proj gives [q | gate] per head (Qwen3-Next / Qwen3.5)
    rope_style: str = "neox"         # "interleaved": pairs (2i, 2i+1) (Llama 4)
    q_norm: str = "q_norm"           # attribute names of the norm modules
    k_norm: str = "k_norm"
    v_norm: Optional[str] = None     # an unweighted RMSNorm of v (Gemma 3n / 4)
    out_proj: str = "o_proj"
    k_eq_v: Optional[str] = None     # attribute that is True where v is the raw k_proj output (Gemma 4)
    rope: Callable = _rope_hf        # (attn, x, position_embeddings) -> (cos, sin)
    sliding_window: Optional[Callable] = None  # (attn) -> the backend's sliding_window; None: not passed
    prologue: Optional[Callable] = None        # (attn, x, pe, mask, cache) -> (pe, mask)
    dynamic_mask: Optional[Callable] = None    # (attn, x, v, mask) -> mask
    shared_kv: Optional[Callable] = None       # (attn) -> key of shared_kv_states it stores under
    output_gate: Optional[Callable] = None     # (attn, attn_output, x) -> gated output
    sinks: Optional[str] = None                # attribute of per-head attention sinks, passed on as s_aux
    qk_scale: Optional[Callable] = None        # (attn, q, k, kwargs) -> (q, k) scaled after the block (pops what it reads)
    joined: Optional[str] = None               # HF's own q/k/v Linear (rows [Q | K | V]; Ergo's qkv_proj): its rows
                                               # module spans all rows, the fused parameter is FUSED_NAME_OVER_JOINED
    consumes: tuple = ()                       # the HF forward's own parameters (beyond the common ones) hooks read
    skip: Optional[Callable] = None            # (attn) -> why this layer stays HF's, or None
    kv_update: Optional[Callable] = None       # (attn, cache or None, k, v, kwargs) -> (k, v): the family's own cache
                                               # update (pops what it reads), else the transformers release's
    before_attention: Optional[Callable] = None  # (attn, x, position_embeddings, cache, q, k, v, mask, kwargs) ->
                                                 # (k, v, mask, extra outputs): after the cache, before the attention
                                                 # function (pops what it reads)
    split_weights: Optional[Callable] = None     # (attention weights, extra outputs) -> the outputs after the
                                                 # attention output, where not (weights, *extra) (T5Gemma 2)
    no_fp8: Optional[str] = None                 # why the family takes no FP8 recipe (apply_to's fp8=, and one that
                                                 # reaches the block later through the projection plan)


def _row(model_type, module, attention, norm_class, **kw):
    return Arch(model_type, _TF + module, attention, norm_class, **kw)


_HUNYUAN = dict(qk_norm_position="after_rope", q_norm="query_layernorm", k_norm="key_layernorm")
_OLMO2 = dict(norm_scope="all_heads")
_QWEN3_NEXT = dict(norm_weight_offset=1.0, q_gate=True)
_GEMMA_N = dict(v_norm="v_norm", sliding_window=_sw_attr, shared_kv=_shared_kv_key, skip=_skip_kv_shared,
                consumes=("shared_kv_states",))

SUPPORTED = (
    # Qwen3's recipe (per-head RMSNorm before RoPE, weight w)
    _row("qwen3", "qwen3.modeling_qwen3", "Qwen3Attention", "Qwen3RMSNorm", sliding_window=_sw_attr),
    _row("qwen3_moe", "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention", "Qwen3MoeRMSNorm",
         sliding_window=_sw_attr),
    _row("qwen3_vl_text", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextAttention", "Qwen3VLTextRMSNorm"),
    _row("qwen3_vl_moe_text", "qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextAttention",
         "Qwen3VLMoeTextRMSNorm"),
    _row("qwen3_omni_moe_text", "qwen3_omni_moe.modeling_qwen3_omni_moe", "Qwen3OmniMoeThinkerTextAttention",
         "Qwen3OmniMoeThinkerTextRMSNorm", sliding_window=_sw_attr),
    # (the talker's code predictor: Qwen3's attention; the talker's own layers are the thinker's class)
    _row("qwen3_omni_moe_talker_code_predictor", "qwen3_omni_moe.modeling_qwen3_omni_moe",
         "Qwen3OmniMoeTalkerCodePredictorAttention", "Qwen3OmniMoeRMSNorm", sliding_window=_sw_attr),
    _row("dots1", "dots1.modeling_dots1", "Dots1Attention", "Dots1RMSNorm", sliding_window=_sw_attr),
    _row("mellum", "mellum.modeling_mellum", "MellumAttention", "MellumRMSNorm", sliding_window=_sw_attr),
    _row("apertus", "apertus.modeling_apertus", "ApertusAttention", "ApertusRMSNorm"),
    _row("apertus1p5_text", "apertus1p5.modeling_apertus1p5", "Apertus1p5TextAttention", "Apertus1p5TextRMSNorm"),
    # (a hybrid: its short-conv layers stay HF's; the full-attention layers' proportional RoPE rotates half of each head)
    _row("lfm3", "lfm3.modeling_lfm3", "Lfm3Attention", "Lfm3RMSNorm", sliding_window=_sw_attr,
         output_gate=_gate_sigmoid_g_proj_per_head),
    _row("hy_v3", "hy_v3.modeling_hy_v3", "HYV3Attention", "HYV3RMSNorm"),
    _row("lfm2", "lfm2.modeling_lfm2", "Lfm2Attention", "Lfm2RMSNorm", q_norm="q_layernorm",
         k_norm="k_layernorm", out_proj="out_proj"),
    _row("lfm2_moe", "lfm2_moe.modeling_lfm2_moe", "Lfm2MoeAttention", "Lfm2MoeRMSNorm", q_norm="q_layernorm",
         k_norm="k_layernorm", out_proj="out_proj"),
    _row("exaone4", "exaone4.modeling_exaone4", "Exaone4Attention", "Exaone4RMSNorm",
         rope=_rope_nope_on_global_layers, sliding_window=_sw_if_sliding),
    _row("exaone_moe", "exaone_moe.modeling_exaone_moe", "ExaoneMoeAttention", "ExaoneMoeRMSNorm",
         rope=_rope_nope_on_global_layers, sliding_window=_sw_if_sliding),
    _row("kolibri1", "kolibri1.modeling_kolibri1", "Kolibri1Attention", "Kolibri1RMSNorm",
         rope=_rope_nope_on_global_layers, sliding_window=_sw_if_sliding),
    _row("doge", "doge.modeling_doge", "DogeAttention", "DogeRMSNorm", dynamic_mask=_mask_doge_dynamic),
    _row("beam", "beam.modeling_beam", "BeamAttention", "BeamRMSNorm", sliding_window=_sw_attr, rope=_rope_nope_if_none,
         qk_scale=_qk_scale_beam, output_gate=_gate_sigmoid_gate_proj_with_head_bias,
         consumes=("attention_scaling",)),
    _row("flint", "flint.modeling_flint", "FlintAttention", "FlintRMSNorm", sliding_window=_sw_attr,
         rope=_rope_only_on_sliding_layers, sinks="sinks"),
    # (a hybrid: gated delta net layers stay HF's; its full-attention layers get no position embeddings: NoPE)
    _row("lara_mini", "lara_mini.modeling_lara_mini", "LaraMiniAttention", "LaraMiniRMSNorm", sliding_window=_sw_attr,
         rope=_rope_nope_if_none),
    # (one weightless norm module for q and k; the text model of a composite config, its vision and audio towers HF's)
    _row("muse_spark_text", "muse_spark.modeling_muse_spark", "MuseSparkTextAttention", "MuseSparkRMSNorm",
         norm_weight=False, q_norm="qk_norm", k_norm="qk_norm", sliding_window=_sw_attr, rope=_rope_nope_if_none,
         qk_scale=_qk_scale_muse_spark, output_gate=_gate_o_norm_sigmoid_gate_proj),
    # (MuseSpark's attention without o_norm: a sigmoid gate_proj gate per channel; the vision tower HF's)
    _row("muse_glimmer_text", "muse_glimmer.modeling_muse_glimmer", "MuseGlimmerTextAttention", "MuseGlimmerRMSNorm",
         norm_weight=False, q_norm="qk_norm", k_norm="qk_norm", sliding_window=_sw_attr, rope=_rope_nope_if_none,
         qk_scale=_qk_scale_muse_spark, output_gate=_gate_sigmoid_gate_proj),
    # (HF's qkv_proj is already one Linear: its rows module keeps the name; interleaved RoPE in fp32 on the sliding
    # layers; the global ones NoPE, their q and k scaled)
    _row("ergo", "ergo.modeling_ergo", "ErgoAttention", "ErgoRMSNorm", joined="qkv_proj", rope_style="interleaved",
         sliding_window=_sw_attr, rope=_rope_nope_if_none, qk_scale=_qk_scale_ergo),
    # (nGPT: L2 norms of q and k, q scaled per channel after RoPE, a scaled sigmoid gate and an L2 sub-norm after
    # attention; recurrent layers run several times a step, each loop with a cache of its own)
    _row("dory", "dory.modeling_dory", "DoryAttention", "DoryL2Norm", norm_weight=False, l2_norm=True,
         sliding_window=_sw_attr, qk_scale=_qk_scale_dory, output_gate=_gate_dory, kv_update=_kv_update_dory,
         consumes=("cache_offset",)),
    # (RoPE on the sliding layers; the indexed-attention ones NoPE, with the indexer's selection and NVFP4-rounded k/v;
    # KV-shared layers, which have q_proj only, stay HF's)
    _row("kolibri1_1", "kolibri1_1.modeling_kolibri1_1", "Kolibri1_1Attention", "Kolibri1_1RMSNorm",
         rope=_rope_if_sliding, sliding_window=_sw_if_sliding, shared_kv=_shared_kv_layer_str, skip=_skip_kv_shared,
         kv_update=_kv_update_layer_idx, before_attention=_indexer_kolibri1_1,
         consumes=("shared_kv_states", "index_pool")),
    _row("glm4_moe", "glm4_moe.modeling_glm4_moe", "Glm4MoeAttention", "Glm4MoeRMSNorm", skip=_skip_glm4_moe),
    # (RoPE on the sliding layers, the global ones NoPE; a sigmoid gate from gate_proj per channel)
    _row("afmoe", "afmoe.modeling_afmoe", "AfmoeAttention", "AfmoeRMSNorm", sliding_window=_sw_attr,
         rope=_rope_if_local_attention, output_gate=_gate_sigmoid_gate_proj),
    _row("laguna", "laguna.modeling_laguna", "LagunaAttention", "LagunaRMSNorm", sliding_window=_sw_attr,
         output_gate=_gate_softplus_g_proj),
    # RMSNorm after RoPE (HunYuan; the 091 order)
    _row("hunyuan_v1_dense", "hunyuan_v1_dense.modeling_hunyuan_v1_dense", "HunYuanDenseV1Attention",
         "HunYuanDenseV1RMSNorm", **_HUNYUAN),
    _row("hunyuan_v1_moe", "hunyuan_v1_moe.modeling_hunyuan_v1_moe", "HunYuanMoEV1Attention",
         "HunYuanMoEV1RMSNorm", **_HUNYUAN),
    _row("hunyuan_vl_text", "hunyuan_vl.modeling_hunyuan_vl", "HunYuanVLDenseV1Attention", "HunYuanVLRMSNorm",
         **_HUNYUAN),
    _row("nanochat", "nanochat.modeling_nanochat", "NanoChatAttention", "NanoChatRMSNorm",
         qk_norm_position="after_rope", norm_weight=False, rope=_rope_negated_sin),
    # (transformers 5.25 renamed Llama4TextL2Norm, same math; its eps attribute eps -> variance_epsilon)
    _row("llama4_text", "llama4.modeling_llama4", "Llama4TextAttention", "Llama4TextL2Norm",
         norm_aliases=("Llama4TextWeightlessRMSNorm",),
         qk_norm_position="after_rope", norm_weight=False, rope_style="interleaved", q_norm="qk_norm",
         k_norm="qk_norm", rope=_rope_complex_interleaved, skip=_skip_llama4),
    # weight form 1 + w
    _row("gemma3_text", "gemma3.modeling_gemma3", "Gemma3Attention", "Gemma3RMSNorm", norm_weight_offset=1.0,
         sliding_window=_sw_attr),
    # (partial RoPE; the sparse layers' indexer picks key blocks after the KV store)
    _row("minimax_m3_vl_text", "minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLAttention", "MiniMaxM3VLRMSNorm",
         norm_weight_offset=1.0, before_attention=_indexer_minimax_m3),
    _row("step3p5", "step3p7.modeling_step3p7", "Step3p7Attention", "Step3p7RMSNorm", norm_weight_offset=1.0,
         sliding_window=_sw_attr, output_gate=_gate_sigmoid_g_proj_per_head),
    # gated q (and 1 + w); the hybrids' linear-attention layers are not attention modules
    _row("qwen3_next", "qwen3_next.modeling_qwen3_next", "Qwen3NextAttention", "Qwen3NextRMSNorm", **_QWEN3_NEXT),
    _row("qwen3_5_text", "qwen3_5.modeling_qwen3_5", "Qwen3_5Attention", "Qwen3_5RMSNorm", **_QWEN3_NEXT),
    _row("qwen3_5_moe_text", "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeAttention", "Qwen3_5MoeRMSNorm",
         **_QWEN3_NEXT),
    _row("qwen4_exp_text", "qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextAttention", "Qwen4ExpTextRMSNorm",
         prologue=_prologue_qwen4_exp, **_QWEN3_NEXT),
    # RMSNorm over all heads' channels (before RoPE)
    _row("olmo2", "olmo2.modeling_olmo2", "Olmo2Attention", "Olmo2RMSNorm", **_OLMO2),
    _row("olmo3", "olmo3.modeling_olmo3", "Olmo3Attention", "Olmo3RMSNorm", sliding_window=_sw_attr, **_OLMO2),
    _row("olmoe", "olmoe.modeling_olmoe", "OlmoeAttention", "OlmoeRMSNorm", sliding_window=_sw_config, **_OLMO2),
    _row("flex_olmo", "flex_olmo.modeling_flex_olmo", "FlexOlmoAttention", "FlexOlmoRMSNorm", **_OLMO2),
    _row("olmo_hybrid", "olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridAttention", "OlmoHybridRMSNorm",
         rope=_rope_nope_if_none, **_OLMO2),
    # (qk_norm_type "olmo": over all heads; "qwen3": per head; the vision tower and adapter stay HF's)
    _row("molmo2_text", "molmo2.modeling_molmo2", "Molmo2Attention", "Molmo2RMSNorm", norm_scope=_norm_scope_molmo2),
    _row("minimax_m2", "minimax_m2.modeling_minimax_m2", "MiniMaxM2Attention", "MiniMaxM2RMSNorm", **_OLMO2),
    # v norm (Gemma 3n / 4: weight w, unweighted v RMSNorm; KV-shared layers stay HF's)
    _row("gemma3n_text", "gemma3n.modeling_gemma3n", "Gemma3nTextAttention", "Gemma3nRMSNorm", **_GEMMA_N),
    _row("gemma4_text", "gemma4.modeling_gemma4", "Gemma4TextAttention", "Gemma4RMSNorm",
         **dict(_GEMMA_N, k_eq_v="use_alternative_attention")),
    _row("gemma4_unified_text", "gemma4_unified.modeling_gemma4_unified", "Gemma4UnifiedTextAttention",
         "Gemma4UnifiedRMSNorm", **dict(_GEMMA_N, k_eq_v="use_alternative_attention")),
    # T5Gemma 2 (1 + w): the encoder's self-attention, and the decoder's merged self- and cross-attention, whose
    # k_proj / v_proj also project the encoder's states (those keys normed, not rotated)
    _row("t5gemma2_text", "t5gemma2.modeling_t5gemma2", "T5Gemma2SelfAttention", "T5Gemma2RMSNorm",
         norm_weight_offset=1.0, sliding_window=_sw_attr),
    _row("t5gemma2_decoder", "t5gemma2.modeling_t5gemma2", "T5Gemma2MergedAttention", "T5Gemma2RMSNorm",
         norm_weight_offset=1.0, kv_update=_kv_update_self_attention_cache, before_attention=_cross_attention_t5gemma2,
         split_weights=_split_weights_t5gemma2, consumes=("merged_attention_mask", "encoder_hidden_states"),
         no_fp8=_NO_FP8_T5GEMMA2),
    # (an encoder: bidirectional on every layer, no KV cache; per-layer head_dim)
    _row("embedding_gemma2_text", "embedding_gemma2.modeling_embedding_gemma2", "EmbeddingGemma2Attention",
         "EmbeddingGemma2RMSNorm", v_norm="v_norm", sliding_window=_sw_attr),
)

# families with a QK norm the block does not compute (named in apply_to's error)
UNSUPPORTED = {
    "cohere": "its QK norm (use_qk_norm) is a LayerNorm (mean-centred, per head), not an RMSNorm",
    "chameleon": "its QK norm is a LayerNorm (mean-centred, with bias), not an RMSNorm",
    "persimmon": "its QK layernorm is a LayerNorm (mean-centred, with bias), not an RMSNorm",
    "phi": "its QK layernorm is a LayerNorm (mean-centred, with bias), not an RMSNorm",
    "stablelm": "its QK layernorm is a per-head LayerNorm (mean-centred), not an RMSNorm",
    "esmc": "its QK norm is a LayerNorm (mean-centred), not an RMSNorm",
    # RMS QK norms where the projection and the norm do not meet as the block has them
    "inkling_text": "its k and v pass through short convolutions (k_sconv, v_sconv) between the projection and the "
                    "norm, and it has no RoPE (relative position logits instead)",
    "zaya": "its q/k/v projection is Compressed Convolutional Attention (q and k mixed by a causal convolution with "
            "residual paths, v from a recurrent state) and its QK norm an L2 norm with a per-KV-head key scale",
    "muse_glimmer_assistant": "its k and v project the drafted block's context together with the hidden states, q "
                              "the hidden states alone: no one input for a fused q/k/v projection",
}


def _supported_names() -> str:
    return ", ".join(sorted({a.model_type for a in SUPPORTED}))


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Per fused module: the sizes, the projection rows and the block's options."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    projs: tuple[str, ...]      # the HF projections fused, in row order
    split: tuple[int, ...]      # their row counts
    block_kwargs: dict          # gqa_qkv_rope_qk_norm's keyword arguments beyond the sizes
    k_eq_v: bool                # v is the raw k projection (no v_proj; Gemma 4)
    hf_children: tuple          # the HF module's child names in order (its state-dict order)
    quantized: bool = False     # q/k/v are bitsandbytes 4-bit layers, kept in place (integrations.qlora)
    fused_name: str = "qkv_proj"  # the FusedQKVProjection's attribute (FUSED_NAME, or ..._OVER_JOINED)
    norms: tuple = ()           # the norms' child names (q, k[, v]): checked again when they change (projection_plan)


# where the fused projection goes: before q_proj; where HF's attention already has one joined q/k/v Linear
# (Arch.joined), that name stays its rows module's (what PEFT and module filters target) and this one is the fused
# parameter's
FUSED_NAME = "qkv_proj"
FUSED_NAME_OVER_JOINED = "qkv_fused"
# Arch.l2_norm: the norms' weight in the block, fp32 [head_dim] of head_dim^-1/2, kept on the attention module per
# device (fp32 whatever the model's dtype: 128^-1/2 is no bf16 number)
L2_SCALE = "_fusedqkv_l2_scale"


def _l2_scales(attn, d: int, device: torch.device) -> tuple:
    """The q and k norm weights of an Arch.l2_norm family: one kept tensor twice in eager; under torch.compile two
    constants of the graph (Dynamo refuses one tensor as two inputs of an autograd.Function)."""
    if torch.compiler.is_compiling():
        return tuple(torch.full((d,), d ** -0.5, dtype=torch.float32, device=device) for _ in range(2))
    t = attn.__dict__.get(L2_SCALE)
    if t is None or t.device != device:
        t = attn.__dict__[L2_SCALE] = torch.full((d,), d ** -0.5, dtype=torch.float32, device=device)
    return t, t


# --------------------------------------------------------------------------- the fused forward


# the names HF's modeling modules give their RoPE function (Llama 4: apply_rotary_emb). The block computes the
# rotation in its kernel, so a function put in that name's place would not run: HF's own (any transformers module)
# and Liger-Kernel's (the same math) are taken, anything else refused
ROPE_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_emb")
_ROPE_TAKEN: dict = {}  # modeling module name -> the function last taken there (the forward's check: one lookup)


def _check_rope_function(modeling, who: str = "fusedqkv.apply_to", error: type = UnsupportedModelError) -> None:
    """Refuse a replaced RoPE function in ``modeling`` (see :data:`ROPE_FUNCTIONS`)."""
    for name in ROPE_FUNCTIONS:
        fn = getattr(modeling, name, None)
        if fn is None:
            continue
        if fn is _ROPE_TAKEN.get(modeling.__name__):
            return
        where = getattr(fn, "__module__", None) or ""
        if not (where.startswith("transformers.") or where.startswith("liger_kernel.")):
            raise error(f"{who}: {modeling.__name__}.{name} was replaced by {getattr(fn, '__qualname__', fn)!r} "
                        f"(from {where or 'an unknown module'}); the fused block computes this family's RoPE in its "
                        f"kernel and would not call it")
        if not torch.compiler.is_compiling():
            _ROPE_TAKEN[modeling.__name__] = fn
        return


class _FusedAttention:
    """Mixin placed before the HF attention class: ``forward`` with the fused input block.

    Class attributes set per architecture by :func:`fused_class`: ``_fusedqkv_arch``,
    ``_fusedqkv_modeling`` (the HF modeling module: its ``eager_attention_forward`` and
    ``ALL_ATTENTION_FUNCTIONS`` are looked up per call, as the original forward does),
    ``_fusedqkv_update`` (the KV-cache call of this transformers version).
    Instance attribute: ``_fusedqkv`` (:class:`FusedSpec`)."""

    def _fusedqkv_qkv(self, hidden_states, position_embeddings):
        """q, k, v as HF's attention takes them and the output gate (``None`` unless gated q), the
        gate as ``[..., heads, head_dim]``: a view of the projection output (HF's ``[..., heads *
        head_dim]`` reshape of it is a copy, a full pass over a q-sized tensor)."""
        spec: FusedSpec = self._fusedqkv
        arch: Arch = self._fusedqkv_arch
        cos, sin = arch.rope(self, hidden_states, position_embeddings)
        if cos.dtype != hidden_states.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            # some families' rotary embeddings stay fp32 beside bf16 activations (OLMo 2 rotates in
            # fp32 and rounds after); the block computes in fp32 and rounds once, from cos/sin in the
            # activation dtype (under autocast the block casts them itself)
            cos, sin = cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)
        # what sits in q/k/v_proj's places: the rows apply_to left, or PEFT LoRA layers over them
        # (anything else raises: it would be bypassed), which adapters apply, the FP8 recipe; kept
        # while the modules and PEFT's state stay the same (projection_plan)
        plan = projection_plan(self, spec)
        if plan.fp8 is not None and arch.no_fp8 is not None:
            # a recipe that reached the block after apply_to (torchao's Float8Linear or MX layers in q/k/v_proj's places)
            raise UnsupportedModuleError(f"fusedqkv: {type(self).__name__} with FP8: {arch.no_fp8}")
        _check_rope_function(self._fusedqkv_modeling, "fusedqkv", UnsupportedModuleError)
        eps = plan.eps
        if eps is None:  # the norms as they are now (checked again once per state of the modules: projection_plan)
            eps = plan.eps = _norms_eps(type(self).__name__, self, arch, spec.head_dim, spec.num_heads,
                                        spec.num_kv_heads, "fusedqkv", UnsupportedModuleError)
        slots = plan.slots
        source = None
        if spec.quantized:
            # the fused weight dequantized into one workspace per call, rebuilt again by the backward
            # (qkv_weight_source) rather than held (k_eq_v: rows [Q | K], v taken from k in the block)
            bases = [m for _, m, _ in slots]
            dt = qlora.block_dtype(hidden_states)
            source = plan.dequantized(bases, dt, hidden_states.device)
            w, b = source(), qlora.fused_bias(bases, dt)
            if torch.compiler.is_compiling():
                source = None
        else:
            proj = self._modules[spec.fused_name]
            w, b = fused_weights(proj)  # (torchao's MX-wrapped parameters unwrapped)
        # the adapters inside the block (in place), or as a residual of the projection output
        residual, lora = plan.lora(hidden_states, inplace=not spec.k_eq_v)
        fp8 = plan.fp8
        # (k_eq_v: rows [Q | K], the block takes v from the k projection: its k_eq_v in block_kwargs)
        if arch.norm_weight:
            wq, wk = getattr(self, arch.q_norm).weight, getattr(self, arch.k_norm).weight
        elif arch.l2_norm:
            wq, wk = _l2_scales(self, spec.head_dim, hidden_states.device)
        else:
            wq = wk = None
        # under autocast the block casts its inputs as HF's Linear would (gqa_qkv_rope_qk_norm)
        out = gqa_qkv_rope_qk_norm(hidden_states, w, wq, wk, cos, sin, num_heads=spec.num_heads,
                                   num_kv_heads=spec.num_kv_heads, eps=eps, qkv_bias=b, qkv_residual=residual,
                                   qkv_weight_source=source, qkv_lora=lora, **dict(spec.block_kwargs, fp8=fp8))
        if arch.q_gate:
            return out
        q, k, v = out
        return q, k, v, None

    def _fusedqkv_forward(self, hidden_states, position_embeddings, attention_mask, cache, kwargs,
                          cache_position=None):
        arch: Arch = self._fusedqkv_arch
        if arch.prologue is not None:
            position_embeddings, attention_mask = arch.prologue(self, hidden_states, position_embeddings,
                                                                attention_mask, cache)
        shared_kv_states = kwargs.pop("shared_kv_states", None) if arch.shared_kv is not None else None
        query, key, value, gate = self._fusedqkv_qkv(hidden_states, position_embeddings)
        if arch.qk_scale is not None:
            query, key = arch.qk_scale(self, query, key, kwargs)
        if arch.kv_update is not None:
            key, value = arch.kv_update(self, cache, key, value, kwargs)
        elif cache is not None:
            key, value = self._fusedqkv_update(cache, key, value, kwargs, position_embeddings, cache_position)
        if arch.shared_kv is not None and self.store_full_length_kv:
            shared_kv_states[arch.shared_kv(self)] = key, value
        if arch.dynamic_mask is not None:
            attention_mask = arch.dynamic_mask(self, hidden_states, value, attention_mask)
        extra = ()
        if arch.before_attention is not None:
            key, value, attention_mask, extra = arch.before_attention(self, hidden_states, position_embeddings, cache,
                                                                      query, key, value, attention_mask, kwargs)
        modeling = self._fusedqkv_modeling
        functions = modeling.ALL_ATTENTION_FUNCTIONS
        impl = self.config._attn_implementation
        eager = modeling.eager_attention_forward
        if hasattr(functions, "get_interface"):
            interface = functions.get_interface(impl, eager)
        else:  # transformers 5.0
            interface = eager if impl == "eager" else functions[impl]
        if arch.sliding_window is not None:
            kwargs["sliding_window"] = arch.sliding_window(self)
        if arch.sinks is not None:
            kwargs["s_aux"] = getattr(self, arch.sinks)
        dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
        attn_output, attn_weights = interface(self, query, key, value, attention_mask, dropout=dropout,
                                              scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        if gate is not None:  # per head: the gate stays a view of the projection output
            attn_output = (attn_output.view(gate.shape) * torch.sigmoid(gate)).view(attn_output.shape)
        if arch.output_gate is not None:
            attn_output = arch.output_gate(self, attn_output, hidden_states)
        if arch.split_weights is not None:
            return (getattr(self, arch.out_proj)(attn_output), *arch.split_weights(attn_weights, extra))
        return (getattr(self, arch.out_proj)(attn_output), attn_weights, *extra)

    def extra_repr(self) -> str:
        s: FusedSpec = self._fusedqkv
        kw = dict(s.block_kwargs)
        pos = kw.pop("qk_norm_position").replace("_", " ")
        if not kw["norm_weight_offset"]:
            del kw["norm_weight_offset"]
        if kw.get("fp8") is None:
            kw.pop("fp8", None)
        else:
            kw["fp8"] = kw["fp8"].key
        opts = "".join(f", {k}={v}" for k, v in kw.items())
        return (f"fusedqkv: {s.fused_name} = [{' | '.join(s.projs)}] + RMSNorm {pos} (num_heads={s.num_heads}, "
                f"num_kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, eps={s.eps}{opts})")


# The KV-cache conventions of transformers 5.x's attention forwards (the rest of the forward is
# the same in all): picked per class from the original forward's signature. Each normalises the
# arguments for _fusedqkv_forward and names the cache update.


def _update_layer_idx(self, cache, key, value, kwargs, position_embeddings, cache_position):
    return cache.update(key, value, self.layer_idx)


def _update_with_cache_kwargs(self, cache, key, value, kwargs, position_embeddings, cache_position):
    cache_kwargs = {"cache_position": cache_position}
    if isinstance(position_embeddings, tuple):  # (cos, sin); Llama 4 passes a complex tensor
        cache_kwargs["cos"], cache_kwargs["sin"] = position_embeddings
    return cache.update(key, value, self.layer_idx, cache_kwargs)


def _update_with_kwargs(self, cache, key, value, kwargs, position_embeddings, cache_position):
    return cache.update(key, value, self.layer_idx, kwargs=kwargs)


def _forward_past_key_values(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs):
    # transformers 5.1 - 5.2x: cache.update(k, v, layer_idx)
    return self._fusedqkv_forward(hidden_states, position_embeddings, attention_mask, past_key_values, kwargs)


def _forward_cache_position(self, hidden_states, position_embeddings=None, attention_mask=None,
                            past_key_values=None, cache_position=None, **kwargs):
    # transformers 5.0: cache.update(k, v, layer_idx, {sin, cos, cache_position})
    return self._fusedqkv_forward(hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
                                  cache_position)


def _forward_cache(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    # newer 5.x: the argument is ``cache`` (``past_key_values`` deprecated), update(..., kwargs=)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    return self._fusedqkv_forward(hidden_states, position_embeddings, attention_mask, cache, kwargs)


def _forward_encoder(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
    # encoders (EmbeddingGemma 2): no KV cache, and HF's order puts the mask before the position embeddings
    return self._fusedqkv_forward(hidden_states, position_embeddings, attention_mask, None, kwargs)


def _forward_merged(self, hidden_states, position_embeddings=None, merged_attention_mask=None,
                    encoder_hidden_states=None, cache=None, **kwargs):
    # T5Gemma 2's decoder (merged self- and cross-attention): the mask and the encoder's states named so; the cache
    # ``past_key_values`` before transformers 5.2x
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    kwargs["encoder_hidden_states"] = encoder_hidden_states
    return self._fusedqkv_forward(hidden_states, position_embeddings, merged_attention_mask, cache, kwargs)


def _no_cache_update(self, cache, key, value, kwargs, position_embeddings, cache_position):
    # never called: an encoder has no cache, and T5Gemma 2's decoder updates its own through its row's kv_update
    raise AssertionError(f"{type(self).__name__}: no KV-cache update of the common kind")


def _cache_convention(cls):
    params = inspect.signature(cls.forward).parameters
    if list(params)[:4] == ["self", "hidden_states", "attention_mask", "position_embeddings"] and not (
            {"cache", "cache_position", "past_key_values"} & set(params)):
        return _forward_encoder, _no_cache_update
    if list(params)[:5] == ["self", "hidden_states", "position_embeddings", "merged_attention_mask",
                            "encoder_hidden_states"]:
        return _forward_merged, _no_cache_update  # (its row's kv_update updates the cache)
    if "cache" in params:
        return _forward_cache, _update_with_kwargs
    if "cache_position" in params:
        return _forward_cache_position, _update_with_cache_kwargs
    if "past_key_values" in params:
        return _forward_past_key_values, _update_layer_idx
    raise UnsupportedModelError(
        f"fusedqkv.apply_to: {cls.__name__}.forward{inspect.signature(cls.forward)} has no KV-cache argument this "
        f"integration knows (past_key_values / cache); transformers {_tf_version()} is not supported")


_FUSED_CLASSES: dict = {}
# the parameters every supported attention forward names (the KV cache under one of its names)
_COMMON_FORWARD_PARAMS = frozenset(("self", "hidden_states", "position_embeddings", "attention_mask", "cache",
                                    "past_key_values", "cache_position"))


def _check_forward_params(cls, arch: "Arch") -> None:
    """Refuse an HF forward that names a parameter the row's hooks do not read: the fused forward would
    pass it on to the attention function, which would drop it without a word (a release that gives a
    supported family a new input: Beam's attention_scaling is one, read by its row)."""
    params = inspect.signature(cls.forward).parameters
    extra = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
             and n not in _COMMON_FORWARD_PARAMS and n not in arch.consumes]
    if extra:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {cls.__name__}.forward takes {', '.join(extra)}, which the fused forward does not "
            f"apply (it would reach the attention function unused); {arch.model_type} on transformers "
            f"{_tf_version()} is not supported")


def _arch_of(cls: type) -> Arch:
    return next(a for a in SUPPORTED if a.attention == cls.__name__ and a.modeling == cls.__module__)


def fused_class(cls: type) -> type:
    """The fused subclass of an HF attention class (one per class; it lives in this module
    under ``FusedQKV<Name>`` so that a pickled model finds it again)."""
    arch = _arch_of(cls)
    _check_forward_params(cls, arch)  # (before the cache: the class's forward may have been replaced since)
    fused = _FUSED_CLASSES.get(cls)
    if fused is not None:
        return fused
    forward, update = _cache_convention(cls)
    name = "FusedQKV" + cls.__name__
    fused = type(name, (_FusedAttention, cls), {
        "__module__": __name__, "__qualname__": name, "forward": forward, "_fusedqkv_update": update,
        "_fusedqkv_arch": arch, "_fusedqkv_modeling": sys.modules[cls.__module__],
        "__doc__": f"{cls.__name__} with the fused QKV + RoPE + QK-norm input block (fusedqkv.apply_to).",
    })
    _FUSED_CLASSES[cls] = fused
    setattr(sys.modules[__name__], name, fused)
    return fused


def __getattr__(name: str):
    # unpickling a fused model in a fresh process: rebuild FusedQKV<Name> from the HF class
    if name.startswith("FusedQKV"):
        for a in SUPPORTED:
            if "FusedQKV" + a.attention == name:
                return fused_class(getattr(importlib.import_module(a.modeling), a.attention))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- state-dict hooks


def _is_dtensor(t) -> bool:
    """A DTensor (FSDP2's and tensor parallel's parameters): its rows split and join with collectives."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _split_rows(t: torch.Tensor, split) -> tuple:
    """``t``'s row blocks of sizes ``split``, detached (views of a plain tensor). A DTensor's (FSDP2's fused
    parameter, sharded by rows) are each placed as ``t`` is, as the unfused model's q/k/v parameters are:
    splitting gathers the rows, then each rank keeps its shard of each block."""
    parts = t.detach().split(split)
    if not _is_dtensor(t):
        return parts
    return tuple(p.redistribute(t.device_mesh, t.placements) for p in parts)


def _join_rows(parts: list, param: torch.Tensor) -> torch.Tensor:
    """The fused parameter's value from its row blocks. Into a DTensor parameter, from plain or DTensor blocks
    of any placement (a full state dict on every rank, or torch.distributed.checkpoint's): the whole joined
    rows on each rank (gathering DTensor blocks), then each rank's shard, placed as ``param`` is."""
    whole = [p.full_tensor() if _is_dtensor(p) else p for p in parts]
    if not _is_dtensor(param):
        return torch.cat(whole, 0)
    from torch.distributed.tensor import distribute_tensor

    local = param.to_local()
    # into a parameter on meta (loaded with assign=True: accelerate's FSDP2 loading) on the loaded values' device
    device = whole[0].device if local.is_meta else local.device
    full = torch.cat([p.to(device=device, dtype=local.dtype) for p in whole], 0)
    # every rank holds the joined rows: each keeps its own shard (no communication)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """``qkv_proj.weight``/``.bias`` -> HF's ``q_proj``/``k_proj``/``v_proj`` entries, in HF's
    key order (the module's keys are the tail of ``state_dict`` when this runs: its own
    parameters and buffers, then its children's, which are put back in the HF module's order)."""
    spec: FusedSpec = module._fusedqkv
    fused_w, fused_b = prefix + spec.fused_name + ".weight", prefix + spec.fused_name + ".bias"
    if fused_w not in state_dict:
        return
    tail = []
    for key in reversed(state_dict):
        if not key.startswith(prefix):
            break
        tail.append(key)
    tail.reverse()
    items = dict((key, state_dict.pop(key)) for key in tail)
    children = {}  # child name -> [(key, value)]
    for key, value in items.items():
        child, _, rest = key[len(prefix):].partition(".")
        if not rest or child not in module._modules:  # the module's own parameter or buffer
            state_dict[key] = value
        elif child != spec.fused_name:
            children.setdefault(child, []).append((key, value))
    bias = items.get(fused_b)
    # copies: views of one storage would be taken for tied weights by save_pretrained
    w_parts = _split_rows(items[fused_w], spec.split)
    b_parts = _split_rows(bias, spec.split) if bias is not None else (None,) * len(spec.projs)
    for name, w_part, b_part in zip(spec.projs, w_parts, b_parts):
        # under a PEFT LoRA layer the base weights are HF+PEFT's <name>.base_layer.*; the adapters'
        # own entries (<name>.lora_A...) follow them, as in the unfused model
        slot = module._modules.get(name)
        base = f"{prefix}{name}." + ("base_layer." if _base_linear(slot) is not slot else "")
        entries = [(base + "weight", w_part.clone())]
        if b_part is not None:
            entries.append((base + "bias", b_part.clone()))
        children[name] = entries + children.get(name, [])
    for child in spec.hf_children:
        for key, value in children.pop(child, ()):
            state_dict[key] = value
    for entries in children.values():  # children added after apply_to
        for key, value in entries:
            state_dict[key] = value
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None and (prefix + spec.fused_name) in meta:
        version = meta.pop(prefix + spec.fused_name)
        for name in spec.projs:
            meta[prefix + name] = dict(version)


def _hf_key(module, state_dict, prefix: str, proj: str, suffix: str) -> str:
    """A projection's HF key, or HF+PEFT's (``<proj>.base_layer.*``) where the state dict has that one or, having
    neither, where a LoRA layer wraps the projection (the key the model without fusedqkv would miss)."""
    plain, wrapped = f"{prefix}{proj}.{suffix}", f"{prefix}{proj}.base_layer.{suffix}"
    slot = module._modules[proj]
    if wrapped in state_dict or (plain not in state_dict and _base_linear(slot) is not slot):
        return wrapped
    return plain


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
    """HF's ``q_proj``/``k_proj``/``v_proj`` entries -> ``qkv_proj.weight``/``.bias`` (a part
    that is absent keeps the current value and is reported missing)."""
    spec: FusedSpec = module._fusedqkv
    proj = module._modules[spec.fused_name]
    for suffix in ("weight", "bias"):
        names = [_hf_key(module, state_dict, prefix, p, suffix) for p in spec.projs]
        param = getattr(proj, suffix)
        if not any(n in state_dict for n in names):
            if param is not None and f"{prefix}{spec.fused_name}.{suffix}" not in state_dict:
                missing_keys.extend(names)  # under HF's names (the post-hook drops the fused one torch adds)
            continue
        if param is None:
            continue  # no bias here: torch reports the keys as unexpected
        parts, ok, current = [], True, None
        for n, rows in zip(names, spec.split):
            shape = (rows,) + tuple(param.shape[1:])
            if n not in state_dict:
                missing_keys.append(n)
                if current is None:  # (a DTensor's rows are gathered: only where a part is absent)
                    current = _split_rows(param, spec.split)
                parts.append(current[len(parts)])
                continue
            t = state_dict.pop(n)
            if tuple(t.shape) != shape:
                error_msgs.append(f"size mismatch for {n}: copying a param with shape {tuple(t.shape)} from "
                                  f"checkpoint, the shape in current model is {shape}.")
                ok = False
                continue
            if _is_dtensor(t) or _is_dtensor(param):
                parts.append(t)
            elif param.is_meta:  # a model built on meta, loaded with assign=True: the loaded tensors become it
                parts.append(t if not parts else t.to(device=parts[0].device, dtype=parts[0].dtype))
            else:
                parts.append(t.to(device=param.device, dtype=param.dtype))
        if ok:
            state_dict[f"{prefix}{spec.fused_name}.{suffix}"] = _join_rows(parts, param)


def _load_state_dict_post_hook(module, incompatible_keys) -> None:
    """A fused parameter reported missing where its q/k/v rows are, under HF's names (the pre-hook's): only
    those stay, as the model without fusedqkv would report them."""
    spec: FusedSpec = module._fusedqkv
    missing = incompatible_keys.missing_keys
    listed = set(missing)
    for suffix in ("weight", "bias"):
        tail = f"{spec.fused_name}.{suffix}"
        for key in [k for k in missing if k.endswith(tail)]:
            prefix = key[:-len(tail)]
            if all(f"{prefix}{p}.{suffix}" in listed or f"{prefix}{p}.base_layer.{suffix}" in listed
                   for p in spec.projs):
                missing.remove(key)


def _register_hooks(module: nn.Module) -> None:
    post = getattr(module, "register_state_dict_post_hook", None)
    if post is not None:
        post(_state_dict_hook)
    else:  # older torch
        module._register_state_dict_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    module.register_load_state_dict_post_hook(_load_state_dict_post_hook)


# --------------------------------------------------------------------------- checks and patch


def _tf_version() -> str:
    tf = sys.modules.get("transformers")
    return getattr(tf, "__version__", "?")


def _norm_eps(norm: nn.Module) -> Optional[float]:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(norm, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _is_liger(cls: type) -> bool:
    return any(c.__name__ == "LigerRMSNorm" and c.__module__.startswith("liger_kernel") for c in cls.__mro__)


def _peft_saved_modules(m) -> Optional[list]:
    """``[(name, module)]`` of PEFT's ``ModulesToSaveWrapper`` (``modules_to_save`` naming a norm): its original
    and its trained copies, one of which PEFT calls; None for any other module."""
    cls = type(m)
    if cls.__name__ != "ModulesToSaveWrapper" or not cls.__module__.startswith("peft."):
        return None
    copies = m._modules.get("modules_to_save")
    return [("original_module", m._modules.get("original_module"))] + [
        (f"modules_to_save.{k}", v) for k, v in (copies._modules.items() if isinstance(copies, nn.Module) else ())]


def _check_norm(path: str, norm, arch: Arch, weight_shape: Optional[tuple], offset: float,
                who: str = "fusedqkv.apply_to", error: type = UnsupportedModelError, scope: str = "head") -> float:
    """One RMSNorm module the block computes: its class (HF's or Liger-Kernel's), forward, hooks,
    weight form and shape (``weight_shape=None``: no weight); returns its eps. ``who`` and ``error``:
    the messages' prefix and class (apply_to's, or a fused forward's when the norm changed after it)."""
    if not isinstance(norm, nn.Module):
        raise error(f"{who}: {path} is missing (expected a {arch.norm_class})")
    bound = norm.__dict__.get("forward")
    if bound is not None:
        func = getattr(bound, "__func__", None)
        if not (func is not None and func.__qualname__.endswith(".forward")
                and getattr(func, "__module__", "").startswith("liger_kernel")):
            raise error(f"{who}: {path}.forward was replaced by {getattr(bound, '__qualname__', bound)!r}; the "
                        f"fused block would not compute it")
    if _peft_names_hooks(norm):
        raise error(f"{who}: {path} is PEFT's modules_to_save under mixed-batch inference (adapter_names): the "
                    f"fused block computes one norm weight for the whole batch, not one copy per sample (LoRA "
                    f"adapters on q/k/v_proj do take adapter_names)")
    for kind in _hooks(norm):  # (a replaced forward: above, where Liger's own is taken)
        if kind != "replaced forward":
            raise error(f"{who}: {path} has a {kind}; the fused block computes the norm in its kernel and never "
                        f"calls the module, so it would not run")
    saved = _peft_saved_modules(norm)
    if saved is not None:  # PEFT's modules_to_save: its weight and eps are the active copy's (attribute reads)
        eps = {_check_norm(f"{path}.{name}", m, arch, weight_shape, offset, who, error, scope) for name, m in saved}
        if len(eps) != 1:
            raise error(f"{who}: {path}: PEFT's copies of the norm have different eps ({sorted(eps)}); the fused "
                        f"block takes one")
        return eps.pop()
    cls = type(norm)
    if cls.__name__ != arch.norm_class and cls.__name__ not in arch.norm_aliases and not _is_liger(cls):
        names = " or ".join((arch.norm_class, *arch.norm_aliases))
        raise error(f"{who}: {path} is a {cls.__name__}; the fused block computes {names} "
                    f"(or Liger-Kernel's LigerRMSNorm) only")
    liger_offset = getattr(norm, "offset", None)  # Liger's RMSNorm (and its patch of HF norms)
    if liger_offset is not None and float(liger_offset) != offset:
        raise error(f"{who}: {path} scales by {liger_offset} + weight; {arch.model_type} expects {offset} + weight")
    w = getattr(norm, "weight", None)
    if weight_shape is None:
        # Gemma 3n's scale-free norm of transformers 5.0 keeps a constant 1.0 buffer named weight
        if w is not None and getattr(norm, "with_scale", True) is not False:
            raise error(f"{who}: {path} has a weight; {arch.model_type}'s norm here is unweighted")
    elif not isinstance(w, torch.Tensor) or tuple(w.shape) != weight_shape:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
        raise error(
            f"{who}: {path}.weight has shape {shape}; the fused block needs "
            + ("a per-head norm, weight [head_dim]" if scope == "head" else
               "a norm over all heads, weight [heads*head_dim]") + f" = {list(weight_shape)}")
    eps = _norm_eps(norm)
    if eps is None:
        raise error(f"{who}: {path} has no variance_epsilon/eps")
    return eps


def _norms_eps(path: str, attn: nn.Module, arch: Arch, d: int, hq: int, hkv: int, who: str = "fusedqkv.apply_to",
               error: type = UnsupportedModelError) -> float:
    """The q/k (and v) norms checked (:func:`_check_norm`) and the block's one eps from them."""
    scope = _norm_scope(arch, attn)
    if arch.norm_weight:
        wq, wk = ((d,), (d,)) if scope == "head" else ((hq * d,), (hkv * d,))
    else:
        wq = wk = None
    off = arch.norm_weight_offset
    eps_q = _check_norm(f"{path}.{arch.q_norm}", getattr(attn, arch.q_norm, None), arch, wq, off, who, error, scope)
    eps_k = _check_norm(f"{path}.{arch.k_norm}", getattr(attn, arch.k_norm, None), arch, wk, off, who, error, scope)
    if eps_q != eps_k:
        raise error(f"{who}: {path}: the q and k norms have different eps ({eps_q}, {eps_k}); the fused block "
                    f"takes one")
    if arch.v_norm is not None:
        eps_v = _check_norm(f"{path}.{arch.v_norm}", getattr(attn, arch.v_norm, None), arch, None, 0.0, who, error)
        if eps_v != eps_q:
            raise error(f"{who}: {path}: the v norm's eps {eps_v} differs from the q/k norms' {eps_q}; the fused "
                        f"block takes one")
    # l2_norm: rsqrt(sum + eps) = rsqrt(mean + eps / d) * d^-1/2, the block's RMSNorm with the scale as its weight
    return eps_q / d if arch.l2_norm else eps_q


def _base_linear(p):
    """The module under a PEFT LoRA layer (``lora.Linear``), or ``p``."""
    return unwrap_lora(p)[1]


def _check_projection_hooks(path: str, p, base) -> None:
    """Refuse hooks and a replaced ``forward`` on a projection (and on the layer under a PEFT LoRA
    layer): the fused block computes the projection in its GEMM and never calls the module, and
    apply_to replaces a plain one by rows of the fused projection, so they would be dropped."""
    for m, where in ((p, path), (base, f"{path}.base_layer")) if base is not p else ((p, path),):
        for kind in _hooks(m):
            if kind == "replaced forward":
                f = m.__dict__["forward"]
                raise UnsupportedModelError(
                    f"fusedqkv.apply_to: {where}.forward was replaced by {getattr(f, '__qualname__', f)!r} (another "
                    f"patch or an accelerate hook); the fused block computes the projection itself and would drop it")
            raise UnsupportedModelError(f"fusedqkv.apply_to: {where} has a {kind}; the fused block computes the "
                                        f"projection in its GEMM and never calls the module, so it would not run")


def _check_linear(path: str, p, hidden: int) -> nn.Module:
    base = _base_linear(p)
    if qlora.is_8bit(base):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: {qlora.REFUSED_8BIT}")
    _check_projection_hooks(path, p, base)
    if qlora.is_4bit(base):  # QLoRA: the quantized layer stays, dequantized per call (integrations.qlora)
        qlora.check_4bit(path, base, hidden, UnsupportedModelError)
        return base
    if base is not p:  # a PEFT LoRA layer: its adapters are computed in the block (integrations.peft)
        if type(base) is not nn.Linear:
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path} is a PEFT LoRA layer over a {type(base).__name__}; the fused block takes "
                f"LoRA over a plain torch.nn.Linear only")
        p = base
    elif _is_torchao_mx(p):  # torchao's MX training: its recipe runs in the block (_validate)
        if type(p) is not nn.Linear and type(p).__name__ != "MXFP8Linear":
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path} is a {type(p).__name__}; of torchao's MX training the fused block takes "
                f"an MXFP8Linear or a Linear whose weight quantize_(MXFP8TrainingOpConfig) wrapped")
    elif type(p) is not nn.Linear and not _is_float8_linear(p):
        # (PEFT's IA3, VeRA, LoKr and OFT layers are all named `Linear`: the module says which)
        why = (_hint(p) if type(p).__module__.startswith(("peft.", "torchao.")) else
               " (apply fusedqkv before wrapping projections otherwise: tensor parallel)")
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path} is a {_describe(p)}; only a plain torch.nn.Linear or a bitsandbytes "
            f"Linear4bit (or a PEFT LoRA layer over one) can be fused{why}")
    w = p.weight
    data = mx_plain(w).data  # (torchao's MX training wrapper: the plain tensor it holds)
    if type(data) is not torch.Tensor:
        why = (" (FSDP2 or tensor parallel sharded it: call apply_to before fully_shard or parallelize_module)"
               if _is_dtensor(data) else "; " + TORCHAO_QUANTIZED if type(data).__module__.startswith("torchao.")
               else "")
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}.weight is a {type(data).__name__} on {w.device}; the fused "
            f"block needs a plain dense tensor{why}")
    if w.dtype not in _FLOAT_DTYPES:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}.weight has dtype {w.dtype}; expected "
                                    f"float32, bfloat16 or float16")
    if w.shape[1] != hidden:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}.weight has shape {tuple(w.shape)}; expected "
                                    f"[rows, {hidden}] (hidden_size from the config)")
    return p


def _validate(path: str, attn: nn.Module, arch: Arch) -> FusedSpec:
    """Every check of one attention module; raises before anything changes."""
    if "forward" in attn.__dict__:
        f = attn.__dict__["forward"]
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}.forward was replaced by {getattr(f, '__qualname__', f)!r} (another patch or "
            f"an accelerate hook); the fused block would drop it")
    _check_rope_function(sys.modules[type(attn).__module__])
    cfg = attn.config
    d = attn.head_dim
    what = f"{path} ({type(attn).__name__}, model_type {getattr(cfg, 'model_type', '?')!r})"
    scope = _norm_scope(arch, attn)
    limit = _ALL_HEADS_MAX_HEAD_DIM if scope == "all_heads" else _MAX_HEAD_DIM
    if not (isinstance(d, int) and d % 2 == 0 and 0 < d <= limit):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {what}: head_dim={d}; the fused block needs an even "
                                    f"head_dim <= {limit}" + (" with its norm over all heads" if
                                                              scope == "all_heads" else ""))
    k_eq_v = bool(arch.k_eq_v and getattr(attn, arch.k_eq_v))
    if arch.joined is not None:
        names = (arch.joined,)
        for name in ("q_proj", "k_proj", "v_proj"):
            if attn._modules.get(name) is not None:
                raise UnsupportedModelError(f"fusedqkv.apply_to: {path} has a {name} beside its joined {arch.joined}")
    else:
        names = ("q_proj", "k_proj") if k_eq_v else ("q_proj", "k_proj", "v_proj")
    projs = []
    for name in names:
        p = attn._modules.get(name)
        if p is None:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path} has no {name}")
        projs.append(_check_linear(f"{path}.{name}", p, cfg.hidden_size))
    if k_eq_v and attn._modules.get("v_proj") is not None:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path} has a v_proj although {arch.k_eq_v} is set")
    quantized = [qlora.is_4bit(p) for p in projs]
    if any(quantized) and not all(quantized):
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}: only some of q/k/v_proj are bitsandbytes 4-bit layers "
            f"({[type(p).__name__ for p in projs]}); the fused block takes all dense or all 4-bit")
    quantized = all(quantized)
    n_rows = [p.out_features if quantized else p.weight.shape[0] for p in projs]
    q_per_head = 2 * d if arch.q_gate else d
    if arch.joined is not None:  # [Q | K | V] in one Linear: the heads from the config
        hq, hkv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
        if not (isinstance(hq, int) and isinstance(hkv, int) and hq > 0 and hkv > 0
                and n_rows[0] == hq * q_per_head + 2 * hkv * d):
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {what}: {arch.joined} has {n_rows[0]} rows; expected (num_attention_heads + 2 * "
                f"num_key_value_heads) * head_dim = ({hq} + 2 * {hkv}) * {d} from the config, rows [Q | K | V]")
        q_rows, k_rows = hq * q_per_head, hkv * d
    else:
        q_rows, k_rows = n_rows[0], n_rows[1]
    if q_rows % q_per_head or k_rows % d or (arch.joined is None and any(n != k_rows for n in n_rows[2:])):
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {what}: q/k/v_proj have {n_rows} rows; expected "
            f"multiples of {q_per_head} (q" + (": [q | gate] per head" if arch.q_gate else "")
            + f") and {d} (k, v) with k and v equal")
    hq, hkv = q_rows // q_per_head, k_rows // d
    if hq < 1 or hkv < 1 or hq % hkv:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {what}: num_heads={hq} (q_proj rows) is not a multiple of "
                                    f"num_kv_heads={hkv} (k_proj rows)")
    ws = [p.weight for p in projs]
    if quantized:  # the packed weights: their device; the dequantized dtype is the block's, per call
        if len({w.device for w in ws}) != 1 or any(w.requires_grad for w in ws):
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: the 4-bit q/k/v_proj weights are on different "
                                        f"devices or require grad ({[(str(w.device), w.requires_grad) for w in ws]})")
    elif len({(w.dtype, w.device, w.requires_grad) for w in ws}) != 1:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}: q/k/v_proj weights differ in dtype, device or requires_grad "
            f"({[(str(w.dtype), str(w.device), w.requires_grad) for w in ws]}); one fused parameter needs one")
    biases = [p.bias for p in projs]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: only some of q/k/v_proj have a bias")
    if biases[0] is not None and (len({(b.dtype, b.device, b.requires_grad) for b in biases}) != 1
                                  or biases[0].device != ws[0].device
                                  or (not quantized and biases[0].dtype != ws[0].dtype)):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: the q/k/v_proj biases differ in dtype, device or "
                                    f"requires_grad from each other, or in dtype/device from the weights")
    eps = _norms_eps(path, attn, arch, d, hq, hkv)
    off = arch.norm_weight_offset
    if arch.model_type == "olmoe" and getattr(cfg, "clip_qkv", None) is not None:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {what}: clip_qkv={cfg.clip_qkv} clamps q/k/v between the "
                                    f"norm and RoPE; the fused block does not")
    if arch.shared_kv is not None and "shared_kv_states" not in inspect.signature(type(attn).forward).parameters:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {what}: this transformers ({_tf_version()}) shares KV between layers through the "
            f"cache; fusedqkv follows the shared_kv_states argument of newer releases (5.17 tested)")
    fused_class(type(attn))  # checks the forward's KV-cache convention
    opts = [("qk_norm_position", arch.qk_norm_position), ("norm_weight_offset", off)]
    # the new switches only where used, so that the families of the original block need nothing more
    for key, value, default in (("q_gate", arch.q_gate, False), ("rope_style", arch.rope_style, "neox"),
                                ("norm_scope", scope, "head"), ("v_norm", arch.v_norm is not None, False),
                                ("k_eq_v", k_eq_v, False)):
        if value != default:
            opts.append((key, value))
    f8 = [name for name, p in zip(names, projs) if _is_float8_linear(p)]
    if f8:  # torchao's convert_to_float8_training before apply_to: the fused projection runs their recipe
        if len(f8) != len(projs):
            others = ", ".join(f"{name} ({'a torchao MX training layer' if _is_torchao_mx(p) else type(p).__name__})"
                               for name, p in zip(names, projs) if name not in f8)
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: {', '.join(f8)} are torchao Float8Linear layers "
                                        f"and the others of {', '.join(names)} are not: {others}; one fused GEMM, "
                                        f"one recipe")
        try:
            recipes = {recipe_of_torchao_config(p.config, f"{path}.{name}") for name, p in zip(names, projs)}
        except ValueError as e:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {e}") from None
        if len(recipes) != 1:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: the Float8Linear layers of {', '.join(names)} "
                                        f"have different float8 configs; one fused GEMM, one recipe")
        opts.append(("fp8", recipes.pop()))
    mx = [name for name, p in zip(names, projs) if _is_torchao_mx(p)]
    if mx:  # torchao's MX training (MXFP8Linear, or quantize_'s wrapped weights) before apply_to: its recipe
        if f8 or len(mx) != len(projs):
            others = [name for name in names if name not in mx]
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: {', '.join(mx)} are torchao MX training layers "
                                        f"and {', '.join(others)} are not; one fused GEMM, one recipe")
        try:
            recipes = {name: recipe_of_torchao_mx_config(torchao_mx_config(p), f"{path}.{name}")
                       for name, p in zip(names, projs)}
        except ValueError as e:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {e}") from None
        if len(set(recipes.values())) != 1:
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path}: the torchao MX training layers of {', '.join(names)} have different "
                f"configs ({', '.join(f'{n}: {r.key}' for n, r in recipes.items())}); one fused GEMM, one recipe")
        opts.append(("fp8", recipes[names[0]]))
    split = tuple(n_rows)
    norms = tuple(n for n in (arch.q_norm, arch.k_norm, arch.v_norm) if n is not None)
    return FusedSpec(hq, hkv, d, eps, names, split, dict(opts), k_eq_v, tuple(attn._modules), quantized,
                     FUSED_NAME_OVER_JOINED if arch.joined is not None else FUSED_NAME, norms)


def _keep_hf_init_flags(module: nn.Module, sources) -> None:
    """HF's ``_is_hf_initialized`` on ``module`` (and on its own parameters) where every source module
    (and its parameter of the same name) carries it: ``init_weights()``/``post_init()`` initializes
    only what is not flagged, so without them it would draw a loaded model's q/k/v weights again."""
    if all(getattr(m, "_is_hf_initialized", False) for m in sources):
        module._is_hf_initialized = True
    for name, p in module._parameters.items():
        if p is not None and all(getattr(getattr(m, name, None), "_is_hf_initialized", False) for m in sources):
            p._is_hf_initialized = True


def _keeps_hf_parameters(projs) -> bool:
    """Whether the fused projection takes the projections' own parameters (HF's joined projection,
    ``Arch.joined``: one plain Linear) rather than a copy of their weights joined."""
    return len(projs) == 1 and all(type(mx_plain(t)) in (nn.Parameter, type(None))
                                   for t in (projs[0].weight, projs[0].bias))


# the kinds of tensor hook and the tensor attributes that hold them
_TENSOR_HOOK_KINDS = (("gradient hook (register_hook)", "_backward_hooks"),
                      ("post-accumulate-grad hook", "_post_accumulate_grad_hooks"))


def _check_copyable(path: str, attn: nn.Module, spec: FusedSpec, names_of: dict) -> None:
    """Refuse q/k/v weights or biases that a copy would not stand for: the fused parameter is a copy of
    them (:func:`_fuse`). One tied to another parameter slot of the model (the same module or tensor in two
    layers, or elsewhere) would have each fused layer train its own; one carrying tensor hooks
    (``register_hook``, ``register_post_accumulate_grad_hook``) would have them never run. Where HF's joined
    projection's parameters become the fused ones (no copy), or 4-bit layers stay as they are, nothing is
    refused."""
    if spec.quantized:
        return
    projs = [_base_linear(attn._modules[name]) for name in spec.projs]
    if _keeps_hf_parameters(projs):
        return
    for name, p in zip(spec.projs, projs):
        for kind in ("weight", "bias"):
            t = getattr(p, kind)
            if t is None:
                continue
            names = names_of.get(id(t), ())
            if len(names) > 1:
                raise UnsupportedModelError(
                    f"fusedqkv.apply_to: {path}.{name}.{kind} is tied: it is the one tensor of {', '.join(names)}; "
                    f"the fused projection holds a copy of q/k/v's weights, so the tie would be broken and each "
                    f"fused layer would train its own")
            hooks = [what for what, attr in _TENSOR_HOOK_KINDS if getattr(t, attr, None)]
            if hooks:
                raise UnsupportedModelError(
                    f"fusedqkv.apply_to: {path}.{name}.{kind} has a {' and a '.join(hooks)}; the fused projection "
                    f"holds a copy of q/k/v's weights, so it would never run. Register it on the fused parameter "
                    f"(qkv_proj.{kind}) after apply_to")


# The q/k/v parameters apply_to replaced by a fused one stay in any optimizer made before it, where they never get
# a gradient again while the fused parameter, absent from that optimizer, never steps (and its gradient, never
# zeroed, grows): q/k/v silently stop training. Each trainable one is marked with the fused parameter's name, and
# one global optimizer step pre-hook (torch's public API) refuses an optimizer holding a marked parameter. An
# optimizer is looked through once per apply_to and per change of its parameter groups.
_REPLACED_BY = "_fusedqkv_replaced_by"
_replacements = 0  # apply_to calls that marked parameters: an optimizer checked before one is checked again
_optimizers_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_optimizer_hook = None


def _retire(params: list, fused_name: str) -> None:
    """Mark the trainable ``(name, parameter)`` pairs that ``fused_name`` replaced (see above)."""
    global _replacements, _optimizer_hook
    marked = False
    for name, p in params:
        if p is not None and p.requires_grad:
            setattr(p, _REPLACED_BY, (name, fused_name))
            marked = True
    if marked:
        _replacements += 1
        if _optimizer_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs) -> None:
    compiling = torch.compiler.is_compiling()  # traced: looked through as the step is traced (no weakref cache)
    shape = None if compiling else (_replacements, tuple(len(g["params"]) for g in optimizer.param_groups))
    if shape is not None and _optimizers_checked.get(optimizer) == shape:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            replaced = getattr(p, _REPLACED_BY, None)
            if replaced is not None:
                raise UnsupportedModelError(
                    f"fusedqkv: {type(optimizer).__name__} holds {replaced[0]}, which fusedqkv.apply_to replaced by "
                    f"{replaced[1]}: that parameter would never get a gradient again and the fused one would never "
                    f"step. Create the optimizer after apply_to")
    if shape is not None:
        _optimizers_checked[optimizer] = shape


def _fuse(attn: nn.Module, spec: FusedSpec, path: str = "") -> None:
    """Patch one validated attention module in place: ``qkv_proj`` (the joined weights) before
    q_proj, and q/k/v_proj as rows of it (a PEFT LoRA layer there keeps its adapters, over the rows).
    4-bit q/k/v stay as they are (no fused parameter: each forward dequantizes them; their state
    dict is bitsandbytes' own, so no state-dict hooks)."""
    if spec.quantized:
        attn._fusedqkv = spec
        attn.__class__ = fused_class(type(attn))
        return
    slots = [attn._modules[name] for name in spec.projs]
    projs = [_base_linear(m) for m in slots]
    q = projs[0]
    ws = [mx_plain(p.weight) for p in projs]
    biases = [mx_plain(p.bias) for p in projs]
    has_bias = biases[0] is not None
    # the fused projection; no init (its values are the joined weights)
    if _keeps_hf_parameters(projs):
        # HF's joined projection (Arch.joined): its parameters become the fused ones (an optimizer made before
        # apply_to still holds what trains)
        weight, bias = ws[0], biases[0]
    else:
        with torch.no_grad():
            # (requires_grad the parameters': an MX-wrapped one's plain tensor has none)
            weight = nn.Parameter(torch.cat(ws, 0), requires_grad=projs[0].weight.requires_grad)
            bias = nn.Parameter(torch.cat(biases, 0), requires_grad=projs[0].bias.requires_grad) if has_bias else None
        prefix = f"{path}." if path else ""
        for part in ("weight", "bias"):
            _retire([(f"{prefix}{name}.{part}", getattr(p, part)) for name, p in zip(spec.projs, projs)],
                    f"{prefix}{spec.fused_name}.{part}")
    proj = FusedQKVProjection(weight, bias, spec.split)
    proj.train(q.training)
    _keep_hf_init_flags(proj, projs)
    rows, start = {}, 0
    for name, slot, base, n in zip(spec.projs, slots, projs, spec.split):
        r = ProjectionRows(proj, start, start + n)
        r.train(base.training)
        _keep_hf_init_flags(r, (base,))
        if slot is not base:  # a PEFT LoRA layer: its adapters stay, over the rows
            slot._modules["base_layer"] = r
            r = slot
        rows[name] = r
        start += n
    modules = OrderedDict()
    for name, m in attn._modules.items():
        if name == spec.projs[0]:
            modules[spec.fused_name] = proj
        modules[name] = rows.get(name, m)
    attn._modules.clear()
    attn._modules.update(modules)
    attn._fusedqkv = spec
    attn.__class__ = fused_class(type(attn))
    _register_hooks(attn)


def _data_parallel_wrappers() -> tuple:
    """The wrappers that keep their own record of the model's parameters when they wrap it: DDP (its
    reducer's buckets) and FSDP1 (its flat parameters). FSDP2 shards in place (DTensor weights: refused
    as such)."""
    if not torch.distributed.is_available():
        return ()
    from torch.nn.parallel import DistributedDataParallel

    wrappers = [DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        wrappers.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - a torch without FSDP1
        pass
    return tuple(wrappers)


def _check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model inside DDP or FSDP1: they registered q/k/v's weights when they wrapped it, and the
    fused weight apply_to makes would never reach them -- under DDP its gradient is not all-reduced, so
    each rank would train its own q/k/v (with ``find_unused_parameters=True``, HF Trainer's default,
    without a word)."""
    wrappers = _data_parallel_wrappers()
    for path, m in model.named_modules():
        if isinstance(m, wrappers):
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path or 'model'} is a {type(m).__name__}, which recorded the q/k/v weights "
                f"when it wrapped the model; the fused weight apply_to makes would not be synchronised across "
                f"ranks. Call apply_to on the model before wrapping it (model = DDP(model) after apply_to)")


def _supported_classes() -> dict:
    """HF attention class -> Arch, for the modeling modules already imported (a model that
    contains one has imported it)."""
    out = {}
    for a in SUPPORTED:
        mod = sys.modules.get(a.modeling)
        cls = getattr(mod, a.attention, None) if mod is not None else None
        if cls is not None:
            out[cls] = a
    return out


def apply_to(model: nn.Module, *, fp8=None) -> int:
    """Fuse the attention input blocks (q/k/v projection + RoPE + RMSNorm of q and k) of a
    built ``transformers`` model in place; returns the number of attention layers fused by
    this call (0 when called again on a fused model).

    Hybrid models (Qwen3-Next, Qwen3.5, OLMo-Hybrid...) have their attention layers fused and
    their linear-attention layers left as they are; layers that have no block to fuse stay
    HF's too (KV-shared layers of Gemma 3n / 4, Llama 4's NoPE layers without a QK norm).

    Call it before creating the optimizer (the projection weights become one new parameter,
    ``<attention>.qkv_proj.weight``) and before wrapping the model (DDP/FSDP,
    ``torch.compile``); PEFT LoRA may come before or after. ``state_dict()`` keeps HF's keys and
    values; ``load_state_dict`` takes HF state dicts. On a model loaded 4-bit (bitsandbytes
    ``Linear4bit`` q/k/v: QLoRA) the projections stay as they are, no new parameter, and each
    forward dequantizes them into the fused layout (:mod:`fusedqkv.integrations.qlora`). Raises :class:`UnsupportedModelError` (a ``ValueError``) naming the
    architecture, module or setting that cannot be fused, before changing anything.

    ``fp8``: the fused projections' GEMMs in FP8 with torchao's recipe of that name
    (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, and MX on Blackwell: ``"mxfp8"``,
    ``"mxfp8_rceil"``; see :func:`fusedqkv.gqa_qkv_rope_qk_norm`). torchao's
    ``convert_to_float8_training`` after ``apply_to`` turns q/k/v_proj into ``Float8Linear`` layers
    over the fused rows: the fused block then runs their recipe (the three must agree). torchao's MX
    training (0.18: ``MXFP8TrainingOpConfig``) likewise: q/k/v_proj as ``MXFP8Linear`` layers or with
    weights ``quantize_`` wrapped before ``apply_to``, or ``quantize_`` over ``qkv_proj`` after it
    (a ``filter_fn`` that takes ``qkv_proj``: it is no ``nn.Linear``), give the block their recipe
    (:func:`fusedqkv.ops.fp8.recipe_of_torchao_mx_config`: RCEIL ``"mxfp8_rceil"``, FLOOR ``"mxfp8"``).
    """
    recipe = fp8_recipe(fp8)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if "transformers" not in sys.modules:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {type(model).__name__} is not a Hugging Face transformers model (transformers is "
            f"not imported; from the clone: pip install -e '.[transformers]')")
    classes = _supported_classes()
    fused_types = set(_FUSED_CLASSES.values())
    todo, skipped, already = [], [], []
    for path, m in model.named_modules():
        if type(m) in fused_types:
            already.append((path or type(model).__name__, m))
        elif type(m) in classes:
            arch = classes[type(m)]
            path = path or type(model).__name__
            reason = arch.skip(m) if arch.skip is not None else None
            if reason is None:
                todo.append((path, m, arch))
            else:
                skipped.append((path, arch, reason))
    if todo:
        _check_not_wrapped(model)
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    name = f"{type(model).__name__}" + (f" (model_type {mt!r})" if mt else "")
    if not todo and not already:
        if skipped:
            path, arch, reason = skipped[0]
            raise UnsupportedModelError(f"fusedqkv.apply_to: {name}: no attention layer can be fused; "
                                        f"{arch.model_type} {path}: {reason}")
        types = {getattr(c, "model_type", None) for c in (cfg, getattr(cfg, "get_text_config", lambda: None)())}
        why = next((UNSUPPORTED[t] for t in types if t in UNSUPPORTED), None)
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: unsupported architecture {name}"
            + (f": {why}" if why else "")
            + f"; it has no attention module of a supported family: {_supported_names()}")
    if recipe is not None:  # a fused layer keeps the recipe it was fused with: another one asked for is refused
        for path, m in already:
            had = m._fusedqkv.block_kwargs.get("fp8")
            if had != recipe:
                raise UnsupportedModelError(
                    f"fusedqkv.apply_to: {name} {path} is already fused "
                    + (f"with fp8={had.key!r}" if had is not None else "without fp8 (16-bit GEMMs)")
                    + f"; fp8={recipe.key!r} would not reach it (apply_to fuses once: give fp8= at the first call)")
    # all checks first (nothing changes when one module cannot be fused), then the patch
    specs = [_validate(path, m, arch) for path, m, arch in todo]
    if todo:
        names_of: dict = {}
        for pname, param in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(pname)
        for (path, m, _), spec in zip(todo, specs):
            _check_copyable(path, m, spec, names_of)
    if recipe is not None:
        for (path, m, arch), spec in zip(todo, specs):
            if arch.no_fp8 is not None:
                raise UnsupportedModelError(f"fusedqkv.apply_to: {name} {path}: fp8={recipe.key!r}: {arch.no_fp8}")
            if spec.quantized:
                raise UnsupportedModelError(f"fusedqkv.apply_to: {name} {path}: fp8={recipe.key!r} with bitsandbytes "
                                            f"4-bit q/k/v; FP8 GEMMs over dequantized 4-bit weights are not built")
            rows = sum(spec.split)  # (k_eq_v: [Q | K])
            try:  # the sizes only: the device is checked where the block runs
                fp8_check_supported(torch.device("cpu"), getattr(m, spec.projs[0]).in_features, rows, recipe,
                                    sizes_only=True)
            except ValueError as e:
                raise UnsupportedModelError(f"fusedqkv.apply_to: {name} {path}: {e}") from None
            had = spec.block_kwargs.get("fp8")
            if had is not None and had != recipe:
                raise UnsupportedModelError(f"fusedqkv.apply_to: {name} {path}: fp8={recipe.key!r} but q/k/v_proj are "
                                            f"torchao Float8Linear or MX training layers of the recipe {had.key!r}")
            spec.block_kwargs["fp8"] = recipe
    for (path, m, _), spec in zip(todo, specs):
        _fuse(m, spec, "" if path == type(model).__name__ else path)
    return len(todo)


__all__ = ["apply_to", "UnsupportedModelError", "UnsupportedModuleError", "SUPPORTED", "UNSUPPORTED", "fused_class"]
