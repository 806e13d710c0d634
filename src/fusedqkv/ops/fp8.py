"""FP8 training of the block's projection: torchao's float8 recipes as data, the casts of the
three GEMMs' operands, and the scaled GEMMs (``torch._scaled_mm``: cuBLASLt on the GPU).

The block's RoPE/norm stage is unchanged (bf16 in, bf16 out): FP8 changes its three GEMMs,

* forward ``qkv = x W^T``: x scaled per token, W per output row (rowwise recipes);
* ``dX = dQKV W``: dQKV per token, W per input column;
* ``dW = dQKV^T X``: dQKV and X per channel, over the tokens (or in bf16: ``rowwise_with_gw_hp``),

each operand scaled and cast as torchao's ``Float8Linear`` casts it for the same recipe
(:data:`RECIPES`, or :func:`recipe_of_torchao_config` for a ``Float8LinearConfig``), so the
projection's output equals ``Float8Linear``'s for the same inputs. On CUDA the casts are
Triton kernels (:mod:`fusedqkv.kernels.fp8_cast`: a cast reads its operand once, a transposed
or per-channel cast twice); elsewhere (CPU) torch ops that follow torchao's own steps.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional

import torch

from . import config as _config, device as _device, internals
from .launch import TensorLaunches, next_pow2

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's amax floor
MX_BLOCK = 32  # values per e8m0 scale (MX)
_NAMES = {E4M3: "e4m3", E5M2: "e5m2"}


@dataclasses.dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast: ``dtype`` None leaves it in high precision; otherwise one
    scale for the tensor (``tensorwise``), one per row/column along the GEMM's inner dimension, or
    (``block``: MX) one power of two per ``block`` values along it, torchao's FLOOR scales or
    (``rceil``) its RCEIL ones."""

    dtype: Optional[torch.dtype] = E4M3
    tensorwise: bool = False
    block: int = 0  # MX: one e8m0 scale per ``block`` values along the inner dimension (0: none)
    rceil: bool = False  # MX: the scale 2^ceil(log2(amax / max)) (torchao's RCEIL), else FLOOR's

    def __str__(self) -> str:
        if self.dtype is None:
            return "hp"
        mx = f"mx{self.block}{'rceil' if self.rceil else ''}"
        return f"{_NAMES[self.dtype]}/{mx if self.block else 'tensor' if self.tensorwise else 'axis'}"


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """torchao's ``Float8LinearConfig`` fields that decide the block's numerics, per GEMM role."""

    name: str
    input: Cast                      # forward: x
    weight: Cast                     # forward: W
    grad_output: Cast                # dX: dQKV
    weight_for_grad_input: Cast      # dX: W
    input_for_grad_weight: Cast      # dW: x
    grad_output_for_grad_weight: Cast  # dW: dQKV
    round_scales_to_power_of_2: bool = False
    fast_accum: tuple = (True, False, False)  # forward, dX, dW (torchao's gemm configs' defaults)

    def __post_init__(self):
        for a, b, gemm in ((self.input, self.weight, "the forward GEMM"),
                           (self.grad_output, self.weight_for_grad_input, "the dX GEMM"),
                           (self.grad_output_for_grad_weight, self.input_for_grad_weight, "the dW GEMM")):
            if (a.dtype is None) != (b.dtype is None):
                raise ValueError(f"fp8 recipe {self.name!r}: {gemm} has one operand in FP8 and one in high "
                                 f"precision ({a}, {b}); expected both or neither")
        if self.input.dtype is None or self.grad_output.dtype is None:
            raise ValueError(f"fp8 recipe {self.name!r}: the forward and dX GEMMs in high precision are not an "
                             "FP8 recipe; use fp8=None")
        fp8_casts = [c for c in self.casts() if c.dtype is not None]
        if len({c.block for c in fp8_casts}) > 1:
            raise ValueError(f"fp8 recipe {self.name!r}: MX block scales on some FP8 operands and not on others "
                             f"({', '.join(map(str, self.casts()))}); expected all or none")
        if self.mx and any(c not in (_MX, _MX_RCEIL) for c in fp8_casts):
            raise ValueError(f"fp8 recipe {self.name!r}: MX casts other than e4m3 in blocks of 32 (mxfp8, "
                             f"mxfp8_rceil) are not built, got {', '.join(map(str, self.casts()))}")
        if len({c.rceil for c in fp8_casts}) > 1:
            raise ValueError(f"fp8 recipe {self.name!r}: RCEIL MX scales on some FP8 operands and FLOOR on others "
                             f"({', '.join(map(str, self.casts()))}); expected one scale mode")

    def casts(self) -> tuple:
        """The six roles' casts, in the fields' order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)[1:7])

    @property
    def mx(self) -> bool:
        """MX block scales (e8m0, torchao's MX training meaning): the GEMMs need Blackwell (sm_100)."""
        return self.input.block > 0

    @property
    def rceil(self) -> bool:
        """MX scales rounded as torchao's RCEIL (``mxfp8_rceil``), else FLOOR's (``mxfp8``)."""
        return self.input.rceil

    @property
    def key(self) -> str:
        """The recipe as one string (the custom ops' argument): its name where it is one of :data:`RECIPES`."""
        if RECIPES.get(self.name) == self:
            return self.name
        roles = ",".join(map(str, self.casts()))
        return f"custom:{roles}:{int(self.round_scales_to_power_of_2)}:{''.join(str(int(b)) for b in self.fast_accum)}"


_A, _T, _HP, _MX = Cast(E4M3, False), Cast(E4M3, True), Cast(None), Cast(E4M3, False, 32)
_MX_RCEIL = Cast(E4M3, False, 32, True)
RECIPES = {
    # torchao's Float8LinearRecipeName values, field by field (tests compare them with torchao's)
    "tensorwise": Fp8Recipe("tensorwise", _T, _T, Cast(E5M2, True), _T, _T, Cast(E5M2, True), False),
    "rowwise": Fp8Recipe("rowwise", _A, _A, _A, _A, _A, _A, True),
    "rowwise_with_gw_hp": Fp8Recipe("rowwise_with_gw_hp", _A, _A, _A, _T, _HP, _HP, True),
    # torchao's MX training (mx_formats' to_mx, ScaleCalculationMode.FLOOR): e4m3 in blocks of 32 along each
    # GEMM's inner dimension, e8m0 scales; sm_100 only (elsewhere on CUDA refused; on the CPU emulated)
    "mxfp8": Fp8Recipe("mxfp8", _MX, _MX, _MX, _MX, _MX, _MX, False),
    # ... with ScaleCalculationMode.RCEIL (torchao's MX training default, cuBLAS's recipe): 2^ceil(log2(amax / 448)),
    # computed exactly (torchao's CPU path is one code low for some amaxes just above 448 * 2^k: NOTES, session 26)
    "mxfp8_rceil": Fp8Recipe("mxfp8_rceil", *(_MX_RCEIL,) * 6, False),
}


def _parse_cast(text: str) -> Cast:
    if text == "hp":
        return _HP
    dt, _, gran = text.partition("/")
    dtype = {v: k for k, v in _NAMES.items()}[dt]
    if gran.startswith("mx"):
        block, rceil = (gran[2:-5], True) if gran.endswith("rceil") else (gran[2:], False)
        return Cast(dtype, False, int(block), rceil)
    return Cast(dtype, gran == "tensor")


def recipe(fp8) -> Optional[Fp8Recipe]:
    """``fp8`` as a recipe: None (bf16), a name of :data:`RECIPES`, a recipe's ``key``, or an
    :class:`Fp8Recipe`; anything else is a ValueError naming the argument."""
    if fp8 is None or fp8 == "":
        return None
    if isinstance(fp8, Fp8Recipe):
        return fp8
    if isinstance(fp8, str):
        if fp8 in RECIPES:
            return RECIPES[fp8]
        if fp8.startswith("custom:"):
            try:
                _, roles, pow2, fast = fp8.split(":")
                casts = [_parse_cast(r) for r in roles.split(",")]
                return Fp8Recipe("custom", *casts, bool(int(pow2)), tuple(c == "1" for c in fast))
            except (ValueError, KeyError, TypeError):
                pass
    raise ValueError(f"fp8: expected None, one of {sorted(RECIPES)} or an Fp8Recipe, got {fp8!r}")


def recipe_of_torchao_config(config, where: str = "Float8Linear") -> Fp8Recipe:
    """The recipe a torchao ``Float8LinearConfig`` describes; what the block cannot honour
    (emulation, FSDP2's float8 all-gather) raises ``ValueError`` naming the field. Cached per config
    (frozen, hashable): the fused forward asks at every call."""
    try:
        # (torch.compile traces the function itself: it warns of a cache wrapper it would ignore)
        return _recipe_of_config.__wrapped__(config) if torch.compiler.is_compiling() else _recipe_of_config(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


@functools.lru_cache(maxsize=64)
def _recipe_of_config(config) -> Fp8Recipe:
    if getattr(config, "emulate", False):
        raise ValueError("torchao's config has emulate=True (FP8 emulated in high precision); the fused "
                         "block runs real FP8 GEMMs only")
    if getattr(config, "enable_fsdp_float8_all_gather", False):
        raise ValueError("torchao's enable_fsdp_float8_all_gather=True is not supported by the fused "
                         "block (its weight is the fused qkv parameter, all-gathered in high precision)")

    def cast(cc) -> Cast:
        if cc.scaling_type.value == "disabled":
            return _HP
        return Cast(cc.target_dtype, cc.scaling_granularity.value == "tensorwise")

    roles = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output,
             config.cast_config_weight_for_grad_input, config.cast_config_input_for_grad_weight,
             config.cast_config_grad_output_for_grad_weight)
    fast = (config.gemm_config_output.use_fast_accum, config.gemm_config_grad_input.use_fast_accum,
            config.gemm_config_grad_weight.use_fast_accum)
    got = Fp8Recipe("custom", *(cast(c) for c in roles), bool(config.round_scales_to_power_of_2), fast)
    for r in RECIPES.values():
        if dataclasses.replace(got, name=r.name) == r:
            return r
    return got


def recipe_of_torchao_mx_config(config, where: str = "torchao MX training") -> Fp8Recipe:
    """The recipe torchao's MX training config describes: torchao 0.18's ``MXFP8TrainingOpConfig``
    (what ``quantize_`` wraps weights with; an ``MXFP8Linear`` carries the same fields), or any object
    with its fields. ``scale_calculation_mode`` RCEIL is ``"mxfp8_rceil"``, FLOOR ``"mxfp8"``;
    ``wgrad_with_hp`` keeps dW in high precision (a custom recipe: dW's operands ``hp``). Where the
    config has them (older torchao's ``MXLinearConfig``), ``elem_dtype`` (and its weight and
    grad_output overrides) must be e4m3 and ``block_size`` 32. What the block cannot honour (CEIL or
    EVEN scales, another element dtype or block, ``kernel_preference`` other than AUTO, an
    ``out_dtype`` other than bf16) raises ``ValueError`` naming the field and its value.
    ``pad_token_groups_for_grouped_mm`` is torchao's grouped GEMMs' only: not read."""
    def refuse(field, value, want):
        raise ValueError(f"{where}: torchao's MX config has {field}={value}; the fused block runs {want}")

    def name(v):
        return getattr(v, "name", v)

    mode = getattr(config, "scale_calculation_mode", None)
    if mode is None:
        mode = getattr(config, "scaling_mode", None)
    mode_value = getattr(mode, "value", mode)
    if mode_value not in ("rceil", "floor"):
        refuse("scale_calculation_mode", name(mode), "RCEIL (fp8='mxfp8_rceil') or FLOOR (fp8='mxfp8') scales only")
    kp = getattr(config, "kernel_preference", None)
    if kp is not None and getattr(kp, "value", kp) != "auto":
        refuse("kernel_preference", name(kp), "real MX GEMMs only (KernelPreference.AUTO; the CPU emulates them)")
    for field in ("elem_dtype", "elem_dtype_weight_override", "elem_dtype_grad_output_override"):
        dt = getattr(config, field, None)
        if dt is not None and dt != E4M3:
            refuse(field, dt, "e4m3 (torch.float8_e4m3fn) elements only")
    block = getattr(config, "block_size", MX_BLOCK)
    if block != MX_BLOCK:
        refuse("block_size", block, f"blocks of {MX_BLOCK} only")
    out_dtype = getattr(config, "out_dtype", torch.bfloat16)
    if out_dtype != torch.bfloat16:
        refuse("out_dtype", out_dtype, "MX GEMMs that write bf16 only")
    r = RECIPES["mxfp8_rceil" if mode_value == "rceil" else "mxfp8"]
    if getattr(config, "wgrad_with_hp", False):  # torchao's dW in high precision: dW's operands uncast
        r = dataclasses.replace(r, name="custom", input_for_grad_weight=_HP, grad_output_for_grad_weight=_HP)
    return r


@functools.cache
def _cpu_row_scales_probe() -> bool:
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@internals.assume_constant_result  # under torch.compile: a constant, not a probe GEMM in the graph
def cpu_scaled_mm_takes_row_scales() -> bool:
    """``torch._scaled_mm`` on the CPU takes row/column scales (torch 2.13's does; 2.11's CPU kernel takes
    per-tensor scales only and fails an internal assert otherwise). Probed once, on 16 x 16 operands."""
    return _cpu_row_scales_probe()


def row_scaled_gemms(r: Fp8Recipe) -> list:
    """The GEMMs of recipe ``r`` that hand ``torch._scaled_mm`` row/column scales (:func:`_mm`): both operands
    FP8, not both tensorwise, with power-of-two scales or fast accumulation (else the GEMM runs unit-scaled
    and the scales are applied after it)."""
    if r.mx:
        return []
    out = []
    for gemm, (a, b), fast in zip(("forward", "dX", "dW"), ((r.input, r.weight), (r.grad_output,
                                  r.weight_for_grad_input), (r.grad_output_for_grad_weight, r.input_for_grad_weight)),
                                  r.fast_accum):
        if a.dtype is not None and not (a.tensorwise and b.tensorwise) and (r.round_scales_to_power_of_2 or fast):
            out.append(gemm)
    return out


def check_supported(device: torch.device, hidden: int, n_tot: int, r: Optional[Fp8Recipe] = None,
                    sizes_only: bool = False) -> None:
    """ValueError where the scaled GEMMs cannot run: FP8 GEMMs need sm_89+ on CUDA, and
    inner and outer sizes that are multiples of 16; recipe ``r``'s MX GEMMs (``r.mx``) need sm_100+
    on CUDA (on the CPU they are emulated) and hidden and qkv rows in multiples of 32 (the blocks);
    on the CPU, row-scaled GEMMs need a torch whose CPU ``_scaled_mm`` takes row scales.
    ``sizes_only``: the sizes alone (``apply_to``: the device is checked where the block runs)."""
    if not sizes_only and device.type == "cpu" and r is not None and row_scaled_gemms(r) \
            and not cpu_scaled_mm_takes_row_scales():
        raise ValueError(f"fp8={r.key!r}: the {'/'.join(row_scaled_gemms(r))} GEMM(s) pass row-wise scales to "
                         f"torch._scaled_mm, whose CPU kernel in torch {torch.__version__} takes per-tensor scales "
                         f"only (torch 2.13's takes both); run it on a GPU, or on the CPU use fp8='tensorwise'")
    if device.type == "cuda" and _device.capability(device) < (8, 9):
        major, minor = _device.capability(device)
        raise ValueError(f"fp8: FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    mx = r is not None and r.mx
    if mx and device.type == "cuda" and _device.capability(device) < (10, 0):
        major, minor = _device.capability(device)
        raise ValueError(f"fp8={r.key!r}: MXFP8 GEMMs (e8m0 block scales) need a Blackwell GPU, compute "
                         f"capability 10.0 (sm_100) or newer; {torch.cuda.get_device_name(device)} is "
                         f"{major}.{minor} (sm_{major}{minor})")
    step = MX_BLOCK if mx else 16
    for name, n in (("hidden_states' last dimension (hidden)", hidden), ("qkv_weight's rows", n_tot)):
        if n % step:
            raise ValueError(f"fp8: {name} must be a multiple of {step} for {'MX' if mx else 'FP8'} GEMMs, got {n}")


# ------------------------------------------------------------------------ the casts


def _scale_torch(amax: torch.Tensor, dtype, pow2: bool) -> torch.Tensor:
    # torchao's amax_to_scale: fp64 division, fp32 result, then 2^floor(log2) for the rowwise recipes
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def cast_torch(t: torch.Tensor, cast: Cast, dim: int, pow2: bool):
    """(data, inverse scale) of 2-D ``t``: scales along ``dim`` (-1: one per row, 0: one per
    column) or one for the tensor; data in ``t``'s layout. torchao's own steps, op by op."""
    amax = t.abs().max() if cast.tensorwise else torch.amax(t.abs(), dim=dim, keepdim=True)
    scale = _scale_torch(amax, cast.dtype, pow2)
    fmax = torch.finfo(cast.dtype).max
    data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(cast.dtype)
    return data, scale.reciprocal()


# the casts' launches, bound per launch signature after their first call (a JIT launch costs tens of us
# of host time: ~9 a fwd+bwd made the eager FP8 block host-bound up to 8192 tokens, NOTES session 43)
_LAUNCH = TensorLaunches("fp8 cast launches")

_WHOLE_ROW_MAX = 8192       # rowwise cast: a row this long (padded to a power of two) stays in registers
_ROWS, _BLOCK_C = 4, 1024   # rowwise cast of longer rows: rows per program, columns per step
_BR, _BC, _BP = 128, 64, 64  # tile amax / cast tiles; partial rows reduced per step


def _rowwise_triton(t: torch.Tensor, cast: Cast, pow2: bool):
    from ..kernels.fp8_cast import rowwise_cast_kernel

    R, C = t.shape
    y = torch.empty((R, C), dtype=cast.dtype, device=t.device)
    inv = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    whole = next_pow2(C) <= _WHOLE_ROW_MAX
    if whole:  # one row per program from 2048 columns on (<= 32 fp32 values per thread at 8 warps)
        block, rows = next_pow2(C), 1 if C > 2048 else max(1, 2048 // next_pow2(C))
        warps = 8 if block >= 4096 else 4
    else:
        block, rows, warps = _BLOCK_C, _ROWS, 4
    _LAUNCH(rowwise_cast_kernel, (triton_cdiv(R, rows),), (t, y, inv), (R, C, t.stride(0), y.stride(0)),
            dict(FP8_MAX=torch.finfo(cast.dtype).max, POW2=pow2, ROWS=rows, BLOCK_C=block, WHOLE_ROW=whole,
                 num_warps=warps))
    return y, inv


_PART_ROWS = 16  # rowwise cast with column partials: rows per partial at most (at least the rows cast at a time)
# ... fewer (halved down to the rows cast at a time) until the launch has this many programs: a program casts its
# rows one after another, so at 2048 tokens 16 rows a program left 128 programs on 132 SMs, latency-bound at
# ~1 TB/s (session 26, call 1); the partials are stored in x's 16-bit dtype (a max of |x|: exact in it)
_COLAMAX_PROGRAMS = 512


def colamax_part_rows(R: int, rows: int) -> int:
    """Rows per column partial of :func:`_rowwise_colamax_triton`'s whole-row launch for ``R`` rows cast
    ``rows`` at a time: :data:`_PART_ROWS`, halved while the launch would have fewer than
    :data:`_COLAMAX_PROGRAMS` programs, never below ``rows``."""
    p = max(_PART_ROWS, rows)
    while p > rows and p % 2 == 0 and triton_cdiv(R, p) < _COLAMAX_PROGRAMS:
        p //= 2
    return max(p, rows)


def _rowwise_colamax_triton(t: torch.Tensor, cast: Cast, pow2: bool):
    """``_rowwise_triton``'s cast of ``t [R, C]`` (the same data and inverse scale, bitwise) from a
    kernel that also stores each block of ``P`` rows' column amaxes: ``(data, inv, part [cdiv(R, P),
    C])``, ``P`` the rows per partial (:func:`colamax_part_rows` for whole rows, else ``_PART_ROWS``), the
    partials in t's dtype where it is 16-bit, else fp32."""
    from ..kernels.fp8_cast import rowwise_cast_colamax_kernel

    R, C = t.shape
    y = torch.empty((R, C), dtype=cast.dtype, device=t.device)
    inv = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    whole = next_pow2(C) <= _WHOLE_ROW_MAX
    if whole:  # rowwise_cast_kernel's rows and warps per step (up to 32 fp32 a thread), looped over a
        # partial's rows; the running column max adds as many registers again at most
        block = next_pow2(C)
        rows = 1 if C > 2048 else max(1, 2048 // block)
        part_rows, warps = colamax_part_rows(R, rows), 8 if block >= 4096 else 4
    else:  # a program's rows all in each column chunk: as many values per chunk as rowwise_cast_kernel's
        part_rows = rows = _PART_ROWS
        block, warps = max(16, _ROWS * _BLOCK_C // _PART_ROWS), 4
    part_dtype = t.dtype if t.dtype in (torch.bfloat16, torch.float16) else torch.float32
    part = torch.empty((triton_cdiv(R, part_rows), C), dtype=part_dtype, device=t.device)
    _LAUNCH(rowwise_cast_colamax_kernel, (part.shape[0],), (t, y, inv, part), (R, C, t.stride(0), y.stride(0)),
            dict(FP8_MAX=torch.finfo(cast.dtype).max, POW2=pow2, PART_ROWS=part_rows, ROWS=rows, BLOCK_C=block,
                 WHOLE_ROW=whole, num_warps=warps))
    return y, inv, part


def _rowwise_parts_triton(t: torch.Tensor, cast: Cast, pow2: bool, parts: torch.Tensor):
    """``_rowwise_triton``'s cast of ``t [R, C]`` (the same data and inverse scale, bitwise) with each
    row's amax the max of its partials ``parts [n, R]`` (the backward stage's row partials of the
    values it stored: fp32 or t's dtype) instead of a pass over t: one read of t, one launch."""
    from ..kernels.fp8_cast import rowwise_cast_parts_kernel

    R, C = t.shape
    if parts.dim() != 2 or parts.shape[0] < 1 or parts.shape[1] != R or not parts.is_contiguous():
        raise ValueError(f"row_amax: row partials of shape [n, {R}] (contiguous) expected, got {tuple(parts.shape)}")
    y = torch.empty((R, C), dtype=cast.dtype, device=t.device)
    inv = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    _LAUNCH(rowwise_cast_parts_kernel, (triton_cdiv(R, _BR), triton_cdiv(C, _BC)),
            (t, y, parts, inv), (R, C, t.stride(0), parts.shape[0]),
            dict(FP8_MAX=torch.finfo(cast.dtype).max, POW2=pow2, BR=_BR, BC=_BC, BP=_FP_STAGE, num_warps=4))
    return y, inv


def _part_triton(t: torch.Tensor) -> torch.Tensor:
    from ..kernels.fp8_cast import tile_amax_kernel

    R, C = t.shape
    part = torch.empty((triton_cdiv(R, _BR), C), dtype=torch.float32, device=t.device)
    _LAUNCH(tile_amax_kernel, (part.shape[0], triton_cdiv(C, _BC)), (t, part), (R, C, t.stride(0)),
            dict(BR=_BR, BC=_BC, num_warps=4))
    return part


def _cast_triton(t: torch.Tensor, cast: Cast, pow2: bool, transpose: bool, pad_to: int = 1,
                 amax: Optional[torch.Tensor] = None):
    """Per-column or tensorwise cast; ``transpose``: data ``[C, R_pad]`` (``R_pad`` = R rounded
    up to ``pad_to``, the padding zeros). ``amax``: t's amaxes found beforehand (then no pass over t
    for them): column partials ``[P, C]`` (any P >= 1 blocks of rows), or for a tensorwise cast the
    tensor's amax ``[1]``."""
    from ..kernels.fp8_cast import cast_kernel

    R, C = t.shape
    per_column = not cast.tensorwise
    part = _part_triton(t) if amax is None else _checked_amax(amax, C, per_column, "amax")
    if per_column:
        inv = torch.empty((1, C), dtype=torch.float32, device=t.device)
    else:
        if part.dim() == 2:
            part = part.amax().reshape(1)  # the tensor's amax (deterministic: a max)
        inv = torch.empty((), dtype=torch.float32, device=t.device)
    R_pad = -(-R // pad_to) * pad_to if transpose else R
    y = torch.empty((C, R_pad) if transpose else (R, C), dtype=cast.dtype, device=t.device)
    _LAUNCH(cast_kernel, (triton_cdiv(R_pad, _BR), triton_cdiv(C, _BC)),
            (t, y, part, inv), (R, R_pad, C, t.stride(0), part.shape[0] if per_column else 1),
            dict(PER_COLUMN=per_column, TRANSPOSE=transpose, FP8_MAX=torch.finfo(cast.dtype).max, POW2=pow2, BR=_BR,
                 BC=_BC, BP=_BP, num_warps=4))
    return y, inv


def _checked_amax(amax: torch.Tensor, C: int, per_column: bool, name: str) -> torch.Tensor:
    if amax.dtype != torch.float32 or not (amax.dim() == 2 and amax.shape[0] >= 1 and amax.shape[1] == C
                                           or not per_column and tuple(amax.shape) == (1,)):
        want = f"[P, {C}]" if per_column else f"[P, {C}] or [1]"
        raise ValueError(f"{name}: expected fp32 amaxes of shape {want}, got {tuple(amax.shape)} {amax.dtype}")
    return amax if amax.is_contiguous() else amax.contiguous()


_FB, _FP = 128, 64  # dual finish: rows (columns) per program, partials per step
# ... of the backward stage's partials (many more column partials: one row per 8-token block): narrower
# column programs (more of them) and more partial rows per load, so that the finish keeps many loads
# in flight; the row partials are a few per token (one per program kind)
_FBC_STAGE, _FPC_STAGE, _FP_STAGE = 32, 256, 16


def _dual_triton(t: torch.Tensor, row_cast: Cast, col_cast: Cast, pow2: bool, pad_to: int = 1, parts=None):
    """``t [R, C]`` cast twice from two reads of it (session 21): ``(row data [R, C] row-major,
    its inverse scale [R, 1] or [], column data transposed [C, R_pad], its inverse scale [1, C] or
    [])``, each bitwise the one of ``cast_rows(t, row_cast)`` / ``cast_columns_t(t, col_cast)``.
    Launches: the tile amaxes (rows' and columns' partials, one read), the partials' reduction to
    scales (tiny), the cast (one read, both writes); a tensorwise scale's amax is ``part.amax()``.

    ``parts``: ``(row partials [n, R], column partials [m, C] or None)`` made beforehand (the backward
    stage's, of the values it stored: fp32 or t's dtype), each row's (column's) amax their max over
    the first dimension: the amax pass is skipped. The column partials are needed where
    ``col_cast`` is per column; the row partials always (a tensorwise amax is theirs)."""
    from ..kernels.fp8_cast import dual_amax_kernel, dual_cast_kernel, dual_finish_kernel

    R, C = t.shape
    dev = t.device
    row_per, col_per = not row_cast.tensorwise, not col_cast.tensorwise
    n_rb, n_cb = triton_cdiv(R, _BR), triton_cdiv(C, _BC)
    if parts is None:
        cpart = torch.empty((n_rb, C), dtype=torch.float32, device=dev)
        rpart = torch.empty((n_cb, R) if row_per else (1,), dtype=torch.float32, device=dev)
        _LAUNCH(dual_amax_kernel, (n_rb, n_cb), (t, rpart, cpart), (R, C, t.stride(0), n_cb),
                dict(ROW_PART=row_per, BR=_BR, BC=_BC, num_warps=4))
        n_rpart, n_cpart, fb_c, bp_r, bp_c = n_cb, n_rb, _FB, _FP, _FP
        tamax_of = cpart
    else:
        rpart, cpart = parts
        if rpart is None or rpart.dim() != 2 or rpart.shape[1] != R or not rpart.is_contiguous():
            raise ValueError(f"parts: row partials of shape [n, {R}] (contiguous) expected, got "
                             f"{None if rpart is None else tuple(rpart.shape)}")
        if col_per and (cpart is None or cpart.dim() != 2 or cpart.shape[1] != C or not cpart.is_contiguous()):
            raise ValueError(f"parts: column partials of shape [m, {C}] (contiguous) expected for per-column "
                             f"scales, got {None if cpart is None else tuple(cpart.shape)}")
        if cpart is None:
            cpart = rpart  # (never read: no per-column scales)
        n_rpart, n_cpart, fb_c, bp_r, bp_c = rpart.shape[0], cpart.shape[0], _FBC_STAGE, _FP_STAGE, _FPC_STAGE
        tamax_of = rpart  # every element is in exactly one row partial: the far smaller set
    f32 = dict(dtype=torch.float32, device=dev)
    r_inv = torch.empty((R, 1), **f32) if row_per else torch.empty((), **f32)
    c_inv = torch.empty((1, C), **f32) if col_per else torch.empty((), **f32)
    r_scale = torch.empty((R,), **f32) if row_per else r_inv
    c_scale = torch.empty((C,), **f32) if col_per else c_inv
    fmax_r, fmax_c = torch.finfo(row_cast.dtype).max, torch.finfo(col_cast.dtype).max
    if row_per or col_per:
        n_row_prog = triton_cdiv(R, _FB) if row_per else 0
        n_prog = n_row_prog + (triton_cdiv(C, fb_c) if col_per else 0)
        _LAUNCH(dual_finish_kernel, (n_prog,),
                (rpart, cpart, r_scale, r_inv, c_scale, c_inv), (R, C, n_rpart, n_cpart, n_row_prog),
                dict(ROW_PER=row_per, COL_PER=col_per, FP8_MAX_R=fmax_r, FP8_MAX_C=fmax_c, POW2=pow2, FB=_FB,
                     BP=bp_r, FBC=fb_c, BPC=bp_c, num_warps=4))
    # the tensor's amax (a max: deterministic)
    tamax = tamax_of.amax().reshape(1) if not (row_per and col_per) else cpart
    R_pad = triton_cdiv(R, pad_to) * pad_to
    yr = torch.empty((R, C), dtype=row_cast.dtype, device=dev)
    yt = torch.empty((C, R_pad), dtype=col_cast.dtype, device=dev)
    _LAUNCH(dual_cast_kernel, (triton_cdiv(R_pad, _BR), n_cb),
            (t, yr, yt, r_scale, c_scale, tamax, r_inv, c_inv), (R, R_pad, C, t.stride(0)),
            dict(ROW_PER=row_per, COL_PER=col_per, FP8_MAX_R=fmax_r, FP8_MAX_C=fmax_c, POW2=pow2, BR=_BR, BC=_BC,
                 num_warps=4))
    return yr, r_inv, yt, c_inv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def cast_rows(t: torch.Tensor, cast: Cast, pow2: bool, row_amax: Optional[torch.Tensor] = None):
    """(data ``[R, C]`` row-major, inverse scale ``[R, 1]`` or ``[]``): scales over each row
    (the operand whose rows are the GEMM's output rows, inner dimension C). ``row_amax``: t's row
    amax partials ``[n, R]`` found beforehand (see :func:`_rowwise_parts_triton`): a per-row cast on
    the GPU then makes no amax pass over t (elsewhere, and for a tensorwise cast, the amaxes are
    found again)."""
    if _triton(t):
        if t.stride(1) != 1:
            t = t.contiguous()
        if cast.tensorwise:
            return _cast_triton(t, cast, pow2, transpose=False)
        if row_amax is not None and t.numel() > 0:
            return _rowwise_parts_triton(t, cast, pow2, row_amax)
        return _rowwise_triton(t, cast, pow2)
    data, inv = cast_torch(t, cast, -1, pow2)
    return data.contiguous(), inv  # row-major whatever t's layout (cuBLASLt's FP8 GEMM takes a row-major a)


def cast_columns_t(t: torch.Tensor, cast: Cast, pow2: bool, pad_to: int = 1, amax: Optional[torch.Tensor] = None):
    """(data of ``t^T``, ``[C, R_pad]`` row-major; inverse scale ``[1, C]`` or ``[]``): scales over
    each column of ``t`` (the GEMM's inner dimension is R; padded with zeros to ``pad_to``).
    ``amax``: t's amaxes where found beforehand (see :func:`_cast_triton`; the GPU path reads them,
    the torch path recomputes)."""
    if _triton(t):
        if t.stride(1) != 1:
            t = t.contiguous()
        return _cast_triton(t, cast, pow2, transpose=True, pad_to=pad_to, amax=amax)
    data, inv = cast_torch(t, cast, 0, pow2)
    return data.t().contiguous(), inv


def cast_columns(t: torch.Tensor, cast: Cast, pow2: bool):
    """(data ``[R, C]`` column-major (a transposed view), inverse scale ``[1, C]`` or ``[]``):
    scales over each column (the second operand of a GEMM whose inner dimension is R)."""
    data_t, inv = cast_columns_t(t, cast, pow2)
    return data_t.t(), inv


# ------------------------------------------------------------------------ the GEMMs


def _inner_pad(t: torch.Tensor) -> int:
    return 16 if t.is_cuda else 1  # cuBLASLt's FP8 GEMMs take inner dimensions in multiples of 16


def _mm(a, sa, b, sb, out_dtype, fast, pow2, out=None):
    """``torch._scaled_mm`` with torchao's ``addmm_float8_unwrapped`` numerics. A rowwise-scaled
    GEMM without fast accumulation: torchao runs it unit-scaled and scales the output afterwards
    (two roundings); with power-of-two scales (``pow2``: its rowwise recipes) the scales in
    cuBLASLt's epilogue give the same values in one pass (session 17: bitwise equal, 3-4 % faster
    per fwd+bwd), otherwise torchao's way. Rowwise GEMMs write bf16 (fp16/fp32 converted after)."""
    if (sa.dim() == 0) != (sb.dim() == 0):  # one axiswise, one tensorwise: the scalar repeated (as torchao does)
        if sa.dim() == 0:
            sa = sa.repeat(a.shape[0]).reshape(-1, 1)
        else:
            sb = sb.repeat(b.shape[1]).reshape(1, -1)
    rowwise = sa.dim() == 2 and tuple(sa.shape) == (a.shape[0], 1) and tuple(sb.shape) == (1, b.shape[1])
    post = None
    if rowwise and not fast and not pow2:
        post, sa = (sa, sb), sa.new_ones(())
        sb = sa
    dt = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    y = _planned_scaled_mm(a, sa, b, sb, dt, fast, out) if a.is_cuda and dt == torch.bfloat16 else None
    if y is None:
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=dt, use_fast_accum=fast,
                             out=out if out is not None and out.dtype == dt else None)
    if post is not None:
        _outer_scale(y, *post)
    if dt != out_dtype:
        y = y.to(out_dtype)
        if out is not None:
            out.copy_(y)
            y = out
    return y


class _ScaledMatmulPlans:
    """:func:`_mm`'s planned cuBLASLt calls (``cublaslt.LtScaledMatmul``: torch._scaled_mm's call
    without its per-call heuristic query), by device, operand dtypes, sizes, scale kinds, fast
    accumulation and config; None kept where torch._scaled_mm serves. At ``capacity`` plans the
    oldest built is dropped."""

    def __init__(self, capacity: int = 128):
        self.capacity, self.plans, self.builds = capacity, {}, 0
        _device.register_plan_cache("fp8 scaled matmuls", self)

    def clear(self) -> None:
        self.plans.clear()

    def info(self) -> dict:
        return dict(plans=len(self.plans), builds=self.builds,
                    planned=sum(1 for p in list(self.plans.values()) if p is not None))

    def get(self, device, a_dtype, b_dtype, M, N, K, rowwise, fast):
        cfg = _config.current()
        key = (device, a_dtype, b_dtype, M, N, K, rowwise, fast, cfg)
        plan = self.plans.get(key, False)
        if plan is False:
            from .cublaslt import plan_scaled_matmul

            plan = plan_scaled_matmul(device, a_dtype, b_dtype, M, N, K, rowwise, rowwise, fast, cfg)
            if len(self.plans) >= self.capacity:
                self.plans.pop(next(iter(self.plans)), None)
            self.plans[key] = plan
            self.builds += 1
        return plan


_SCALED_MM = _ScaledMatmulPlans()


def _planned_scaled_mm(a, sa, b, sb, dt, fast, out):
    """``torch._scaled_mm(a, b, sa, sb, out_dtype=bf16, out=out)`` through its planned cuBLASLt call
    (the same algorithm, so the same bits), or None where that does not apply: operands not row-major
    ``a`` and column-major ``b``, scales neither both scalars nor ``[M, 1]`` and ``[1, N]`` contiguous
    fp32, an ``out`` of dtype ``dt`` laid out otherwise, no plan, or addresses its algorithm does not take."""
    M, K = a.shape
    rowwise = sa.dim() == 2
    N = b.shape[1]
    if a.stride() != (K, 1) or b.stride() != (1, K) or b.shape[0] != K:
        return None
    if sa.dtype != torch.float32 or sb.dtype != torch.float32 or not (sa.is_contiguous() and sb.is_contiguous()):
        return None
    if (tuple(sa.shape), tuple(sb.shape)) != (((M, 1), (1, N)) if rowwise else ((), ())):
        return None
    plan = _SCALED_MM.get(a.device, a.dtype, b.dtype, M, N, K, rowwise, bool(fast))
    if plan is None:
        return None
    if out is not None and out.dtype != dt:
        out = None  # (the caller converts into it)
    if out is not None and (tuple(out.shape) != (M, N) or out.stride() != (N, 1)):
        return None
    y = out if out is not None else torch.empty((M, N), dtype=dt, device=a.device)
    stream, capture = _device.call_state(a.device)
    if not plan(a.data_ptr(), b.data_ptr(), y.data_ptr(), sa.data_ptr(), sb.data_ptr(), stream, capture):
        return None
    return y


def _outer_scale(y: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor) -> None:
    """``y *= a_inv b_inv`` (``[R, 1]`` times ``[1, C]``, in fp32, y rounded once)."""
    if y.is_cuda and y.is_contiguous():
        from ..kernels.fp8_cast import outer_scale_kernel

        R, C = y.shape
        _LAUNCH(outer_scale_kernel, (triton_cdiv(R, _BR), triton_cdiv(C, _BC)), (y, a_inv, b_inv), (R, C),
                dict(BR=_BR, BC=_BC, num_warps=4))
    else:
        y *= a_inv * b_inv


def _col_scale(inv: torch.Tensor) -> torch.Tensor:
    """A scale of b's columns as ``_scaled_mm`` takes it: ``[1, N]`` (from ``[N, 1]``) or ``[]``."""
    return inv if inv.dim() == 0 else inv.reshape(1, -1)


def forward_operands(x2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, w_cast=None, x_cast=None) -> tuple:
    """``((x data [M, K] row-major, inverse scale [M, 1] or []), (W data [N, K] row-major, inverse scale
    [N, 1] or []))``: the forward GEMM's operands, each the cast made beforehand (``x_cast``:
    :func:`input_cast_keeping_amax`; ``w_cast``: :func:`weight_casts`) or cast here per ``r``. W's rows
    are the output's columns. The one-launch forward's FP8 build takes them as they are."""
    pow2 = r.round_scales_to_power_of_2
    x = _checked_cast(x_cast, x2d, "x_cast") if x_cast is not None else cast_rows(x2d, r.input, pow2)
    wc = _checked_cast(w_cast, w, "w_cast") if w_cast is not None else cast_rows(w, r.weight, pow2)
    return x, wc


def forward_operands_like(M: int, K: int, N: int, r: Fp8Recipe, device) -> tuple:
    """Empty tensors of the shapes, dtypes and strides :func:`forward_operands` gives recipe ``r``'s
    forward GEMM at ``M`` tokens, ``K`` inputs and ``N`` outputs (a plan's bound launch takes them)."""
    def like(rows: int, cast: Cast) -> tuple:
        scale = torch.empty(() if cast.tensorwise else (rows, 1), dtype=torch.float32, device=device)
        return torch.empty((rows, K), dtype=cast.dtype, device=device), scale

    return like(M, r.input), like(N, r.weight)


def forward(x2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, out: Optional[torch.Tensor] = None,
            w_cast=None, x_cast=None) -> torch.Tensor:
    """``x W^T`` ``[M, N]`` in x's dtype, both operands cast per ``r``; ``w_cast``: W's cast for
    this GEMM (data ``[N, K]``, inverse scale) where made beforehand (:func:`weight_casts`);
    ``x_cast``: x's (data ``[M, K]``, inverse scale; :func:`input_cast_keeping_amax`)."""
    if r.mx:
        return _mx_forward(x2d, w, r, out)
    (xa, xs), (wa, ws) = forward_operands(x2d, w, r, w_cast, x_cast)
    return _mm(xa, xs, wa.t(), _col_scale(ws), x2d.dtype, r.fast_accum[0], r.round_scales_to_power_of_2, out)


def grad_input(g2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, out: Optional[torch.Tensor] = None,
               g_cast=None, w_cast=None, g_row_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dX = dQKV W`` ``[M, K]``; ``g_cast``: dQKV's cast (data, inverse scale) where made beforehand;
    ``w_cast``: W's (data ``[N, K]`` column-major, inverse scale), kept from the forward
    (:func:`weight_casts`); ``g_row_amax``: dQKV's row amax partials for its cast here (``cast_rows``'
    ``row_amax``), or None. MX recipes cast both here (the other arguments None)."""
    if r.mx:
        return _mx_grad_input(g2d, w, r, out)
    ga, gs = (g_cast if g_cast is not None
              else cast_rows(g2d, r.grad_output, r.round_scales_to_power_of_2, g_row_amax))
    wb, ws = (_checked_cast(w_cast, w, "w_cast") if w_cast is not None
              else cast_columns(w, r.weight_for_grad_input, r.round_scales_to_power_of_2))
    return _mm(ga, gs, wb, ws, g2d.dtype, r.fast_accum[1], r.round_scales_to_power_of_2, out)


def grad_weight(g2d: torch.Tensor, x2d: torch.Tensor, r: Fp8Recipe, g_cast=None,
                x_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dW = dQKV^T X`` ``[N, K]``: in FP8 (both cast per channel, over the tokens), or in
    high precision where the recipe says so (``torch.mm``, as torchao runs it). ``g_cast``: dQKV's
    transposed cast (data ``[N, M_pad]``, inverse scale) where made beforehand; ``x_amax``: x's
    amaxes kept from the forward's cast of x (:func:`input_cast_keeping_amax`): x's cast here then
    makes no pass over x for them."""
    if r.grad_output_for_grad_weight.dtype is None:
        from . import host_gemm

        return host_gemm.mm(g2d.t(), x2d)
    if r.mx:
        return _mx_grad_weight(g2d, x2d, r)
    pow2, pad = r.round_scales_to_power_of_2, _inner_pad(g2d)
    if x_amax is not None:
        _checked_amax(x_amax, x2d.shape[1], not r.input_for_grad_weight.tensorwise, "x_amax")
    ga, gs = (g_cast if g_cast is not None  # [N, M_pad], [1, N]
              else cast_columns_t(g2d, r.grad_output_for_grad_weight, pow2, pad))
    xb, xs = cast_columns_t(x2d, r.input_for_grad_weight, pow2, pad, x_amax)  # [K, M_pad], [1, K]
    return _mm(ga, gs if gs.dim() == 0 else gs.reshape(-1, 1), xb.t(), xs, g2d.dtype, r.fast_accum[2], pow2)


# ------------------------------------------------------------------------ MX (mxfp8)

_MX_BR, _MX_BC = 32, 128  # MX cast tile: rows (a divisor of the scales' 128-row tiles), columns (4 blocks)


def mx_rceil_code(amax: torch.Tensor) -> torch.Tensor:
    """The e8m0 codes (int32) of torchao's RCEIL scales for fp32 block amaxes ``amax`` (>= 0, or NaN):
    ``ceil(log2(amax / 448)) + 127`` clamped to 0..254, exactly, from amax's bits: amax = 1.m * 2^E
    and 448 = 1.75 * 2^8, so the ceil is E - 8, plus one where 1.m > 1.75 (mantissa above 448's,
    0x600000); subnormal and zero amaxes give 0, inf 254, NaN 255 (torchao's codes). The kernel's
    ``RCEIL`` arithmetic, step by step."""
    bits = amax.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = torch.where(bits == 0x7F800000, 254, e.clamp(0, 254))
    return torch.where(bits > 0x7F800000, 255, e)


def mx_floor_code(amax: torch.Tensor) -> torch.Tensor:
    """The e8m0 codes (int32) of torchao's FLOOR scales for fp32 block amaxes: amax's exponent field
    less 8 (e4m3's largest power of two), clamped to 0..255 (inf 247); NaN 255."""
    bits = amax.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    return torch.where(bits > 0x7F800000, 255, ((bits >> 23) - 8).clamp(0, 255))


def mx_cast_torch(a: torch.Tensor, pad_to: int = MX_BLOCK, rceil: bool = False):
    """(codes ``[R, C_pad]`` e4m3 row-major, scales ``[R, C_pad / 32]`` e8m0): ``a [R, C]`` (any
    layout: a transposed view casts over its rows' blocks just as well) cast with one scale per 32
    values of a row, torchao's ``to_mx`` arithmetic op by op (FLOOR; ``rceil``: RCEIL, its scales
    the exact :func:`mx_rceil_code`); ``C_pad``: C rounded up to ``pad_to`` (a multiple of 32), the
    padding zeros."""
    R, C = a.shape
    C_pad = triton_cdiv(C, pad_to) * pad_to
    t = a.to(torch.float32)
    if C_pad != C:
        t = torch.nn.functional.pad(t, (0, C_pad - C))
    t = t.reshape(R, C_pad // MX_BLOCK, MX_BLOCK)
    amax = t.abs().amax(-1, keepdim=True)  # (NaN where the block has one)
    fmax = torch.finfo(E4M3).max
    if rceil:
        e = mx_rceil_code(amax)
        # torchao's reciprocal: 2^(127 - e), 1.0 for code 0, 2^-127 for 254 (inf), NaN for 255 (NaN)
        inv = torch.where(e == 0, 1.0, torch.where(e == 254, 2.0 ** -127,
                                                   ((254 - e).clamp(min=1) << 23).view(torch.float32)))
        inv = torch.where(e == 255, float("nan"), inv)
        data = t * inv
    else:
        e = mx_floor_code(amax)
        data = t / torch.clamp((e << 23).view(torch.float32), min=2.0 ** -126)
    data = torch.clamp(data, -fmax, fmax).to(E4M3).reshape(R, C_pad)
    return data, e.squeeze(-1).to(torch.uint8).view(torch.float8_e8m0fnu)


def mx_cast_triton(a: torch.Tensor, pad_to: int = MX_BLOCK, rceil: bool = False):
    """(codes ``[R, C_pad]`` e4m3 row-major, scales in cuBLAS's blocked layout, flat e8m0
    ``[cdiv(R, 128) * 128 * cdiv(C_pad / 32, 4) * 4]``): :func:`mx_cast_torch`'s cast of ``a``
    (through its strides: a transposed view is read in place) from one read, the scales as
    ``torch._scaled_mm`` takes them for MX (:mod:`fusedqkv.kernels.mx_cast`)."""
    from ..kernels.mx_cast import mx_cast_kernel
    from .config import INTERPRET

    R, C = a.shape
    C_pad = triton_cdiv(C, pad_to) * pad_to
    n_scale_cols = triton_cdiv(C_pad // MX_BLOCK, 4) * 4
    R_tiles = triton_cdiv(R, 128) * 128
    y = torch.empty((R, C_pad), dtype=torch.uint8, device=a.device)
    s = torch.empty((R_tiles * n_scale_cols,), dtype=torch.uint8, device=a.device)
    mx_cast_kernel[(R_tiles // _MX_BR, n_scale_cols * MX_BLOCK // _MX_BC)](
        a, y, s, R, C, C_pad, a.stride(0), a.stride(1), n_scale_cols, FP8_MAX=torch.finfo(E4M3).max,
        SOFT_ROUND=INTERPRET, BR=_MX_BR, BC=_MX_BC, RCEIL=rceil, num_warps=4)
    return y.view(E4M3), s.view(torch.float8_e8m0fnu)


def mx_cast(a: torch.Tensor, pad_to: int = MX_BLOCK, rceil: bool = False):
    """``a [R, C]`` cast for an MX GEMM with its blocks along the rows (the GEMM's inner dimension
    is C): the kernel on CUDA (scales blocked), :func:`mx_cast_torch` elsewhere (scales ``[R, C/32]``)."""
    return mx_cast_triton(a, pad_to, rceil) if _triton(a) else mx_cast_torch(a, pad_to, rceil)


def mx_mm(a, b, out_dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A B^T`` ``[R_a, R_b]`` from two MX casts (:func:`mx_cast`) of ``A [R_a, K]`` and ``B [R_b, K]``:
    on CUDA ``torch._scaled_mm`` with e8m0 block scales (as torchao's mxfp8 cuBLAS path issues it:
    bf16 out); on the CPU an emulation (what torchao's emulated MX GEMM computes): each block's
    codes times its scale in fp32, an fp32 product, one rounding to ``out_dtype``."""
    (ad, sa), (bd, sb) = a, b
    if ad.is_cuda:
        y = torch._scaled_mm(ad, bd.t(), sa, sb, out_dtype=torch.bfloat16)
    else:
        def dequant(d, s):
            scale = torch.exp2(s.view(torch.uint8).to(torch.float32) - 127)  # e8m0: 2^(e - 127), exact
            return (d.to(torch.float32).reshape(*s.shape, MX_BLOCK) * scale[..., None]).reshape(d.shape)

        y = dequant(ad, sa) @ dequant(bd, sb).t()
    if out is not None:
        out.copy_(y)
        return out
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _mx_forward(x2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, out=None) -> torch.Tensor:
    # x [M, K] and W [N, K], both blocked along K
    return mx_mm(mx_cast(x2d, rceil=r.rceil), mx_cast(w, rceil=r.rceil), x2d.dtype, out)


def _mx_grad_input(g2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, out=None) -> torch.Tensor:
    # dQKV [M, N] blocked along N; W^T [K, N] (a view: the kernel reads W in place) along N
    return mx_mm(mx_cast(g2d, rceil=r.rceil), mx_cast(w.t(), rceil=r.rceil), g2d.dtype, out)


def _mx_grad_weight(g2d: torch.Tensor, x2d: torch.Tensor, r: Fp8Recipe) -> torch.Tensor:
    # dQKV^T [N, M] and X^T [K, M] blocked along the tokens (M padded to 32 with zeros)
    return mx_mm(mx_cast(g2d.t(), rceil=r.rceil), mx_cast(x2d.t(), rceil=r.rceil), g2d.dtype)


# Session 21 (issue 35): dQKV's two casts from two reads of it instead of three (rowwise: three launches
# either way; tensorwise: three instead of six). Both casts are alive together until dX's GEMM has run (the
# peak grows by dQKV's fp8 copy, M x N bytes). False: each GEMM casts its own operand (the path before;
# benchmarks/bench_fp8.py --old-casts times both).
DUAL_CASTS = True


def _dual_ok(g2d: torch.Tensor, r: Fp8Recipe) -> bool:
    return (DUAL_CASTS and _triton(g2d) and g2d.numel() > 0 and r.grad_output_for_grad_weight.dtype is not None
            and not r.mx)


# dQKV's amax partials written by the backward stage as it stores dQKV (the dual cast's amax pass, a
# read of dQKV, skipped; bitwise the same scales). False: the casts read dQKV for them
# (benchmarks/bench_fp8.py --old-casts times both).
STAGE_AMAX = True
# ... including the column partials (dW's dQKV scaled per column: rowwise). Off: on the H200 the stage
# writing them ran 2.5x slower (92 -> 228 us at 091 8192), far more than the amax pass it saves (~31 us):
# such recipes keep the pass (NOTES, session 22)
STAGE_AMAX_COLUMNS = False
# ... the row partials also where dX's GEMM alone casts dQKV, per row (rowwise_with_gw_hp, or no dW): its
# row cast takes them instead of its amax pass (session 24). Needs STAGE_AMAX.
STAGE_AMAX_ROW_CAST = True
# ... for rows longer than this: shorter ones are cast whole from one read of dQKV anyway (_rowwise_triton;
# session 22's profile: ~4.25 TB/s at 091 8192), where the stage's row maxima would only add to its time
# (tensorwise's +4.5 us there). 0: every row length (benchmarks/bench_fp8.py --old-casts times it).
STAGE_AMAX_ROW_CAST_ABOVE = _WHOLE_ROW_MAX


def stage_amax(r: Optional[Fp8Recipe], need_x: bool, need_w: bool, columns: int = 0) -> tuple:
    """``(rows, columns)``: which of dQKV's amax partials :func:`backward` takes from the backward
    stage for recipe ``r`` (both False where none: :data:`STAGE_AMAX` off, no dX, bf16). With both
    GEMMs in FP8 the dual cast's: rows (each row's scale, or the tensor's amax) and columns where dW's
    dQKV is scaled per column; none with :data:`DUAL_CASTS` off, or columns needed and
    :data:`STAGE_AMAX_COLUMNS` off. With dX's GEMM alone casting dQKV (dW in high precision, or no
    dW): rows where that cast is per row, :data:`STAGE_AMAX_ROW_CAST` is on and dQKV's rows (its
    ``columns``) are longer than :data:`STAGE_AMAX_ROW_CAST_ABOVE`."""
    if not (STAGE_AMAX and r is not None and need_x) or r.mx:  # (MX: block amaxes, found by its cast)
        return False, False
    if need_w and r.grad_output_for_grad_weight.dtype is not None:  # the dual cast's
        columns = not r.grad_output_for_grad_weight.tensorwise
        if not DUAL_CASTS or columns and not STAGE_AMAX_COLUMNS:
            return False, False
        return True, columns
    return STAGE_AMAX_ROW_CAST and not r.grad_output.tensorwise and columns > STAGE_AMAX_ROW_CAST_ABOVE, False


def stage_amax_key(fp8_key: str) -> tuple:
    """The module flags :func:`stage_amax` reads, as a plan's key holds them (``()`` without FP8)."""
    if not (fp8_key and STAGE_AMAX):
        return ()
    return STAGE_AMAX, DUAL_CASTS, STAGE_AMAX_COLUMNS, STAGE_AMAX_ROW_CAST, STAGE_AMAX_ROW_CAST_ABOVE


def backward(g2d: torch.Tensor, x2d: torch.Tensor, w: torch.Tensor, r: Fp8Recipe, need_x: bool, need_w: bool,
             out: Optional[torch.Tensor] = None, w_cast=None, g_amax=None, x_amax: Optional[torch.Tensor] = None):
    """``(dX, dW)`` (None where not needed): :func:`grad_input` into ``out`` and :func:`grad_weight`,
    with dQKV's two casts (per row for dX, per column transposed for dW) from one amax pass and
    one cast pass where both GEMMs run in FP8 on the GPU (:func:`_dual_triton`); bitwise the same.
    ``w_cast``: W's cast for dX kept from the forward (:func:`weight_casts`), or None (cast here).
    ``g_amax``: dQKV's amax partials ``(rows, columns or None)`` from the backward stage
    (:func:`stage_amax`), or None (the casts' amax passes make them): the dual cast's, or the rows
    alone for dX's per-row cast where no dual cast runs. ``x_amax``: x's amaxes kept from the forward
    (:func:`input_cast_keeping_amax`), or None."""
    row = col = None
    if need_x and need_w and _dual_ok(g2d, r):
        if g2d.stride(1) != 1:
            g2d = g2d.contiguous()
        ga, gs, gt, gts = _dual_triton(g2d, r.grad_output, r.grad_output_for_grad_weight,
                                       r.round_scales_to_power_of_2, _inner_pad(g2d), parts=g_amax)
        row, col = (ga, gs), (gt, gts)
        del ga, gs, gt, gts
    g_row_amax = g_amax[0] if row is None and g_amax is not None else None
    dx = grad_input(g2d, w, r, out, g_cast=row, w_cast=w_cast, g_row_amax=g_row_amax) if need_x else None
    row = None  # dX's fp8 dQKV freed before dW's casts allocate (as on the one-cast path)
    dw = grad_weight(g2d, x2d, r, g_cast=col, x_amax=x_amax) if need_w else None
    return dx, dw


# W's two casts (the forward GEMM's, per row; the dX GEMM's, per column, transposed) from one amax pass
# and one cast pass of W in the forward, the dX one kept for the backward: N x K fp8 bytes held per
# layer from forward to backward. False: each GEMM casts W itself (benchmarks/bench_fp8.py --old-casts
# times both).
DUAL_WEIGHT_CASTS = True


def weight_casts(w: torch.Tensor, r: Fp8Recipe):
    """``((data [N, K] row-major, inverse scale), (data [N, K] column-major, inverse scale))``: W
    ``[N, K]`` cast for the forward GEMM (``r.weight``, each row's scale or the tensor's) and for
    the dX GEMM (``r.weight_for_grad_input``, each column's or the tensor's), bitwise
    ``cast_rows(w, r.weight)`` and ``cast_columns(w, r.weight_for_grad_input)``, from one read of W
    for the amaxes and one for both casts (:func:`_dual_triton`). None where each GEMM casts its own
    (:data:`DUAL_WEIGHT_CASTS` off, off the GPU, an empty W)."""
    if not (DUAL_WEIGHT_CASTS and _triton(w) and w.numel() > 0) or r.mx:
        return None
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if w.stride(1) != 1:
        w = w.contiguous()
    wa, ws, wt, wts = _dual_triton(w, r.weight, r.weight_for_grad_input, r.round_scales_to_power_of_2)
    return (wa, ws), (wt.t(), wts)


class FrozenWeightCasts:
    """A frozen weight's :func:`weight_casts` kept from call to call (``config.fp8_frozen_weight_cache``):
    one entry per weight tensor, found again only for the same tensor object (a weak reference: a new
    tensor at a freed address misses, as QLoRA's per-call dequantized weights do) with the same storage
    address, offset, shape, strides, dtype, version counter and recipe; dropped when the tensor dies.
    Never read or filled while a CUDA graph is being captured (a replay cannot consult a host cache: the
    graph holds the cast kernels) nor for a weight that requires grad (the optimizer changes it every
    step). Writes through ``.data`` leave the version counter as it was: such writers call
    :meth:`forget` (:func:`forget_frozen_weight_casts`); the HF integration does at every change of
    PEFT's merged state."""

    def __init__(self):
        self._entries = {}  # id(w) -> (weakref to w, key, casts)

    @staticmethod
    def _key(w: torch.Tensor, r: Fp8Recipe) -> tuple:
        return w.data_ptr(), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w._version, r.key

    def get(self, w: torch.Tensor, r: Fp8Recipe):
        """``weight_casts(w, r)``, kept for a frozen ``w`` (None where weight_casts gives None)."""
        if w.requires_grad or _device.capturing(w.device) or w.is_inference():
            return weight_casts(w, r)  # (an inference tensor keeps no version counter to key on)
        i, key = id(w), self._key(w, r)
        entry = self._entries.get(i)
        if entry is not None and entry[0]() is w and entry[1] == key:
            return entry[2]
        casts = weight_casts(w, r)
        if casts is None:
            self._entries.pop(i, None)
        else:
            self._entries[i] = (weakref.ref(w, lambda _ref, i=i, d=self._entries: d.pop(i, None)), key, casts)
        return casts

    def forget(self, w: Optional[torch.Tensor] = None) -> None:
        """Drop ``w``'s kept casts (every weight's where None)."""
        if w is None:
            self._entries.clear()
        else:
            self._entries.pop(id(w), None)

    def __len__(self) -> int:
        return len(self._entries)


# the one cache of frozen weights' casts (this module owns it)
FROZEN_WEIGHT_CASTS = FrozenWeightCasts()


def forget_frozen_weight_casts(w: Optional[torch.Tensor] = None) -> None:
    """Drop the kept FP8 casts of frozen weight ``w`` (of every weight where None): call after writing
    ``w`` through ``.data`` with ``config.fp8_frozen_weight_cache`` on."""
    FROZEN_WEIGHT_CASTS.forget(w)


def _checked_cast(cast, like: torch.Tensor, name: str):
    """``cast`` (data, inverse scale) made beforehand, refused unless its data has ``like``'s shape."""
    data, inv = cast
    if data.shape != like.shape:
        raise ValueError(f"{name}: a cast of a tensor of shape {tuple(data.shape)}, expected {tuple(like.shape)}")
    return data, inv


# x's amaxes for the dW GEMM's per-column (or tensorwise) cast of x found by the forward's cast of x, from
# the same read, and kept for the backward, whose cast of x then makes no amax pass over x. Held from
# forward to backward per layer: column partials of x (rowwise: cdiv(M, 2048) x K fp32 from 8192 tokens, a few
# rows below, where colamax_part_rows takes fewer rows per partial), or the tensor's amax (tensorwise). False:
# the dW GEMM's cast finds x's amaxes itself (benchmarks/bench_fp8.py --old-casts times both).
KEEP_INPUT_AMAX = True


def input_cast_keeping_amax(x2d: torch.Tensor, r: Fp8Recipe):
    """``((data [M, K] row-major, inverse scale), x_amax)``: x ``[M, K]`` cast for the forward GEMM
    (``r.input``), bitwise ``cast_rows(x2d, r.input)``, and x's amaxes for the dW GEMM's cast of x
    (``r.input_for_grad_weight``) found by the same pass: its column partials ``[P, K]`` (fp32; the
    per-row cast's partials of :func:`colamax_part_rows` rows, reduced in the forward by ``_BR`` of them, so
    P = ``cdiv(cdiv(M, rows per partial), _BR)``: the backward's cast reduces few) or, for a tensorwise dW cast, the
    tensor's amax ``[1]``. Pass ``x_amax`` to :func:`backward`. None where there is nothing to keep
    (:data:`KEEP_INPUT_AMAX` off, off the GPU, an empty x, dW in high precision)."""
    if not (KEEP_INPUT_AMAX and _triton(x2d) and x2d.numel() > 0 and r.input_for_grad_weight.dtype is not None
            and not r.mx):
        return None
    if x2d.dim() != 2:
        raise ValueError(f"x2d: expected a 2-D input [M, K], got shape {tuple(x2d.shape)}")
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    pow2, dw_per_column = r.round_scales_to_power_of_2, not r.input_for_grad_weight.tensorwise
    if r.input.tensorwise:  # the forward's cast needs the tensor's amax: its tile partials kept or reduced
        part = _part_triton(x2d)
        tamax = part.amax().reshape(1)
        xa, xs = _cast_triton(x2d, r.input, pow2, transpose=False, amax=tamax)
        return (xa, xs), part if dw_per_column else tamax
    xa, xs, part = _rowwise_colamax_triton(x2d, r.input, pow2)
    part = _part_triton(part)  # blocks of _BR partials (abs of an amax is itself): the backward reduces few
    return (xa, xs), part if dw_per_column else part.amax().reshape(1)
