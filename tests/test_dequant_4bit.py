"""The one-launch NF4 dequantization (ops/dequant_4bit.py, kernels/dequant_4bit.py) against
bitsandbytes' own ``dequantize_4bit`` (its CPU path: ``code[nibble] * absmax`` in fp32), under the
interpreter; and QLoRA's fused weight built by it inside the kept plan. Skipped without
bitsandbytes (CI does not install it: a 43 MB wheel); the GPU bitwise check is test_gpu_qlora.py's."""

import pytest
import torch

from fusedqkv.ops import config
from fusedqkv.ops.config import INTERPRET
from fusedqkv.ops.dequant_4bit import Dequant4bit, supported

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit, dequantize_blockwise, quantize_4bit  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the kernel runs on the CPU under TRITON_INTERPRET=1")


def _flat_absmax(qs):
    """The state's absmax as the kernel takes it: fp32, dequantized where double-quantized."""
    if not qs.nested:
        return qs.absmax.float()
    a = dequantize_blockwise(qs.absmax, qs.state2)
    a += qs.offset
    return a.float()


def _by_hand(q, code, absmax, blocksize):
    """``code[nibble] * absmax[value // blocksize]`` in fp32, the high nibble first: bitsandbytes'
    4-bit layout and its CUDA kernel's arithmetic, written out."""
    b = q.reshape(-1).to(torch.int64)
    nibbles = torch.stack([b >> 4, b & 15], 1).reshape(-1)
    return code[nibbles] * absmax.repeat_interleave(blocksize)[:nibbles.numel()]


@pytest.mark.parametrize("blocksize,nested,cols", [(64, True, 64), (64, False, 96), (128, False, 128)])
def test_parts_equal_bitsandbytes_bitwise_in_fp32(blocksize, nested, cols):
    """Three parts (q/k/v rows of one hidden size) into one buffer: bitwise bitsandbytes'
    ``dequantize_4bit`` and the by-hand values. (bitsandbytes' CPU kernel blocks each row on its own,
    so its rows are as long as a multiple of the blocksize here; its CUDA kernel, like ours and the
    by-hand values, blocks the flat weight.)"""
    g = torch.Generator().manual_seed(3)
    shapes = [(40, cols), (24, cols), (8, cols)]
    weights = [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(shapes)]
    quant = [quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4") for w in weights]
    values = [w.numel() for w in weights]
    plan = Dequant4bit(values, blocksize, torch.float32, torch.device("cpu"))
    out = torch.full((sum(values),), float("nan"))
    code = quant[0][1].code.float()
    packed, absmax = [q.reshape(-1) for q, _ in quant], [_flat_absmax(qs) for _, qs in quant]
    plan.check(out, code, packed, absmax)
    plan(out, code, packed, absmax, 0)
    by_hand = torch.cat([_by_hand(q, code, a, blocksize) for q, a in zip(packed, absmax)])
    assert torch.equal(out, by_hand)
    if cols % blocksize == 0:
        assert torch.equal(out, torch.cat([dequantize_4bit(q, qs) for q, qs in quant]).reshape(-1))


def test_bf16_output_within_one_rounding_of_the_fp32_values():
    """bf16 out: the fp32 value rounded once (the interpreter rounds toward zero, the GPU to nearest:
    within one bf16 ulp either way; the GPU test checks bitwise)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 128, generator=g)
    q, qs = quantize_4bit(w, blocksize=64, quant_type="nf4")
    exact = dequantize_4bit(q, qs).reshape(-1)
    plan = Dequant4bit([w.numel()], 64, torch.bfloat16, torch.device("cpu"))
    out = torch.empty(w.numel(), dtype=torch.bfloat16)
    plan(out, qs.code.float(), [q.reshape(-1)], [qs.absmax.float()], 0)
    ulp = exact.abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((out.float() - exact).abs() <= ulp).all())


def test_refusals_and_operand_errors_name_what_is_wrong():
    cpu = torch.device("cpu")
    assert "even" in supported([63], 64, torch.float32, cpu)
    assert "blocksize" in supported([64], 48, torch.float32, cpu)
    assert "parts" in supported([64] * 5, 64, torch.float32, cpu)
    assert "dtype" in supported([64], 64, torch.float64, cpu)
    with pytest.raises(ValueError, match="blocksize 48"):
        Dequant4bit([64], 48, torch.float32, cpu)
    plan = Dequant4bit([128, 64], 64, torch.float32, cpu)
    ok = dict(out=torch.empty(192), code=torch.zeros(16), packed=[torch.zeros(64, dtype=torch.uint8),
                                                                  torch.zeros(32, dtype=torch.uint8)],
              absmax=[torch.zeros(2), torch.zeros(1)])
    plan.check(**ok)
    with pytest.raises(ValueError, match=r"packed\[1\]"):
        plan.check(**dict(ok, packed=[ok["packed"][0], torch.zeros(31, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match=r"absmax\[0\]"):
        plan.check(**dict(ok, absmax=[torch.zeros(2, dtype=torch.float16), ok["absmax"][1]]))
    with pytest.raises(ValueError, match="out"):
        plan.check(**dict(ok, out=torch.empty(191)))
    with pytest.raises(ValueError, match="code.*on cpu, got torch.float32 .* on meta"):
        plan.check(**dict(ok, code=torch.zeros(16, device="meta")))


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16_storage"])
def test_the_fused_qlora_weight_takes_one_launch_and_equals_bitsandbytes(storage):
    """A QLoRA layer's fused weight inside the kept plan: one launch for q/k/v, bitwise what
    bitsandbytes' own dequantization (config.qlora_dequant "bitsandbytes") gives; also where the packed
    codes are stored as bf16 (``bnb_4bit_quant_storage``, FSDP's QLoRA recipe: the same bytes; session 41:
    the one-launch plan refused them)."""
    from fusedqkv.integrations.qlora import DequantizedQKV
    from fusedqkv.ops import dequant_4bit as D

    g = torch.Generator().manual_seed(5)
    bases = []
    for rows in (32, 16, 16):
        lin = bnb.nn.Linear4bit(64, rows, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        lin.weight = bnb.nn.Params4bit(torch.randn(rows, 64, generator=g), requires_grad=False, quant_type="nf4",
                                       compress_statistics=True, quant_storage=storage).to("cpu")
        assert lin.weight.dtype == storage
        bases.append(lin)
    source = DequantizedQKV(bases, torch.float32, torch.device("cpu"), keep_absmax=True)
    with config.override(qlora_dequant="bitsandbytes"):
        want = source().clone()
    calls = []
    real = D.Dequant4bit.__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D.Dequant4bit, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
        got = source().clone()
        again = source().clone()
    assert len(calls) == 2 and torch.equal(got, want) and torch.equal(again, want)
    direct = torch.cat([dequantize_4bit(m.weight.data, m.weight.quant_state) for m in bases])
    assert torch.equal(got, direct)
