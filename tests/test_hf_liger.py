"""fusedqkv.apply_to composes with Liger-Kernel's ``apply_liger_kernel_to_qwen3(model=...)``
in either order (issue 16), and with Liger's patch of every other family both support (issue 25:
Qwen3-VL(-MoE), Qwen3-Next, Qwen3.5(-MoE), HunYuan-MoE, EXAONE 4, OLMo 2/3, Gemma 4, Llama 4):
Liger keeps its RMSNorm (also on q_norm/k_norm, whose weights the fused block reads), SwiGLU
and fused linear cross-entropy; fusedqkv takes the attention input.
Skipped when liger_kernel is not installed.

Liger's Triton kernels do not run under the Triton CPU interpreter, so without a GPU the
autograd Functions that Liger's patched modules call are replaced, for the test, by
plain-PyTorch equivalents: what is tested on the CPU is the composition -- which modules and
forwards each library patches, that neither undoes the other, that the fused attention reads
the Liger-patched norms' weights and eps, and the numbers of the composed model (fp32, against
the unpatched HF model). With a GPU the real kernels run (and benchmarks/bench_hf.py measures
the composition at size)."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")
liger_tf = pytest.importorskip("liger_kernel.transformers")

import _hf_models as H  # noqa: E402

import fusedqkv  # noqa: E402

import transformers  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402


class _RMSNorm:  # LigerRMSNormFunction
    @staticmethod
    def apply(x, w, eps, offset, casting_mode, in_place, row_mode):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if casting_mode == "gemma":
            return (y * (offset + w.float())).to(x.dtype)
        return (offset + w) * y.to(x.dtype)


class _SiLUMul:  # LigerSiLUMulFunction
    @staticmethod
    def apply(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        assert gate_multiplier == 1.0 and down_multiplier == 1.0
        return F.silu(a) * b


class _FusedLinearCE:  # LigerFusedLinearCrossEntropyFunction
    @staticmethod
    def apply(x, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, *rest):
        assert ce_weight is None and lse_square_scale == 0.0
        logits = F.linear(x, weight, bias).float()
        if softcap is not None:  # Gemma's final logit soft-capping
            logits = softcap * torch.tanh(logits / softcap)
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss, None, None, None


def _stand_ins(monkeypatch):
    """On the CPU, Liger's Triton Functions replaced by the torch stand-ins above."""
    if torch.cuda.is_available():
        return
    for module, name, stand_in in (("rms_norm", "LigerRMSNormFunction", _RMSNorm),
                                   ("swiglu", "LigerSiLUMulFunction", _SiLUMul),
                                   ("swiglu", "LigerFusedMoEFunction", _FusedMoE),
                                   ("geglu", "LigerGELUMulFunction", _GELUMul),
                                   ("functional", "LigerFusedLinearCrossEntropyFunction", _FusedLinearCE)):
        monkeypatch.setattr(sys.modules[f"liger_kernel.transformers.{module}"], name, stand_in)


def _restore(saved: dict) -> None:
    """Modules' attributes back to ``saved`` ({module name: dict(vars(module))}): Liger patches
    transformers' modeling modules in place."""
    for name, before in saved.items():
        mod = sys.modules[name]
        for k in list(vars(mod)):
            if k not in before:
                delattr(mod, k)
        for k, v in before.items():
            if vars(mod).get(k) is not v:
                setattr(mod, k, v)


@pytest.fixture
def liger_env(monkeypatch):
    """Undo Liger's module-level patches of transformers after the test (they would change
    every Qwen3 model built later in the session); on the CPU, the stand-ins above."""
    saved = {modeling_qwen3.__name__: dict(vars(modeling_qwen3))}
    _stand_ins(monkeypatch)
    yield
    _restore(saved)


def _bound(module, name):
    f = module.__dict__.get(name)
    return getattr(f, "__func__", None)


@pytest.mark.parametrize("order", ["liger_first", "fusedqkv_first"])
def test_liger_and_fusedqkv_in_either_order(order, liger_env):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = H.build("qwen3", bias=True).to(device)
    ids = H.batch(2, 12).to(device)
    # the unpatched reference first: Liger's rope patch is module-wide
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    sd_ref = ref.state_dict()

    m = copy.deepcopy(ref)
    m.zero_grad(set_to_none=True)
    if order == "liger_first":
        liger_tf.apply_liger_kernel_to_qwen3(model=m)
        assert fusedqkv.apply_to(m) == 2
    else:
        assert fusedqkv.apply_to(m) == 2
        liger_tf.apply_liger_kernel_to_qwen3(model=m)

    # Liger kept its RMSNorm (q_norm/k_norm included), SwiGLU and fused linear cross-entropy ...
    for layer in m.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                     layer.self_attn.k_norm):
            assert _bound(norm, "forward") is LigerRMSNorm.forward
        assert _bound(layer.mlp, "forward") is LigerSwiGLUMLP.forward
        # ... and fusedqkv has the attention input
        assert type(layer.self_attn).__name__ == "FusedQKVQwen3Attention"
        assert type(layer.self_attn.q_proj).__name__ == "ProjectionRows" and "qkv_proj" in layer.self_attn._modules
    assert _bound(m.model.norm, "forward") is LigerRMSNorm.forward
    assert getattr(_bound(m, "forward"), "__module__", "") == "liger_kernel.transformers.model.qwen3"
    assert list(m.state_dict()) == list(sd_ref)

    loss = m(input_ids=ids, labels=ids).loss
    tol = 1e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    loss.backward()
    got = dict(m.named_parameters())
    want = dict(ref.named_parameters())
    for name, p in got.items():
        if ".qkv_proj." in name:
            base, kind = name.split(".qkv_proj.")
            g = torch.cat([want[f"{base}.{proj}.{kind}"].grad for proj in ("q_proj", "k_proj", "v_proj")])
        else:
            g = want[name].grad
        err = float((p.grad - g).abs().max() / g.abs().max())
        assert err < 10 * tol, (name, err)


# --------------------------------------------------------------------------- every family Liger supports


class _GELUMul:  # LigerGELUMulFunction (tanh GELU, as HF's gelu_pytorch_tanh)
    @staticmethod
    def apply(a, b):
        return F.gelu(a, approximate="tanh") * b


class _FusedMoE:  # LigerFusedMoEFunction: top-k experts, each down(silu(gate) * up) with [gate | up] rows
    @staticmethod
    def apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for k in range(top_k_index.shape[1]):
            e = top_k_index[:, k].long()
            gate, up = torch.einsum("th,tih->ti", x, gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.einsum("ti,thi->th", F.silu(gate) * up, down_proj[e])
            out = out + top_k_weights[:, k, None].to(y.dtype) * y
        return out


@pytest.fixture
def liger_env_all(monkeypatch):
    """As liger_env, for every transformers modeling module (Liger patches the family's); all
    SUPPORTED families' modules are imported first, so that a patch of one imported during the
    test is undone too."""
    import importlib

    from fusedqkv.integrations.transformers import SUPPORTED

    for arch in SUPPORTED:
        try:
            importlib.import_module(arch.modeling)
        except ImportError:  # a family newer than the installed transformers
            pass
    saved = {name: dict(vars(mod)) for name, mod in list(sys.modules.items())
             if name.startswith("transformers.models.") and mod is not None}
    _stand_ins(monkeypatch)
    yield
    _restore(saved)


def _liger_families():
    import _hf_families as HF
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    out = []
    for fam in HF.FAMILIES:
        top = fam.composite[0] if fam.composite else None
        # the model_type Liger dispatches on: the composite model's, else the family's
        mt = {"Qwen3VLConfig": "qwen3_vl", "Qwen3VLMoeConfig": "qwen3_vl_moe"}.get(top, fam.name if not top else None)
        if mt in MODEL_TYPE_TO_APPLY_LIGER_FN:
            out.append(fam)
    return out


def _liger_modules(model):
    """names of the modules whose class or bound forward is Liger-Kernel's"""
    return {name for name, mod in model.named_modules()
            if type(mod).__module__.startswith("liger_kernel")
            or getattr(_bound(mod, "forward"), "__module__", "").startswith("liger_kernel")}


@pytest.mark.parametrize("order", ["liger_first", "fusedqkv_first"])
@pytest.mark.parametrize("fam", _liger_families(), ids=lambda f: f.name)
def test_liger_composes_with_every_family_it_supports(fam, order, liger_env_all):
    import _hf_families as HF
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = HF.build(fam, fam.bias).to(device).train()
    ids = HF.batch(2, 12).to(device)
    ref_loss = ref(input_ids=ids, labels=ids).loss  # before Liger's module-wide patches
    ref_loss.backward()
    liger_only = copy.deepcopy(ref)
    try:
        _apply_liger_kernel_to_instance(model=liger_only)
    except ImportError as e:  # a Liger release older than the transformers release
        pytest.skip(f"Liger-Kernel cannot patch {fam.name} with this transformers: {e}")
    try:  # Liger alone, no fusedqkv: its own forward may not know this transformers' outputs yet
        liger_loss = liger_only(input_ids=ids, labels=ids).loss
    except (AttributeError, TypeError) as e:  # (liger-kernel 0.8.5's Qwen3-VL-MoE head on transformers 5.25)
        pytest.skip(f"Liger-Kernel's own forward of {fam.name} fails with transformers {transformers.__version__}: "
                    f"{type(e).__name__}: {e}")
    tol = 1e-5 if device == "cpu" else 2e-3
    torch.testing.assert_close(liger_loss, ref_loss, rtol=tol, atol=tol)
    m = copy.deepcopy(ref)
    m.zero_grad(set_to_none=True)
    if order == "liger_first":
        _apply_liger_kernel_to_instance(model=m)
        assert fusedqkv.apply_to(m) == fam.n_fused
    else:
        assert fusedqkv.apply_to(m) == fam.n_fused
        _apply_liger_kernel_to_instance(model=m)
    # fusedqkv took the attention input, and every module Liger patches alone is Liger's here too
    assert all(type(a).__name__.startswith("FusedQKV") for a in m.modules() if hasattr(a, "_fusedqkv"))
    assert _liger_modules(liger_only) and _liger_modules(m) == _liger_modules(liger_only)
    assert list(m.state_dict()) == list(ref.state_dict())
    loss = m(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    loss.backward()
    got, want = dict(m.named_parameters()), dict(ref.named_parameters())
    for name, p in got.items():
        if ".qkv_proj." in name:
            base, kind = name.split(".qkv_proj.")
            attn = m.get_submodule(base)
            g = torch.cat([want[f"{base}.{proj}.{kind}"].grad for proj in attn._fusedqkv.projs])
        else:
            g = want[name].grad
        if g is None:
            assert p.grad is None, name
            continue
        err = float((p.grad - g).abs().max())
        assert err <= 10 * tol * float(g.abs().max()) + 1e-8, (name, err)
