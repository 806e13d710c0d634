"""``fusedqkv.apply_to(model)``: the fused attention input block in a built Hugging Face model.

For every supported attention module of the model it

* joins ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` (an ``nn.Linear`` whose weight
  rows are ``[Q | K | V]``, with the biases where the config has them), in ``q_proj``'s place;
* swaps the module's class for a subclass whose ``forward`` computes q, k, v with
  :func:`fusedqkv.gqa_qkv_rope_qk_norm` (projection + RoPE + per-head RMSNorm, one GEMM and
  one fused kernel forward, the fused backward) and hands them to the model's own KV cache
  and attention backend (eager/sdpa/flash...) exactly as the original forward does;
* registers state-dict hooks so that ``state_dict()`` holds HF's ``q_proj``/``k_proj``/
  ``v_proj`` keys and values (and ``load_state_dict`` of an HF state dict merges them), so
  ``save_pretrained`` writes an ordinary HF checkpoint.

The attention module itself, its ``o_proj`` and norm modules (whose weights the fused block
reads; Liger-Kernel may patch their forward) stay the objects the model references.

Supported (``SUPPORTED``): Qwen3, Qwen3-MoE (RMSNorm before RoPE), HunYuan dense V1 (RMSNorm
after RoPE) and Gemma3 text (before RoPE, weights in the form ``1 + w``), each with or without
q/k/v biases (``attention_bias``). Anything else raises :class:`UnsupportedModelError` naming
what is unsupported.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from ..autograd import gqa_qkv_rope_qk_norm

_MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnsupportedModelError(ValueError):
    """The model, one of its attention modules or its configuration cannot be fused."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """What one architecture's attention computes, read from its HF source."""

    model_type: str
    modeling: str            # module of the attention class
    attention: str           # attention class name
    norm_class: str          # the per-head RMSNorm class of q and k
    q_norm: str              # attribute names of the q/k norm modules
    k_norm: str
    qk_norm_position: str    # "before_rope" or "after_rope"
    norm_weight_offset: float  # the norm scales by offset + weight
    passes_sliding_window: bool  # the original forward hands sliding_window to the backend


SUPPORTED = (
    Arch("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", "Qwen3RMSNorm",
         "q_norm", "k_norm", "before_rope", 0.0, True),
    Arch("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention", "Qwen3MoeRMSNorm",
         "q_norm", "k_norm", "before_rope", 0.0, True),
    Arch("hunyuan_v1_dense", "transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense",
         "HunYuanDenseV1Attention", "HunYuanDenseV1RMSNorm", "query_layernorm", "key_layernorm", "after_rope", 0.0,
         False),
    Arch("gemma3_text", "transformers.models.gemma3.modeling_gemma3", "Gemma3Attention", "Gemma3RMSNorm",
         "q_norm", "k_norm", "before_rope", 1.0, True),
)


def _supported_names() -> str:
    return ", ".join(f"{a.model_type} ({a.attention})" for a in SUPPORTED)


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Per fused module: the sizes and the block's options."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    q_norm: str
    k_norm: str
    qk_norm_position: str
    norm_weight_offset: float

    @property
    def split(self) -> tuple[int, int, int]:
        d = self.head_dim
        return self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d


_PROJ = ("q_proj", "k_proj", "v_proj")
FUSED_NAME = "qkv_proj"


# --------------------------------------------------------------------------- the fused forward


class _FusedAttention:
    """Mixin placed before the HF attention class: ``forward`` with the fused input block.

    Class attributes set per architecture by :func:`fused_class`: ``_fusedqkv_arch``,
    ``_fusedqkv_modeling`` (the HF modeling module: its ``eager_attention_forward`` and
    ``ALL_ATTENTION_FUNCTIONS`` are looked up per call, as the original forward does).
    Instance attribute: ``_fusedqkv`` (:class:`FusedSpec`)."""

    def _fusedqkv_qkv(self, hidden_states, position_embeddings):
        spec: FusedSpec = self._fusedqkv
        cos, sin = position_embeddings
        proj = self.qkv_proj
        w, b = proj.weight, proj.bias
        # under autocast the block casts its inputs as HF's Linear would (gqa_qkv_rope_qk_norm)
        return gqa_qkv_rope_qk_norm(
            hidden_states, w, getattr(self, spec.q_norm).weight, getattr(self, spec.k_norm).weight, cos, sin,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, eps=spec.eps,
            qk_norm_position=spec.qk_norm_position, qkv_bias=b, norm_weight_offset=spec.norm_weight_offset)

    def _fusedqkv_attend(self, query, key, value, attention_mask, input_shape, kwargs):
        modeling = self._fusedqkv_modeling
        functions = modeling.ALL_ATTENTION_FUNCTIONS
        impl = self.config._attn_implementation
        eager = modeling.eager_attention_forward
        if hasattr(functions, "get_interface"):
            interface = functions.get_interface(impl, eager)
        else:  # transformers 5.0
            interface = eager if impl == "eager" else functions[impl]
        if self._fusedqkv_arch.passes_sliding_window:
            kwargs["sliding_window"] = self.sliding_window
        attn_output, attn_weights = interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def extra_repr(self) -> str:
        s: FusedSpec = self._fusedqkv
        return (f"fusedqkv: qkv_proj + {s.qk_norm_position.replace('_', ' ')} RMSNorm (num_heads={s.num_heads}, "
                f"num_kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, eps={s.eps}"
                + (f", norm_weight_offset={s.norm_weight_offset}" if s.norm_weight_offset else "") + ")")


# Three KV-cache conventions of transformers 5.x's attention forwards (the rest of the
# forward is the same in all): picked per class from the original forward's signature.


def _forward_past_key_values(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs):
    # transformers 5.1 - 5.2x: cache.update(k, v, layer_idx)
    query, key, value = self._fusedqkv_qkv(hidden_states, position_embeddings)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    return self._fusedqkv_attend(query, key, value, attention_mask, hidden_states.shape[:-1], kwargs)


def _forward_cache_position(self, hidden_states, position_embeddings=None, attention_mask=None,
                            past_key_values=None, cache_position=None, **kwargs):
    # transformers 5.0: cache.update(k, v, layer_idx, {sin, cos, cache_position})
    query, key, value = self._fusedqkv_qkv(hidden_states, position_embeddings)
    if past_key_values is not None:
        cos, sin = position_embeddings
        key, value = past_key_values.update(key, value, self.layer_idx,
                                            {"sin": sin, "cos": cos, "cache_position": cache_position})
    return self._fusedqkv_attend(query, key, value, attention_mask, hidden_states.shape[:-1], kwargs)


def _forward_cache(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    # newer 5.x: the argument is ``cache`` (``past_key_values`` deprecated), update(..., kwargs=)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    query, key, value = self._fusedqkv_qkv(hidden_states, position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    return self._fusedqkv_attend(query, key, value, attention_mask, hidden_states.shape[:-1], kwargs)


def _cache_convention(cls):
    params = inspect.signature(cls.forward).parameters
    if "cache" in params:
        return _forward_cache
    if "cache_position" in params:
        return _forward_cache_position
    if "past_key_values" in params:
        return _forward_past_key_values
    raise UnsupportedModelError(
        f"fusedqkv.apply_to: {cls.__name__}.forward{inspect.signature(cls.forward)} has no KV-cache argument this "
        f"integration knows (past_key_values / cache); transformers {_tf_version()} is not supported")


_FUSED_CLASSES: dict = {}


def fused_class(cls: type) -> type:
    """The fused subclass of an HF attention class (one per class; it lives in this module
    under ``FusedQKV<Name>`` so that a pickled model finds it again)."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is not None:
        return fused
    arch = next(a for a in SUPPORTED if a.attention == cls.__name__ and a.modeling == cls.__module__)
    name = "FusedQKV" + cls.__name__
    fused = type(name, (_FusedAttention, cls), {
        "__module__": __name__, "__qualname__": name, "forward": _cache_convention(cls),
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


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """``qkv_proj.weight``/``.bias`` -> HF's ``q_proj``/``k_proj``/``v_proj`` entries, in HF's
    key order (the module's keys are the tail of ``state_dict`` when this runs)."""
    fused_w, fused_b = prefix + FUSED_NAME + ".weight", prefix + FUSED_NAME + ".bias"
    if fused_w not in state_dict:
        return
    tail = []
    for key in reversed(state_dict):
        if not key.startswith(prefix):
            break
        tail.append(key)
    tail.reverse()
    items = [(key, state_dict.pop(key)) for key in tail]
    sizes = module._fusedqkv.split
    for key, value in items:
        if key == fused_b:
            continue
        if key != fused_w:
            state_dict[key] = value
            continue
        bias = dict(items).get(fused_b)
        # copies: views of one storage would be taken for tied weights by save_pretrained
        for name, w_part, b_part in zip(_PROJ, value.detach().split(sizes),
                                        bias.detach().split(sizes) if bias is not None else (None,) * 3):
            state_dict[f"{prefix}{name}.weight"] = w_part.clone()
            if b_part is not None:
                state_dict[f"{prefix}{name}.bias"] = b_part.clone()
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None and (prefix + FUSED_NAME) in meta:
        version = meta.pop(prefix + FUSED_NAME)
        for name in _PROJ:
            meta[prefix + name] = dict(version)


def _load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
    """HF's ``q_proj``/``k_proj``/``v_proj`` entries -> ``qkv_proj.weight``/``.bias`` (a part
    that is absent keeps the current value and is reported missing)."""
    proj = module._modules[FUSED_NAME]
    sizes = module._fusedqkv.split
    for suffix in ("weight", "bias"):
        names = [f"{prefix}{p}.{suffix}" for p in _PROJ]
        if not any(n in state_dict for n in names):
            continue
        param = getattr(proj, suffix)
        if param is None:
            continue  # no bias here: torch reports the keys as unexpected
        parts, ok = [], True
        current = param.detach().split(sizes)
        for n, cur in zip(names, current):
            if n not in state_dict:
                missing_keys.append(n)
                parts.append(cur)
                continue
            t = state_dict.pop(n)
            if tuple(t.shape) != tuple(cur.shape):
                error_msgs.append(f"size mismatch for {n}: copying a param with shape {tuple(t.shape)} from "
                                  f"checkpoint, the shape in current model is {tuple(cur.shape)}.")
                ok = False
                continue
            parts.append(t.to(device=cur.device, dtype=cur.dtype))
        if ok:
            state_dict[f"{prefix}{FUSED_NAME}.{suffix}"] = torch.cat(parts, 0)


def _register_hooks(module: nn.Module) -> None:
    post = getattr(module, "register_state_dict_post_hook", None)
    if post is not None:
        post(_state_dict_hook)
    else:  # older torch
        module._register_state_dict_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


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


def _check_norm(path: str, norm, arch: Arch, head_dim: int) -> float:
    if not isinstance(norm, nn.Module):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path} is missing (expected a {arch.norm_class})")
    cls = type(norm).__name__
    if cls not in (arch.norm_class, "LigerRMSNorm"):
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path} is a {cls}; the fused block computes {arch.norm_class} "
            f"(or Liger-Kernel's LigerRMSNorm) only")
    bound = norm.__dict__.get("forward")
    if bound is not None and getattr(getattr(bound, "__func__", None), "__qualname__", "") != "LigerRMSNorm.forward":
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}.forward was replaced by {getattr(bound, '__qualname__', bound)!r}; the fused "
            f"block would not compute it")
    offset = getattr(norm, "offset", None)  # Liger's RMSNorm (and its patch of HF norms)
    if offset is not None and float(offset) != arch.norm_weight_offset:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path} scales by {offset} + weight; {arch.model_type} expects "
            f"{arch.norm_weight_offset} + weight")
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (head_dim,):
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}.weight has shape {shape}; the fused block needs a per-head norm, "
            f"weight [head_dim] = [{head_dim}]")
    eps = _norm_eps(norm)
    if eps is None:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path} has no variance_epsilon/eps")
    return eps


def _validate(path: str, attn: nn.Module, arch: Arch) -> FusedSpec:
    """Every check of one attention module; raises before anything changes."""
    if "forward" in attn.__dict__:
        f = attn.__dict__["forward"]
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}.forward was replaced by {getattr(f, '__qualname__', f)!r} (another patch or "
            f"an accelerate hook); the fused block would drop it")
    cfg = attn.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    what = f"{path} ({type(attn).__name__}, model_type {getattr(cfg, 'model_type', '?')!r})"
    if not (isinstance(d, int) and d % 2 == 0 and 0 < d <= _MAX_HEAD_DIM):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {what}: head_dim={d}; the fused block needs an even "
                                    f"head_dim <= {_MAX_HEAD_DIM}")
    if hq < 1 or hkv < 1 or hq % hkv:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {what}: num_attention_heads={hq} is not a multiple of "
                                    f"num_key_value_heads={hkv}")
    projs = []
    for name, rows in zip(_PROJ, (hq * d, hkv * d, hkv * d)):
        p = attn._modules.get(name)
        if p is None:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path} has no {name}")
        if type(p) is not nn.Linear:
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path}.{name} is a {type(p).__name__}; only a plain torch.nn.Linear can be "
                f"fused (apply fusedqkv before wrapping projections: LoRA, quantization, tensor parallel)")
        w = p.weight
        if type(w.data) is not torch.Tensor or w.is_meta:
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path}.{name}.weight is a {type(w.data).__name__} on {w.device}; the fused "
                f"block needs a materialised dense tensor")
        if w.dtype not in _FLOAT_DTYPES:
            raise UnsupportedModelError(f"fusedqkv.apply_to: {path}.{name}.weight has dtype {w.dtype}; expected "
                                        f"float32, bfloat16 or float16")
        if tuple(w.shape) != (rows, cfg.hidden_size):
            raise UnsupportedModelError(
                f"fusedqkv.apply_to: {path}.{name}.weight has shape {tuple(w.shape)}, expected "
                f"[{rows}, {cfg.hidden_size}] from the config")
        projs.append(p)
    ws = [p.weight for p in projs]
    if len({(w.dtype, w.device, w.requires_grad) for w in ws}) != 1:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {path}: q/k/v_proj weights differ in dtype, device or requires_grad "
            f"({[(str(w.dtype), str(w.device), w.requires_grad) for w in ws]}); one fused parameter needs one")
    biases = [p.bias for p in projs]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: only some of q/k/v_proj have a bias")
    if biases[0] is not None and (len({(b.dtype, b.device, b.requires_grad) for b in biases}) != 1
                                  or (biases[0].dtype, biases[0].device) != (ws[0].dtype, ws[0].device)):
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: the q/k/v_proj biases differ in dtype, device or "
                                    f"requires_grad from each other, or in dtype/device from the weights")
    eps_q = _check_norm(f"{path}.{arch.q_norm}", getattr(attn, arch.q_norm, None), arch, d)
    eps_k = _check_norm(f"{path}.{arch.k_norm}", getattr(attn, arch.k_norm, None), arch, d)
    if eps_q != eps_k:
        raise UnsupportedModelError(f"fusedqkv.apply_to: {path}: the q and k norms have different eps "
                                    f"({eps_q}, {eps_k}); the fused block takes one")
    fused_class(type(attn))  # checks the forward's KV-cache convention
    return FusedSpec(hq, hkv, d, eps_q, arch.q_norm, arch.k_norm, arch.qk_norm_position, arch.norm_weight_offset)


def _fuse(attn: nn.Module, spec: FusedSpec) -> None:
    """Patch one validated attention module in place."""
    projs = [attn._modules[name] for name in _PROJ]
    q = projs[0]
    ws = [p.weight for p in projs]
    biases = [p.bias for p in projs]
    has_bias = biases[0] is not None
    hidden = ws[0].shape[1]
    # the fused projection, in q_proj's place; no init (its values are the three weights)
    with torch.no_grad():
        weight = torch.cat(ws, 0)
        bias = torch.cat(biases, 0) if has_bias else None
    proj = nn.Linear(hidden, weight.shape[0], bias=has_bias, device="meta")
    proj.weight = nn.Parameter(weight, requires_grad=ws[0].requires_grad)
    if has_bias:
        proj.bias = nn.Parameter(bias, requires_grad=biases[0].requires_grad)
    proj.train(q.training)
    modules = OrderedDict()
    for name, m in attn._modules.items():
        if name == "q_proj":
            modules[FUSED_NAME] = proj
        elif name not in ("k_proj", "v_proj"):
            modules[name] = m
    attn._modules.clear()
    attn._modules.update(modules)
    attn._fusedqkv = spec
    attn.__class__ = fused_class(type(attn))
    _register_hooks(attn)


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


def apply_to(model: nn.Module) -> int:
    """Fuse the attention input blocks (q/k/v projection + RoPE + per-head RMSNorm of q and
    k) of a built ``transformers`` model in place; returns the number of attention layers
    fused by this call (0 when called again on a fused model).

    Call it before creating the optimizer (the three projection weights become one new
    parameter, ``<attention>.qkv_proj.weight``) and before wrapping the model (DDP/FSDP,
    ``torch.compile``, PEFT). ``state_dict()`` keeps HF's keys and values; ``load_state_dict``
    takes HF state dicts. Raises :class:`UnsupportedModelError` (a ``ValueError``) naming the
    architecture, module or setting that cannot be fused, before changing anything.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    if "transformers" not in sys.modules:
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: {type(model).__name__} is not a Hugging Face transformers model (transformers is "
            f"not imported; pip install 'fusedqkv[transformers]')")
    classes = _supported_classes()
    fused_types = set(_FUSED_CLASSES.values())
    todo, already = [], 0
    for path, m in model.named_modules():
        if type(m) in fused_types:
            already += 1
        elif type(m) in classes:
            todo.append((path or type(model).__name__, m, classes[type(m)]))
    if not todo and not already:
        cfg = getattr(model, "config", None)
        mt = getattr(cfg, "model_type", None)
        raise UnsupportedModelError(
            f"fusedqkv.apply_to: unsupported architecture {type(model).__name__}"
            + (f" (model_type {mt!r})" if mt else "")
            + f": it has no attention module of a supported architecture: {_supported_names()}")
    # all checks first (nothing changes when one module cannot be fused), then the patch
    specs = [_validate(path, m, arch) for path, m, arch in todo]
    for (_, m, _), spec in zip(todo, specs):
        _fuse(m, spec)
    return len(todo)


__all__ = ["apply_to", "UnsupportedModelError", "SUPPORTED", "fused_class"]
