"""Issues 25 and 38 on the GPU: the attention input block of four Hugging Face families alone -- HF's
own code, eager and under ``torch.compile``, against the same module after ``fusedqkv.apply_to``.

Shapes: one real HF attention module per family, built from transformers' own config class with
the sizes of a released checkpoint's ``config.json`` (``SHAPES``):

  qwen3_5_text  Qwen3.5-27B (Qwen/Qwen3.5-27B): hidden 5120, 24 query / 4 KV heads of 256, gated q
                (q_proj gives [q | gate] per head), partial rotary 0.25 (64 dims; mRoPE sections
                [11, 11, 10] interleaved, theta 1e7), RMSNorm weight 1 + w, eps 1e-6
  olmo3         OLMo-3-7B (allenai/Olmo-3-7B-Instruct): hidden 4096, 32 / 32 heads of 128, RMSNorm over
                all heads' channels of q and of k, rotary theta 5e5 (HF's cos/sin stay fp32), eps 1e-6
  glm4_moe      GLM-4.5 (zai-org/GLM-4.5, 355B-A32B): hidden 5120, 96 / 8 heads of 128, use_qk_norm
                (per head), partial rotary 0.5, q/k/v bias, theta 1e6, eps 1e-5 (GLM-4.5-Air has no
                QK norm: nothing to fuse)
  gemma4_text   a global (full-attention) layer of Gemma 4 31B (google/gemma-4-31B; hidden 5376, 32 heads,
                4 global KV heads of global_head_dim 512 from its model card: issue 38): attention_k_eq_v
                (no v_proj: v is the k projection), RMSNorm weight w on q and k, an unweighted v RMSNorm,
                proportional RoPE (theta 1e6, a quarter of the dims rotated, cos/sin 512 wide), eps 1e-6.
                transformers' Gemma4TextConfig defaults (hidden 2304, 8 / 4 heads, k_eq_v off) are no
                released model's

Providers, each producing what the attention backend consumes (q, k, v and, gated, the gate):

  hf_eager    the HF forward's input part as its modeling code writes it (``*_input_part`` below:
              the q/k/v projections, views, the gate chunk, q_norm/k_norm, the family's own
              ``apply_rotary_pos_emb``); checked first to equal what HF's own forward hands its
              attention backend (and, gated, its sigmoid(gate))
  hf_compile  ``torch.compile(fullgraph=True, dynamic=False)`` of that function
  fusedqkv    the module after ``fusedqkv.apply_to``, called as the integration calls it
              (``_fusedqkv_qkv(hidden_states, position_embeddings)``)
  floor       the block's GEMMs alone through ``torch.mm`` (forward 1 GEMM; fwd+bwd 3: y, dX, dW)

Modes: ``forward`` (grad enabled: it saves what the backward needs) and ``fwd+bwd``
(``torch.autograd.grad`` w.r.t. hidden_states, the projection weights and biases, and the norm
weights). Before timing, every row is checked: fusedqkv in fp32 against HF in fp32 (max |diff|
<= 1e-3 max |HF|, TF32 off), and fusedqkv and hf_compile in bf16 against HF's fp32 run by the
three-way rule (max |err| <= 2 max |err of hf_eager bf16| + 1e-3 max |ref|), outputs and every
gradient; a provider that fails is not timed.

Method: each provider's forward and fwd+bwd captured as a CUDA graph (after warm-up calls on a
side stream; every captured input kept alive while the graph lives), the eight graphs replayed
call by call in a rotated order (``timing.time_cuda_events_interleaved``: the H200's clock follows
its recent load), the L2 flushed before each replay, median of --reps CUDA-event times. Token
rows: --tokens (default 1x2048 and 4x2048). Criteria per row and mode: fusedqkv at least as fast
as hf_compile, and at least 2x faster than hf_eager.

Device (H200; ~4 minutes estimated, most of it the eight static compiles):

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_families.py --out $OUT/families

Gemma 4's global layer alone (issue 38; ~1 minute):

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_families.py --families gemma4_text --out $OUT/gemma4

CPU check of the script's logic (tiny shapes with the same switches, the torch path, compile with
the aot_eager backend, no CUDA graphs, wall clock: no timing value, criteria not judged):

    PYTHONPATH=src TRITON_INTERPRET=1 python3 benchmarks/bench_families.py --smoke --out /tmp/families

Prints a table last; writes --out/bench_families.json; exits 1 when a check or a criterion fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_module import log, time_cpu_interleaved  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.bench import timing  # noqa: E402
from fusedqkv.ops.internals import raise_compile_limits  # noqa: E402

PROVIDERS = ("hf_eager", "hf_compile", "fusedqkv", "floor")
CHECKED = ("hf_compile", "fusedqkv")  # judged against HF's fp32 run (hf_eager bf16 is the yardstick)
MODES = ("forward", "fwd+bwd")
OUTPUT_NAMES = ("q", "k", "v", "gate")
FP32_RTOL = 1e-3
THREE_WAY_ATOL = 1e-3  # times max |ref|
MIN_EAGER_OVER_FUSED = 2.0
MAX_FUSED_OVER_COMPILE = 1.0
CAPTURE_BACKEND = "fusedqkv_bench_capture"  # an HF attention function that records what it is given


# ------------------------------------------------------------------ HF's input parts (transformers 5.x)
# Each is its family's attention forward from the top to the attention call, line for line;
# check_against_hf_forward proves it against the installed transformers before anything is timed.


def qwen3_5_input_part(self, modeling, hidden_states, cos, sin):
    # Qwen3_5Attention.forward
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states, gate = torch.chunk(
        self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
    )
    gate = gate.reshape(*input_shape, -1)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return query_states, key_states, value_states, gate


def olmo3_input_part(self, modeling, hidden_states, cos, sin):
    # Olmo3Attention.forward
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_norm(self.q_proj(hidden_states))
    key_states = self.k_norm(self.k_proj(hidden_states))
    value_states = self.v_proj(hidden_states)
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return query_states, key_states, value_states


def gemma4_input_part(self, modeling, hidden_states, cos, sin):
    # Gemma4TextAttention.forward (a layer that does not share another's KV)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    query_states = self.q_norm(query_states)
    query_states = modeling.apply_rotary_pos_emb(query_states, cos, sin, unsqueeze_dim=2)
    query_states = query_states.transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape) if self.v_proj is not None else key_states
    key_states = self.k_norm(key_states)
    key_states = modeling.apply_rotary_pos_emb(key_states, cos, sin, unsqueeze_dim=2)
    key_states = key_states.transpose(1, 2)
    value_states = self.v_norm(value_states)
    value_states = value_states.transpose(1, 2)
    return query_states, key_states, value_states


def glm4_moe_input_part(self, modeling, hidden_states, cos, sin):
    # Glm4MoeAttention.forward
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape)
    if self.use_qk_norm:  # main diff from Llama
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return query_states, key_states, value_states


def text_positions(b, s, device):
    return torch.arange(s, device=device).expand(b, s)


def mrope_text_positions(b, s, device):
    # Qwen3_5TextModel hands its rotary embedding 3 rows (t, h, w) of the text positions
    return torch.arange(s, device=device).view(1, 1, s).expand(3, b, s)


@dataclasses.dataclass(frozen=True)
class FamilyShape:
    family: str          # model_type: a row of fusedqkv's SUPPORTED table
    checkpoint: str      # the released model whose config.json gives the sizes
    config_class: str    # transformers' config class
    modeling: str        # transformers.models.<modeling>
    attention: str       # the attention class
    rotary: str          # the rotary embedding class that gives the layer its (cos, sin)
    sizes: dict          # the checkpoint's attention sizes
    tiny: dict           # --smoke sizes, same switches
    switches: dict       # the settings that make the block what it is (rotary, norms, bias)
    input_part: Callable
    positions: Callable = text_positions
    rotary_args: tuple = ()  # extra arguments of the rotary's forward (OLMo 3: the layer type)
    gated: bool = False
    forward_kwargs: Callable = dict  # extra arguments of the attention's forward (Gemma 4: shared_kv_states)


SHAPES = {
    "qwen3_5_text": FamilyShape(
        "qwen3_5_text", "Qwen/Qwen3.5-27B", "Qwen3_5TextConfig", "qwen3_5.modeling_qwen3_5", "Qwen3_5Attention",
        "Qwen3_5TextRotaryEmbedding",
        sizes=dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256),
        tiny=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        switches=dict(rms_norm_eps=1e-6, attention_bias=False, layer_types=["full_attention"],
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        input_part=qwen3_5_input_part, positions=mrope_text_positions, gated=True),
    "olmo3": FamilyShape(
        "olmo3", "allenai/Olmo-3-7B-Instruct", "Olmo3Config", "olmo3.modeling_olmo3", "Olmo3Attention",
        "Olmo3RotaryEmbedding",
        sizes=dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32),
        tiny=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4),
        switches=dict(rms_norm_eps=1e-6, attention_bias=False, layer_types=["full_attention"],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5}}),
        input_part=olmo3_input_part, rotary_args=("full_attention",)),
    "glm4_moe": FamilyShape(
        "glm4_moe", "zai-org/GLM-4.5", "Glm4MoeConfig", "glm4_moe.modeling_glm4_moe", "Glm4MoeAttention",
        "Glm4MoeRotaryEmbedding",
        sizes=dict(hidden_size=5120, num_attention_heads=96, num_key_value_heads=8, head_dim=128),
        tiny=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
        switches=dict(rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
        input_part=glm4_moe_input_part),
    "gemma4_text": FamilyShape(
        "gemma4_text", "google/gemma-4-31B", "Gemma4TextConfig", "gemma4.modeling_gemma4", "Gemma4TextAttention",
        "Gemma4TextRotaryEmbedding",
        sizes=dict(hidden_size=5376, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                   global_head_dim=512, num_global_key_value_heads=4),
        tiny=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=512,
                  num_global_key_value_heads=1),
        switches=dict(rms_norm_eps=1e-6, attention_bias=False, attention_k_eq_v=True, layer_types=["full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                          "rope_theta": 1e6}}),
        input_part=gemma4_input_part, rotary_args=("full_attention",),
        forward_kwargs=lambda: dict(shared_kv_states={})),
}
# the tiny mRoPE sections must add up to the tiny rotary half (32 * 0.25 / 2 = 4)
TINY_SWITCHES = {"qwen3_5_text": dict(rope_parameters=dict(SHAPES["qwen3_5_text"].switches["rope_parameters"],
                                                           mrope_section=[2, 1, 1]))}


# ------------------------------------------------------------------ building


def config_kwargs(shape: FamilyShape, smoke: bool) -> dict:
    """The config's arguments: the checkpoint's sizes (--smoke: tiny ones) and the switches, one layer."""
    kw = dict(shape.switches, **(shape.tiny if smoke else shape.sizes), num_hidden_layers=1)
    if smoke:
        kw.update(TINY_SWITCHES.get(shape.family, {}))
    return kw


def build_config(shape: FamilyShape, smoke: bool):
    import transformers

    return getattr(transformers, shape.config_class)(**config_kwargs(shape, smoke))


@dataclasses.dataclass
class Modules:
    """One family's HF attention module in fp32 and bf16 (the same bf16-representable values) and
    each patched by fusedqkv.apply_to; its rotary embedding."""

    modeling: object
    hf: dict
    fused: dict
    rotary: nn.Module


def build_modules(shape: FamilyShape, config, device, seed=0) -> Modules:
    modeling = importlib.import_module("transformers.models." + shape.modeling)
    torch.manual_seed(seed)
    attn = getattr(modeling, shape.attention)(config, layer_idx=0).to(device)
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):  # norm weights away from their init (ones, or zeros for 1 + w)
            w = getattr(attn, name).weight
            w.add_(torch.empty_like(w).uniform_(-0.5, 0.5))
        for p in attn.parameters():  # every dtype starts from the same values
            p.copy_(p.to(torch.bfloat16).float())
    hf = {torch.float32: attn, torch.bfloat16: copy.deepcopy(attn).to(torch.bfloat16)}
    fused = {}
    for dt, m in hf.items():
        fused[dt] = copy.deepcopy(m)
        n = fusedqkv.apply_to(fused[dt])
        if n != 1:
            raise RuntimeError(f"{shape.family}: fusedqkv.apply_to fused {n} modules, expected 1")
    for m in (*hf.values(), *fused.values()):
        m.train()
    rotary = getattr(modeling, shape.rotary)(config).to(device)
    return Modules(modeling, hf, fused, rotary)


def hf_params(attn) -> dict:
    """The input part's parameters by the fused names: {name: [tensors joined in that order]} (no
    v_proj where v is the k projection: Gemma 4's global layers)."""
    projs = [p for p in (attn.q_proj, attn.k_proj, attn.v_proj) if p is not None]
    out = {"qkv_weight": [p.weight for p in projs]}
    if attn.q_proj.bias is not None:
        out["qkv_bias"] = [p.bias for p in projs]
    out["q_norm_weight"] = [attn.q_norm.weight]
    out["k_norm_weight"] = [attn.k_norm.weight]
    return out


def fused_params(attn) -> dict:
    out = {"qkv_weight": [attn.qkv_proj.weight]}
    if attn.qkv_proj.bias is not None:
        out["qkv_bias"] = [attn.qkv_proj.bias]
    out["q_norm_weight"] = [attn.q_norm.weight]
    out["k_norm_weight"] = [attn.k_norm.weight]
    return out


def flat(params: dict) -> list:
    return [t for ts in params.values() for t in ts]


def joined_grads(params: dict, grads) -> dict:
    """{name: gradient} with HF's q/k/v pieces joined in the fused [Q | K | V] order."""
    it = iter(grads)
    return {name: torch.cat([next(it) for _ in ts]) for name, ts in params.items()}


@dataclasses.dataclass
class Row:
    """One token size: inputs per dtype, and each provider's forward and fwd+bwd callables."""

    x: dict
    cos_sin: dict
    grads: dict
    calls: dict  # provider -> (forward, fwd+bwd)
    keep: list   # everything a captured graph reads


def make_row(shape: FamilyShape, mods: Modules, compiled: Callable, b: int, s: int, device, seed=1) -> Row:
    cfg = mods.hf[torch.float32].config
    g = torch.Generator(device="cpu").manual_seed(seed)
    x16 = torch.randn(b, s, cfg.hidden_size, generator=g).to(device, torch.bfloat16)
    xs = {torch.bfloat16: x16.requires_grad_(), torch.float32: x16.detach().float().requires_grad_()}
    pos = shape.positions(b, s, device)
    cos_sin = {dt: mods.rotary(x, pos, *shape.rotary_args) for dt, x in xs.items()}
    with torch.no_grad():
        shapes = [o.shape for o in shape.input_part(mods.hf[torch.bfloat16], mods.modeling, xs[torch.bfloat16],
                                                    *cos_sin[torch.bfloat16])]
    dy16 = [torch.randn(sh, generator=g).to(device, torch.bfloat16) for sh in shapes]
    grads = {torch.bfloat16: dy16, torch.float32: [t.float() for t in dy16]}

    x, (cos, sin), dy = xs[torch.bfloat16], cos_sin[torch.bfloat16], dy16
    hf, fused = mods.hf[torch.bfloat16], mods.fused[torch.bfloat16]
    hf_leaves, fused_leaves = [x, *flat(hf_params(hf))], [x, *flat(fused_params(fused))]

    def hf_eager():
        return shape.input_part(hf, mods.modeling, x, cos, sin)

    def hf_compile():
        return compiled(x, cos, sin)

    def fused_call():
        return tuple(t for t in fused._fusedqkv_qkv(x, (cos, sin)) if t is not None)

    def with_backward(fwd, leaves):
        def call():
            out = fwd()
            return torch.autograd.grad(out, leaves, [d.view(o.shape) for d, o in zip(dy, out)])
        return call

    # the floor: the same GEMM shapes, nothing else
    x2d = x.detach().reshape(b * s, -1)
    w = fused.qkv_proj.weight.detach()
    dy2d = torch.randn(b * s, w.shape[0], generator=g).to(device, torch.bfloat16)

    def floor_fwd():
        return torch.mm(x2d, w.t())

    def floor_fwd_bwd():
        return torch.mm(x2d, w.t()), torch.mm(dy2d, w), torch.mm(dy2d.t(), x2d)

    calls = {"hf_eager": (hf_eager, with_backward(hf_eager, hf_leaves)),
             "hf_compile": (hf_compile, with_backward(hf_compile, hf_leaves)),
             "fusedqkv": (fused_call, with_backward(fused_call, fused_leaves)),
             "floor": (floor_fwd, floor_fwd_bwd)}
    return Row(xs, cos_sin, grads, calls, [xs, cos_sin, grads, x2d, w, dy2d, hf, fused, compiled])


# ------------------------------------------------------------------ checks


def check_against_hf_forward(shape: FamilyShape, mods: Modules, row: Row) -> dict:
    """hf_eager's outputs against what HF's own forward hands its attention backend (and, gated,
    its sigmoid(gate): the forward's output with the backend returning ones and o_proj the
    identity), bitwise: this script's copy of the input part is the installed transformers'."""
    from transformers import AttentionInterface

    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen.update(q=query, k=key, v=value)
        b, h, s, d = query.shape
        return query.new_ones(b, s, h, d), None

    AttentionInterface.register(CAPTURE_BACKEND, capture)
    probe = copy.deepcopy(mods.hf[torch.bfloat16])
    probe.o_proj = nn.Identity()
    probe.config._attn_implementation = CAPTURE_BACKEND
    x, (cos, sin) = row.x[torch.bfloat16], row.cos_sin[torch.bfloat16]
    with torch.no_grad():
        out, _ = probe(x, (cos, sin), None, **shape.forward_kwargs())
        ours = shape.input_part(mods.hf[torch.bfloat16], mods.modeling, x, cos, sin)
    theirs = [seen["q"], seen["k"], seen["v"]] + ([out] if shape.gated else [])
    mine = list(ours[:3]) + ([torch.sigmoid(ours[3])] if shape.gated else [])
    diffs = {n: float((a.float() - t.float()).abs().max()) for n, a, t in zip(OUTPUT_NAMES, mine, theirs)}
    return {"bitwise_equal": all(torch.equal(a, t) for a, t in zip(mine, theirs)), "max_abs_diff": diffs}


def run_fwd_bwd(call_fwd, leaves_params: dict, x, dy) -> dict:
    """Outputs and gradients by name (HF's q/k/v parameter gradients joined as the fused ones)."""
    out = call_fwd()
    out = [o for o in out if o is not None]
    # fusedqkv's gate is [..., heads, head_dim] (a view of the projection output), HF's [..., heads *
    # head_dim]: the gradients in each output's shape, the outputs compared in HF's
    gs = torch.autograd.grad(out, [x, *flat(leaves_params)], [d.view(o.shape) for d, o in zip(dy, out)])
    res = {n: o.detach().reshape(d.shape) for n, o, d in zip(OUTPUT_NAMES, out, dy)}
    res["grad_x"] = gs[0]
    res.update({"grad_" + k: v for k, v in joined_grads(leaves_params, gs[1:]).items()})
    return res


def results(shape: FamilyShape, mods: Modules, row: Row, dtype, provider, compiled=None) -> dict:
    x, (cos, sin), dy = row.x[dtype], row.cos_sin[dtype], row.grads[dtype]
    if provider == "fusedqkv":
        m = mods.fused[dtype]
        return run_fwd_bwd(lambda: m._fusedqkv_qkv(x, (cos, sin)), fused_params(m), x, dy)
    m = mods.hf[dtype]
    fn = compiled if provider == "hf_compile" else (lambda x, c, s: shape.input_part(m, mods.modeling, x, c, s))
    return run_fwd_bwd(lambda: fn(x, cos, sin), hf_params(m), x, dy)


def max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def check_row(shape: FamilyShape, mods: Modules, row: Row, compiled) -> dict:
    """fp32: fusedqkv against HF; bf16: fusedqkv and hf_compile against HF's fp32 run by the
    three-way rule, the eager bf16 HF code as the yardstick. Returns the errors and the verdicts."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in fp32 on both sides
    try:
        ref = results(shape, mods, row, torch.float32, "hf_eager")
        fused32 = results(shape, mods, row, torch.float32, "fusedqkv")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    scale = {n: float(t.abs().max()) for n, t in ref.items()}
    fp32_err = {n: max_abs(fused32[n], ref[n]) for n in ref}
    fp32_ok = {n: fp32_err[n] <= FP32_RTOL * scale[n] for n in ref}
    hf16 = results(shape, mods, row, torch.bfloat16, "hf_eager")
    yard = {n: max_abs(hf16[n], ref[n]) for n in ref}
    out = {"tensors": list(ref), "ref_max_abs": scale,
           "fp32": {"max_abs_err": fp32_err, "ok": fp32_ok, "all_ok": all(fp32_ok.values())},
           "bf16": {"hf_eager_max_abs_err": yard}}
    for prov in CHECKED:
        got = results(shape, mods, row, torch.bfloat16, prov, compiled)
        err = {n: max_abs(got[n], ref[n]) for n in ref}
        ok = {n: err[n] <= 2 * yard[n] + THREE_WAY_ATOL * scale[n] for n in ref}
        out["bf16"][prov] = {"max_abs_err": err, "ok": ok, "all_ok": all(ok.values())}
    out["passed"] = {"hf_eager": True, "floor": True,
                     "hf_compile": out["bf16"]["hf_compile"]["all_ok"],
                     "fusedqkv": out["bf16"]["fusedqkv"]["all_ok"] and out["fp32"]["all_ok"]}
    return out


# ------------------------------------------------------------------ timing


def capture_graph(fn):
    """fn captured as a CUDA graph after warm-up calls on a side stream; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graphs_interleaved(fns: dict, reps: int, warmup: int = 3,
                            flusher: Optional[timing.L2Flusher] = None) -> dict:
    """{name: [ms per call]}: each callable captured as a CUDA graph (outputs kept alive until
    the timing ends), the graphs replayed call by call in a rotated order, the L2 flushed before
    each (``timing.time_cuda_events_interleaved``)."""
    graphs = {n: capture_graph(fn) for n, fn in fns.items()}
    return timing.time_cuda_events_interleaved({n: g.replay for n, (g, _) in graphs.items()}, reps=reps,
                                               warmup=warmup, flusher=flusher)


def time_providers(fns: dict, reps: int, flusher: Optional[timing.L2Flusher]) -> dict:
    """{name: [ms per call]}: on the GPU (``flusher`` given) ``time_graphs_interleaved``; on the CPU
    (a smoke run of a script's logic) one wall-clock call each."""
    if flusher is not None:
        return time_graphs_interleaved(fns, reps, 3, flusher)
    ms = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        ms[name] = [(time.perf_counter() - t0) * 1e3]
    return ms


def time_graphs_steady(fns: dict, seconds: float, rounds: int, sampler: Optional[timing.ClockSampler]) -> dict:
    """{name: {ms, mhz, watts, samples}}: each callable captured as a CUDA graph (outputs kept alive
    until the timing ends), the graphs replayed back to back under steady load (``timing.time_steady``,
    ``timing.steady_medians``)."""
    graphs = {n: capture_graph(fn) for n, fn in fns.items()}
    return timing.steady_medians(timing.time_steady({n: g.replay for n, (g, _) in graphs.items()}, seconds=seconds,
                                                    rounds=rounds, sync=torch.cuda.synchronize, sampler=sampler))


def time_row(row: Row, providers, reps: int, warmup: int, flusher: Optional[timing.L2Flusher]) -> dict:
    """{(provider, mode): [ms per call]}: the graphs (CPU: the calls) interleaved call by call in a
    rotated order. No ``flusher``: the CPU smoke run (wall clock, no graphs)."""
    fns = {(p, m): row.calls[p][i] for p in providers for i, m in enumerate(MODES)}
    names = {f"{p}/{m}": (p, m) for p, m in fns}
    if flusher is None:
        ms = time_cpu_interleaved({n: fns[k] for n, k in names.items()}, reps)
        return {names[n]: v for n, v in ms.items()}
    ms = time_graphs_interleaved({n: fns[k] for n, k in names.items()}, reps, warmup, flusher)
    return {names[n]: v for n, v in ms.items()}


# ------------------------------------------------------------------ the run


def kernel_profile(fn, calls: int = 5, top: int = 12) -> list:
    """[{name, us per call}]: the GPU kernels of ``calls`` eager calls of ``fn`` (torch.profiler, after
    one call outside it), the ``top`` largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [dict(name=e.key, us=e.device_time_total / calls) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(kernels, key=lambda k: -k["us"])[:top]


def profile_row(row: Row, providers, calls: int = 5) -> dict:
    """{"provider/mode": [{name, us per call}]}: each provider's GPU kernels over ``calls`` eager
    calls (torch.profiler), largest first."""
    out = {}
    for prov in providers:
        for mode, fn in zip(MODES, row.calls[prov]):
            out[f"{prov}/{mode}"] = kernel_profile(fn, calls)
    return out


def parse_tokens(spec: str, error) -> list:
    out = []
    for item in spec.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            error(f"--tokens: expected BATCHxSEQ items such as 1x2048,4x2048; got {item.strip()!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


def criteria(row_ms: dict, judged: bool) -> dict:
    """Per mode: fused/compile, eager/fused, fused/floor and the two verdicts (None where a provider
    was not timed, or not ``judged``: a CPU smoke run)."""
    out = {}
    for mode in MODES:
        t = {p: row_ms.get(p, {}).get(mode) for p in PROVIDERS}
        f = t["fusedqkv"]
        r = {"fused_over_compile": f / t["hf_compile"] if f and t["hf_compile"] else None,
             "eager_over_fused": t["hf_eager"] / f if f and t["hf_eager"] else None,
             "fused_over_floor": f / t["floor"] if f and t["floor"] else None}
        r["as_fast_as_compile"] = None if r["fused_over_compile"] is None or not judged else \
            r["fused_over_compile"] <= MAX_FUSED_OVER_COMPILE
        r["eager_2x"] = None if r["eager_over_fused"] is None or not judged else \
            r["eager_over_fused"] >= MIN_EAGER_OVER_FUSED
        out[mode] = r
    return out


def table(report) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    def verdict(v):
        return "n/a" if v is None else ("ok" if v else "FAIL")

    lines = [f"{report['meta']['device']} | torch {report['meta']['torch']} | transformers "
             f"{report['meta']['transformers']} | bf16 | {report['meta']['timing']}",
             f"{'family':<13} {'tokens':>7} {'mode':<8} {'hf_eager':>9} {'hf_compile':>10} {'fusedqkv':>9} "
             f"{'floor':>8} {'fused/comp':>10} {'eager/fused':>11} {'fused/floor':>11}  verdicts"]
    for r in report["rows"]:
        for mode in MODES:
            c = r["criteria"][mode]
            ms = {p: r["ms"].get(p, {}).get(mode) for p in PROVIDERS}
            refused = [p for p in CHECKED if not r["checks"]["passed"][p]]
            lines.append(
                f"{r['family']:<13} {r['batch']}x{r['seq']:<5} {mode:<8} {fmt(ms['hf_eager'], '9.4f')} "
                f"{fmt(ms['hf_compile'], '10.4f')} {fmt(ms['fusedqkv'], '9.4f')} {fmt(ms['floor'], '8.4f')} "
                f"{fmt(c['fused_over_compile'], '10.3f')} {fmt(c['eager_over_fused'], '11.2f')} "
                f"{fmt(c['fused_over_floor'], '11.3f')}  vs compile {verdict(c['as_fast_as_compile'])}, "
                f">= {MIN_EAGER_OVER_FUSED:g}x eager {verdict(c['eager_2x'])}"
                + (f", refused: {', '.join(refused)}" if refused else ""))
    lines.append(f"checks (HF forward bitwise, fp32, bf16 three-way): {'ok' if report['checks_passed'] else 'FAIL'}")
    lines.append(f"criteria (fusedqkv at least as fast as torch.compile of HF's code, at least "
                 f"{MIN_EAGER_OVER_FUSED:g}x faster than HF eager, every row and mode): "
                 + ("n/a (CPU smoke run)" if report["meta"]["smoke"] else ("PASS" if report["passed"] else "FAIL")))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_families_out", help="directory for bench_families.json")
    p.add_argument("--families", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--tokens", default=None, help="BATCHxSEQ rows (default 1x2048,4x2048; --smoke 1x12,2x8)")
    p.add_argument("--reps", type=int, default=30, help="timed replays per graph (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays per graph before timing")
    p.add_argument("--smoke", action="store_true", help="the script's logic on tiny CPU shapes (no timing value)")
    p.add_argument("--profile", action="store_true",
                   help="also the GPU kernels of each provider's calls (torch.profiler, eager calls, not graphs): "
                        "where the time over the floor goes")
    a = p.parse_args(argv)
    families = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in SHAPES]
    if unknown or not families:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if a.reps < 1:
        p.error(f"--reps must be >= 1, got {a.reps}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    tokens = parse_tokens(a.tokens or ("1x12,2x8" if a.smoke else "1x2048,4x2048"), p.error)
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: the timing needs one (--smoke runs the script's logic on the CPU)")
    try:
        import transformers
    except ImportError:
        p.error("transformers is not installed (from the clone: pip install -e '.[transformers]')")

    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        a.reps = min(a.reps, 2)
    backend = "aot_eager" if a.smoke else "inductor"
    raise_compile_limits(64)  # one static compile per family and size
    flusher = None if a.smoke else timing.L2Flusher(device)
    os.makedirs(a.out, exist_ok=True)
    rows, forward_checks = [], {}
    for fam in families:
        shape = SHAPES[fam]
        cfg = build_config(shape, a.smoke)
        mods = build_modules(shape, cfg, device)
        hf16 = mods.hf[torch.bfloat16]

        def hf_block(x, cos, sin, hf16=hf16, shape=shape, modeling=mods.modeling):
            return shape.input_part(hf16, modeling, x, cos, sin)

        compiled = torch.compile(hf_block, fullgraph=True, dynamic=False, backend=backend)
        for b, s in tokens:
            row = make_row(shape, mods, compiled, b, s, device)
            if fam not in forward_checks:
                forward_checks[fam] = check_against_hf_forward(shape, mods, row)
                if not forward_checks[fam]["bitwise_equal"]:
                    log(f"{fam}: hf_eager differs from HF's own forward ({forward_checks[fam]['max_abs_diff']}); "
                        f"this script's input part does not match transformers {transformers.__version__}")
            t0 = time.time()
            checks = check_row(shape, mods, row, compiled)  # compiles hf_compile for this size
            if not forward_checks[fam]["bitwise_equal"]:
                checks["passed"] = {prov: False for prov in checks["passed"]}
            timed = [prov for prov in PROVIDERS if checks["passed"][prov]]
            log(f"{fam} {b}x{s}: checked in {time.time() - t0:.1f}s; timing {', '.join(timed)}"
                + (f"; refused {[p for p in PROVIDERS if p not in timed]}" if len(timed) < len(PROVIDERS) else ""))
            samples = time_row(row, timed, a.reps, a.warmup, flusher) if timed else {}
            ms = {}
            for (prov, mode), v in samples.items():
                ms.setdefault(prov, {})[mode] = statistics.median(v)
            rows.append(dict(family=fam, checkpoint=shape.checkpoint, batch=b, seq=s, tokens=b * s, ms=ms,
                             summary={f"{p}/{m}": timing.summarize(v) for (p, m), v in samples.items()},
                             checks=checks, criteria=criteria(ms, judged=not a.smoke)))
            if a.profile:
                rows[-1]["kernels"] = profile_row(row, timed)
                for key, ks in rows[-1]["kernels"].items():
                    log(f"  {fam} {b}x{s} {key}: " + "; ".join(f"{k['us']:.0f}us {k['name'][:60]}" for k in ks[:8]))
            del row
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del mods, compiled
        torch._dynamo.reset()  # the family's compiled graphs, and the modules their guards hold
    checks_passed = all(f["bitwise_equal"] for f in forward_checks.values()) and all(
        all(r["checks"]["passed"].values()) for r in rows)
    verdicts = [r["criteria"][m][k] for r in rows for m in MODES for k in ("as_fast_as_compile", "eager_2x")]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run: no timing value)",
            "torch": torch.__version__, "transformers": transformers.__version__, "smoke": a.smoke,
            "reps": a.reps, "compile": f"torch.compile(fullgraph=True, dynamic=False, backend={backend!r})",
            "timing": ("wall clock, calls interleaved" if a.smoke else
                       f"CUDA graphs replayed interleaved, L2 flushed, median of {a.reps}")}
    shapes = {f: dict(checkpoint=SHAPES[f].checkpoint, config_class=SHAPES[f].config_class,
                      **config_kwargs(SHAPES[f], a.smoke)) for f in families}
    report = dict(meta=meta, shapes=shapes, hf_forward_checks=forward_checks, rows=rows, checks_passed=checks_passed,
                  passed=checks_passed and (a.smoke or all(v is True for v in verdicts)))
    path = os.path.join(a.out, "bench_families.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    log(f"wrote {path}")
    print(table(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
