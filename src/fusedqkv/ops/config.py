"""The launchers' tunables, read from the environment once.

Every choice a plan makes from something other than its inputs comes from the one frozen
:class:`Config` returned by :func:`current`, and the config is part of every plan's key, so
a changed setting can never run on a plan built under another. Tests change settings with
:func:`override` (a context manager) instead of patching module globals.

Environment variables (read at import; 0 turns a path off):
``FUSEDQKV_CHAIN_MAX_TOKENS`` (128), ``FUSEDQKV_HYBRID_MAX_TOKENS`` (2560),
``FUSEDQKV_NORM_FINISH_IN_DW`` (1), ``FUSEDQKV_TRAINING_TRITON_PRODUCTS`` (1),
``FUSEDQKV_STAGE_TMA`` (1), ``FUSEDQKV_CUBLASLT`` (1);
``FUSEDQKV_FUSED_FORWARD`` (auto, on or off), ``FUSEDQKV_FUSED_FORWARD_FP8`` (auto, on or off);
``FUSEDQKV_QLORA_ABSMAX`` (keep or recompute); ``FUSEDQKV_QLORA_DEQUANT`` (one_launch or bitsandbytes);
``FUSEDQKV_FP8_FROZEN_WEIGHT_CACHE`` (0).
Where the defaults come from: benchmarks/NOTES.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclasses.dataclass(frozen=True)
class Config:
    # Products of the 091 backward (ops/projection.py). To chain_max_tokens tokens, where dX's
    # tiles spread evenly over the SMs (balance >= chain_min_balance), dX and dW run as two
    # persistent Triton TMA kernels chained behind the stage; otherwise to hybrid_max_tokens, dW
    # in Triton and dX on cuBLAS; above, both on cuBLAS.
    chain_max_tokens: int = 128
    chain_min_balance: float = 0.85
    hybrid_max_tokens: int = 2560
    # (tile rows, cols, K step, warps, pipeline stages, programs per SM) of the TMA matmuls:
    # dX and dW of the chain to 128 tokens, above, and the hybrid's dW
    chain_dx: tuple = (64, 64, 64, 4, 6, 1)
    chain_dw: tuple = (128, 128, 64, 8, 2, 1)
    chain_dx_above_128: tuple = (64, 64, 64, 4, 6, 2)
    chain_dw_above_128: tuple = (128, 128, 32, 4, 4, 2)
    hybrid_dw: tuple = (128, 128, 32, 4, 5, 2)
    # to this many tokens the hybrid queues its cuBLAS dX right behind the stage and its Triton dW behind dX;
    # above, dW first. dX first: 2-3 % off the call at 131-586 tokens, neutral to slightly slower from 1571
    # (NOTES, session 29)
    hybrid_dx_first_max_tokens: int = 1024
    # the stage's norm-weight finish runs inside the Triton dW launch (chain and hybrid)
    norm_finish_in_dw: bool = True
    # the training block's backward takes the same products (ops/training_backward.py) where it needs dX and dW
    # in 16 bits: the chain or the hybrid by the rules above, else (False) its two cuBLAS products
    training_triton_products: bool = True
    # the Triton products under TRITON_INTERPRET=1 (slow to emulate: tests turn them on)
    triton_products_in_interpreter: bool = False
    # the backward stage (ops/rope_qk_norm.py): q/k tiles through TMA descriptors where the
    # tensors allow it; the norm-weight finish fused into the stage kernel (else a second
    # launch); programs per first-level reduction of that finish
    stage_tma: bool = True
    fused_finish: bool = True
    finish_super_rows: int = 32
    # a forced stage tile (tokens per block, heads per step, warps, pipeline stages, heads per
    # group or 0) instead of the launcher's choice: for tests
    stage_tile: Optional[tuple] = None
    # the forward stage's tile (tokens per program, heads per program, warps): for tests
    forward_tile: Optional[tuple] = None
    # the all-heads backward stage (warps, persistent programs per SM, pipeline stages of its
    # token loop) instead of the launcher's choice: for tests and sweeps
    all_heads_stage: Optional[tuple] = None
    # cuBLAS GEMMs as planned cuBLASLt calls (ops/cublaslt.py) instead of torch.mm
    cublaslt: bool = True
    # the training forward as one Hopper launch (ops/qkv_rope_norm_gemm.py: the GEMM with RoPE + RMSNorm
    # in its epilogue): "auto" where each of its consumer warpgroups gets at least
    # fused_forward_min_rounds tiles (below, cuBLAS + the stage is faster: NOTES, session 13), "on"
    # wherever it can run, "off" never
    fused_forward: str = "auto"
    fused_forward_min_rounds: float = 8.0
    # the same bound for the kernel that takes LoRA adapters inside its GEMM: it also saves the in-place
    # update's read and write of qkv, and wins from ~3 tiles per consumer (NOTES, session 22)
    fused_forward_lora_min_rounds: float = 2.0
    # FP8 plans (fp8=...) take that kernel's FP8 build under the same rules (its GEMM on the casts of x and W,
    # the recipe's scales in its epilogue): "auto" for tensorwise recipes (measured 0.98-1.00x the split path;
    # rowwise 1.01-1.03x: NOTES, session 23), "on" every recipe, "off" none (torch._scaled_mm + the stage)
    fused_forward_fp8: str = "auto"
    # overrides of that kernel's tile (qkv_rope_norm_gemm.TILE) as (name, value) pairs: for tests and sweeps
    fused_forward_tile: Optional[tuple] = None
    # the LoRA products over the adapters' block-diagonal B, one product instead of one per pair
    # (ops/lora.LoRAUpdate.block_pays): "auto" where the saved launches outweigh the block's zeros,
    # "on" always, "off" never (one product per pair)
    lora_block: str = "auto"
    # QLoRA with double quantisation: each 4-bit q/k/v projection's absmax kept dequantized beside the kept
    # projection plan ("keep": 4 bytes per blocksize weights; one bitsandbytes op a projection per call) or
    # dequantized again by bitsandbytes every call ("recompute": three ops a projection) -- integrations.qlora
    qlora_absmax: str = "keep"
    # with the absmax kept, NF4 q/k/v dequantized in one launch of our own kernel (ops/dequant_4bit.py: bitwise
    # bitsandbytes' values) instead of one bitsandbytes call each ("bitsandbytes")
    qlora_dequant: str = "one_launch"
    # FP8 plans: a frozen weight's two casts (fp8.weight_casts: the forward GEMM's and the dX GEMM's) kept from
    # call to call while the weight is the same unchanged tensor (fp8.FrozenWeightCasts; LoRA's frozen base).
    # Off by default: writes through .data (w.data.copy_) do not move the version counter the key reads, so a
    # caller that writes a frozen weight that way must call fp8.forget_frozen_weight_casts (PEFT's merge and
    # unmerge through apply_to do it); holds N x K fp8 bytes twice per layer
    fp8_frozen_weight_cache: bool = False

    @classmethod
    def from_env(cls, env=os.environ) -> "Config":
        def flag(name: str, default: bool) -> bool:
            return env.get(name, "1" if default else "0") != "0"

        def count(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}: expected an integer token count, got {raw!r}") from None

        return cls(chain_max_tokens=count("FUSEDQKV_CHAIN_MAX_TOKENS", cls.chain_max_tokens),
                   hybrid_max_tokens=count("FUSEDQKV_HYBRID_MAX_TOKENS", cls.hybrid_max_tokens),
                   norm_finish_in_dw=flag("FUSEDQKV_NORM_FINISH_IN_DW", True),
                   training_triton_products=flag("FUSEDQKV_TRAINING_TRITON_PRODUCTS", True),
                   stage_tma=flag("FUSEDQKV_STAGE_TMA", True),
                   cublaslt=flag("FUSEDQKV_CUBLASLT", True),
                   fused_forward=_choice(env, "FUSEDQKV_FUSED_FORWARD", ("auto", "on", "off"), "auto"),
                   fused_forward_fp8=_choice(env, "FUSEDQKV_FUSED_FORWARD_FP8", ("auto", "on", "off"), "auto"),
                   qlora_absmax=_choice(env, "FUSEDQKV_QLORA_ABSMAX", ("keep", "recompute"), "keep"),
                   qlora_dequant=_choice(env, "FUSEDQKV_QLORA_DEQUANT", ("one_launch", "bitsandbytes"), "one_launch"),
                   fp8_frozen_weight_cache=flag("FUSEDQKV_FP8_FROZEN_WEIGHT_CACHE", False))


def parse_changes(text: str) -> dict:
    """``"chain_dx_above_128=128,64,64,4,6,1;chain_min_balance=0"`` as :func:`override`'s keyword
    arguments, each value typed as the field's default (a tuple of ints, a number, a flag, a word):
    for benchmarks that time configurations side by side."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    out = {}
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ValueError(f"config change {item!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
        default = fields[name].default
        raw = raw.strip()
        try:
            if isinstance(default, bool):
                if raw not in ("0", "1", "true", "false"):
                    raise ValueError
                value = raw in ("1", "true")
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            elif isinstance(default, str):
                value = raw
            else:  # a tuple or an optional tuple
                value = None if raw == "none" else tuple(int(v) for v in raw.split(","))
        except ValueError:
            raise ValueError(f"config change {item!r}: {raw!r} is not a value of {name} "
                             f"(default {default!r})") from None
        out[name] = value
    return out


def parse_variant(text: str) -> tuple:
    """``"NAME:CHANGES"`` (a benchmark's ``--variant``) as ``(NAME, parse_changes(CHANGES))``."""
    name, sep, changes = text.partition(":")
    if not sep or not name:
        raise ValueError(f"variant {text!r}: expected NAME:CHANGES")
    return name, parse_changes(changes)


def _choice(env, name: str, choices: tuple, default: str) -> str:
    raw = env.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
    return raw


_current = Config.from_env()
_INTERNED = {_current: _current}


def current() -> Config:
    return _current


@contextlib.contextmanager
def override(**changes):
    """``with override(hybrid_max_tokens=0): ...`` -- the config with those fields changed,
    for the duration of the block (plans built under it are keyed by it)."""
    global _current
    saved = _current
    new = dataclasses.replace(saved, **changes)
    # one object per distinct config: plans' fast path compares configs by identity, so a
    # block entered again with the same changes finds the plans it built before
    _current = _INTERNED.setdefault(new, new)
    try:
        yield _current
    finally:
        _current = saved
