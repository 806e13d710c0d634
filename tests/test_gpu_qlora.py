"""QLoRA in the fused block on the GPU (integrations.qlora with the Triton stages, bitsandbytes'
CUDA dequantization into the workspace in place): a tiny Qwen3 loaded 4-bit NF4 (double
quantisation, bf16 compute) under PEFT, fused against unfused by the three-way rule against the
same model in fp32 (the 4-bit weights dequantized to dense fp32 layers); and the fused QLoRA
block's forward+backward captured as a CUDA graph, replayed equal to eager. Skipped without a
CUDA GPU or bitsandbytes."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

import fusedqkv  # noqa: E402
from fusedqkv.integrations import qlora  # noqa: E402

import _hf_families as H  # noqa: E402
from _lora_checks import assert_bf16_like_peft, dense_copy, rel  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("order", ["apply_first", "peft_first"])
def test_gpu_qlora_bf16_three_way(tmp_path, order):
    H.build(H.family("qwen3"), bias=True, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)

    def load():  # bf16 activations (prepare_model_for_kbit_training would upcast them to fp32)
        return AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, device_map="cuda",
                                                    dtype=torch.bfloat16)

    cfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(3)
    ref = get_peft_model(load(), copy.deepcopy(cfg))
    m = load()
    if order == "apply_first":
        fusedqkv.apply_to(m)
        m = get_peft_model(m, copy.deepcopy(cfg))
    else:
        m = get_peft_model(m, copy.deepcopy(cfg))
        fusedqkv.apply_to(m)
    set_peft_model_state_dict(m, get_peft_model_state_dict(ref))
    ref32 = dense_copy(ref).float()
    ids = H.batch(2, 24).cuda()
    out = {}
    for name, model in (("fused", m), ("eager", ref), ("fp32", ref32)):
        model.train()
        model.zero_grad(set_to_none=True)
        o = model(input_ids=ids, labels=ids)
        o.loss.backward()
        out[name] = (o.logits.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad})
    assert H.fused_modules(m) and "qkv_proj" not in H.fused_modules(m)[0]._modules
    (lf, gf), (le, ge), (l32, g32) = out["fused"], out["eager"], out["fp32"]
    assert_bf16_like_peft(lf, gf, le, ge, l32, g32)


@cuda
def test_gpu_qlora_mixed_batch_adapter_names(tmp_path):
    """PEFT's mixed-batch inference (adapter_names) over the fused 4-bit q/k/v: logits by the three-way rule
    against the dense fp32 copy, beside PEFT's without fusedqkv; generate takes them too (its tokens not compared:
    a tiny random model's near-equal logits tie differently under bf16 rounding)."""
    H.build(H.family("qwen3"), bias=True, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)

    def load():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, device_map="cuda",
                                                    dtype=torch.bfloat16)

    models = []
    for fuse in (True, False):
        torch.manual_seed(4)
        x = get_peft_model(load(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
        x.add_adapter("second", LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
        if fuse:
            fusedqkv.apply_to(x)
        models.append(x)
    m, ref = models
    for a in ("default", "second"):
        set_peft_model_state_dict(m, get_peft_model_state_dict(ref, adapter_name=a), adapter_name=a)
    ref32 = dense_copy(ref).float()
    ids = H.batch(4, 24).cuda()
    names = ["second", "__base__", "default", "second"]
    with torch.no_grad():
        got, want = (x.eval()(input_ids=ids, adapter_names=names).logits.float() for x in (m, ref))
        want32 = ref32.eval()(input_ids=ids, adapter_names=names).logits.float()
    assert H.fused_modules(m)
    assert rel(got, want32) <= 2 * rel(want, want32) + 1e-3
    kw = dict(max_new_tokens=4, do_sample=False, adapter_names=names)
    assert m.generate(input_ids=ids, **kw).shape == (4, 28)


@cuda
def test_gpu_qlora_quant_storage_bf16_is_read_as_bytes(tmp_path):
    """``bnb_4bit_quant_storage=torch.bfloat16`` (FSDP's QLoRA recipe: the same packed bytes in a bf16 tensor):
    the fused block's logits and adapter gradients bitwise those of the uint8-stored model, on the one-launch
    dequantization and on bitsandbytes' own (session 41: the one-launch plan refused the bf16 tensor)."""
    from fusedqkv.ops import config as C

    H.build(H.family("qwen3"), bias=True, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    ids = H.batch(2, 24).cuda()
    for dequant in ("one_launch", "bitsandbytes"):
        out = []
        for storage in (torch.uint8, torch.bfloat16):
            q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                                   bnb_4bit_quant_storage=storage)
            m = AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, device_map="cuda",
                                                     dtype=torch.bfloat16)
            fusedqkv.apply_to(m)
            torch.manual_seed(5)
            m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
            assert m.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == storage
            with C.override(qlora_dequant=dequant):
                o = m(input_ids=ids, labels=ids)
                o.loss.backward()
            out.append((o.logits, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
        (l8, g8), (l16, g16) = out
        assert torch.equal(l8, l16), dequant
        assert sorted(g8) == sorted(g16) and all(torch.equal(g8[n], g16[n]) for n in g8), dequant


@cuda
@pytest.mark.parametrize("blocksize,nested", [(64, True), (128, False)])
def test_gpu_one_launch_dequant_equals_bitsandbytes_bitwise(blocksize, nested):
    """ops.dequant_4bit at the Qwen3-0.6B and 8B q/k/v shapes, bf16 and fp16: bitwise what bitsandbytes'
    CUDA ``dequantize_4bit`` gives each projection (the kept absmax: bitsandbytes' own dequantization)."""
    from bitsandbytes.functional import dequantize_4bit, dequantize_blockwise, quantize_4bit

    from fusedqkv.ops.dequant_4bit import Dequant4bit

    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        for hidden, rows in ((1024, (2048, 1024, 1024)), (4096, (4096, 1024, 1024))):
            quant = [quantize_4bit(torch.randn(r, hidden, device="cuda", dtype=dtype) / 8, blocksize=blocksize,
                                   compress_statistics=nested, quant_type="nf4") for r in rows]
            want = torch.cat([dequantize_4bit(q, qs) for q, qs in quant]).reshape(-1)
            absmax = []
            for _, qs in quant:
                a = qs.absmax.float() if not nested else dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
                absmax.append(a.float())
            plan = Dequant4bit([r * hidden for r in rows], blocksize, dtype, torch.device("cuda"))
            out = torch.full_like(want, float("nan"))
            code, packed = quant[0][1].code.float().cuda(), [q.reshape(-1) for q, _ in quant]
            plan.check(out, code, packed, absmax)
            for _ in range(2):  # the JIT launch, then the bound one
                out.fill_(float("nan"))
                plan(out, code, packed, absmax, torch.cuda.current_stream().cuda_stream)
                torch.cuda.synchronize()
                assert torch.equal(out, want), (dtype, hidden)
            # weights quantized from fp32 (their state's dtype fp32): bitsandbytes' fp32 values rounded once to
            # the block's dtype, as DequantizedQKV then copies them
            q32, qs32 = quantize_4bit(torch.randn(rows[1], hidden, device="cuda") / 8, blocksize=blocksize,
                                      compress_statistics=False, quant_type="nf4")
            one = Dequant4bit([rows[1] * hidden], blocksize, dtype, torch.device("cuda"))
            got = torch.empty(rows[1] * hidden, device="cuda", dtype=dtype)
            one(got, code, [q32.reshape(-1)], [qs32.absmax.float()], torch.cuda.current_stream().cuda_stream)
            assert torch.equal(got, dequantize_4bit(q32, qs32).reshape(-1).to(dtype)), (dtype, hidden)


@cuda
@pytest.mark.parametrize("keep_absmax", [False, True], ids=["bitsandbytes", "kept_absmax_one_launch"])
def test_gpu_qlora_block_under_cuda_graph(keep_absmax):
    """The QLoRA block with its adapters inside the op (qkv_lora) captured as a CUDA graph: the
    dequantization workspace during capture is the call's own (device.workspace), the backward
    dequantizes into another; replays equal the eager call (outputs, dX, every dA and dB), and no
    kept buffer is created by the capture. ``keep_absmax``: as the kept projection plan holds it (the
    absmax kept from the eager calls, q/k/v dequantized in one launch)."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from fusedqkv.integrations.peft import lora_operands
    from fusedqkv.ops import device as D

    torch.manual_seed(0)
    hidden, hq, hkv, d = 256, 4, 2, 64
    bases = []
    for rows in (hq * d, hkv * d, hkv * d):
        lin = bnb.nn.Linear4bit(hidden, rows, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                compress_statistics=True)
        lin.weight = bnb.nn.Params4bit(torch.randn(rows, hidden) / 16, requires_grad=False, quant_type="nf4",
                                       compress_statistics=True)
        bases.append(lin.cuda())
    src = qlora.DequantizedQKV(bases, torch.bfloat16, torch.device("cuda"), keep_absmax=keep_absmax)
    slots = []
    for name, base in zip(("q_proj", "k_proj", "v_proj"), bases):
        lora = LoraLinear4bit(base, "default", LoraConfig(r=8, lora_alpha=16, init_lora_weights=False), r=8,
                              lora_alpha=16, init_lora_weights=False)
        for mod in (lora.lora_A, lora.lora_B):
            mod.to(device="cuda", dtype=torch.bfloat16)
        slots.append((name, base, lora))
    adapters = [p for _, _, lo in slots for p in (lo.lora_A["default"].weight, lo.lora_B["default"].weight)]
    split = tuple(b.out_features for b in bases)
    x = torch.randn(2, 32, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wq = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    wk = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    ang = torch.arange(32, device="cuda")[None, :, None] / 100 ** (torch.arange(d, device="cuda") % (d // 2) / (d // 2))
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    gq = torch.randn(2, hq, 32, d, device="cuda", dtype=torch.bfloat16)

    def call():
        residual, lora = lora_operands(x, slots, split, sum(split))
        assert residual is None and lora is not None
        q, k, v = fusedqkv.gqa_qkv_rope_qk_norm(x, src(), wq, wk, cos, sin, num_heads=hq, num_kv_heads=hkv,
                                                qk_norm_position="before_rope", qkv_weight_source=src, qkv_lora=lora)
        # the outputs detached: a graph kept alive past the call holds AccumulateGrad nodes of the
        # default stream, which a capture on another stream must not depend on (torch warns of it)
        return (q.detach(), k.detach(), v.detach()) + torch.autograd.grad(
            (q, k, v), [x] + adapters, (gq, torch.ones_like(k), torch.ones_like(v)))

    want = [t.clone() for t in call()]
    assert (src._one_launch is not None) == keep_absmax
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    kept = [(b["kind"], b["stream"], b["bytes"]) for b in D.info()["buffers"]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    assert [(b["kind"], b["stream"], b["bytes"]) for b in D.info()["buffers"]] == kept
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
