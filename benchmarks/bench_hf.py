"""Full training steps of a Hugging Face model with and without ``fusedqkv.apply_to`` (issues 16, 25).

--family qwen3 (default, issue 16): a Qwen3-0.6B-shaped model cut to 4 layers (random init;
hidden 1024, 16 query / 8 KV heads of 128, intermediate 3072, vocab 151936).
--family qwen3_5_text (issue 25): a Qwen3.5-9B-shaped text model (Qwen3_5TextConfig's defaults,
which transformers documents as the Qwen3.5-9B configuration: hidden 4096, 16 query / 4 KV heads
of 256, gated q, intermediate 12288, vocab 248320; Qwen3.5's rotary: theta 1e7, partial 0.25,
mRoPE sections [11, 11, 10] interleaved) cut to --layers 4, every layer full attention
(``layer_types``): HF's linear-attention layers without their fla/causal-conv1d kernels would
swamp the step.
Both: batch x seq 4 x 2048, bf16 parameters, AdamW, HF's default attention backend (sdpa).
Stacks, each from the same initial weights on the same data:

  hf                   transformers as is (eager PyTorch, no compile)
  hf+fusedqkv          ... + fusedqkv.apply_to(model)
  hf+liger             ... + Liger-Kernel's apply_liger_kernel_to_<family>(model=...) (RMSNorm,
                       RoPE, SwiGLU, fused linear cross-entropy)
  hf+liger+fusedqkv    both (Liger first)
  compile(hf)          torch.compile(model) of the hf stack (inductor; aot_eager on the CPU)
  compile(hf+fusedqkv) torch.compile(model) after fusedqkv.apply_to(model)

plus ``hf-fp32`` (the hf stack in fp32, same initial values) as the yardstick of bf16 noise.
With --lora, ``hf+fusedqkv:dense-qkv`` is a bound, not a setup: the hf+fusedqkv stack with q/k/v
left dense (bf16, not quantized by --qlora) and without adapters, the MLP and o_proj as in the
other stacks. Its step is what hf+fusedqkv would take if q/k/v's adapters and dequantization cost
nothing, so ``1 - bound / hf`` is the most any attention input can cut from the hf step: a target
above it is out of reach for the block (the table says so). Its loss is another model's: not judged.
Default stacks: qwen3 hf-fp32, hf, hf+fusedqkv and the two Liger stacks; qwen3_5_text hf-fp32,
hf, hf+fusedqkv, compile(hf), compile(hf+fusedqkv).
For each: the loss of every step (--steps: qwen3 50, qwen3_5_text 30), the step time (median over the steps
after --warmup, CUDA events; the first step of a compile stack compiles) and peak allocated
memory. Done criteria per stack pair (hf / hf+fusedqkv, the Liger pair, the compile pair): step
time lower with fusedqkv by at least the family's target (qwen3: 25 %, issue 16; qwen3_5_text:
no slower -- the attention input is a smaller share of a step with a 248k vocabulary and a
12288 MLP), peak memory at most 5 % above, and the loss curves within bf16 noise: max over
steps |loss_fused - loss_base| <= 2 max |loss_hf - loss_hf_fp32| + 1e-3 (without hf-fp32 in --stacks the
noise is unmeasured: no pair's loss is judged, and no pair passes).

Writes --out/bench_hf.json and --out/bench_hf_loss.png (matplotlib; ``--plot JSON`` redraws
the PNG from a JSON elsewhere), prints a table last, exits 1 when a criterion fails.

--lora R (issue 34): PEFT LoRA of rank R on every linear layer (all-linear, alpha 2R, base frozen)
in every stack, after apply_to in the fused ones; targets 12 % (qwen3_8b, 4 layers) and 25 %
(qwen3 at --layers 28) less step time than PEFT without fusedqkv:

    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 --lora-init random \
        --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/lora8b
    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 \
        --lora-init random --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/lora06b

--autocast: bf16 autocast around each forward, as the HF Trainer's ``bf16=True``; with --lora, PEFT's
fp32 adapters then compute in bf16 and the fused block runs them inside the op (without it, a bf16
model with PEFT's fp32 adapters takes the residual path, as PEFT rounds their update to bf16).

--interleave: every stack built before the first step, then one step of each per round, the order
rotated every round, so that a host whose speed drifts (the device hosts swing by +-20 % within a
run) weighs on every stack alike; peak memory per stack is then its model's memory plus its steps'
largest peak above what was allocated when they started. Not with compile stacks. The QLoRA row:

    PYTHONPATH=src:/tmp/site TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3 --layers 28 --lora 16 \
        --lora-init random --autocast --qlora nf4 --interleave --stacks hf-fp32,hf,hf+fusedqkv,hf+fusedqkv:dense-qkv \
        --steps 20 --out $OUT/qlora06

--fp8 RECIPE (issue 35): torchao float8 training (convert_to_float8_training) of every linear but
lm_head in the hf/compile(hf) stacks, and apply_to(model, fp8=RECIPE) with q/k/v left to the block
in the fused ones; ``hf-bf16`` and ``compile(hf-bf16)`` are the same without float8. Loss rule:
max over steps |loss_fused - loss_bf16| <= 1.25 max over steps |loss_torchao - loss_bf16| + 1e-3
(the spread torchao's own FP8 run shows against bf16); speed: the fused stack faster than its
torchao pair (torchao carried as a wheel):

    PYTHONPATH=src:/tmp/site TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3_8b --fp8 rowwise \
        --stacks "hf-bf16,compile(hf-bf16),compile(hf),compile(hf+fusedqkv)" --steps 100 --out $OUT/fp8_8b

--qlora nf4 (with --lora): QLoRA, every decoder linear bitsandbytes 4-bit (double quantisation,
compute dtype the stack's) before apply_to, as a model loaded with BitsAndBytesConfig is:

    PYTHONPATH=src:/tmp/site TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3_8b --lora 16 \
        --qlora nf4 --lora-init random --stacks hf-fp32,hf,hf+fusedqkv --steps 30 --out $OUT/qlora8b

Device (Liger carried as a wheel in .whl/, found there when liger_kernel is not installed):

    PYTHONPATH=src python3 benchmarks/bench_hf.py --out benchmarks/results/<run>/hf
    # issue 25, ~4 minutes on an H200 (estimate: the bf16 stacks ~0.2 s a step, the fp32 yardstick
    # ~2 s, each compile(...) stack's first step compiles the whole model, ~1 minute)
    PYTHONPATH=src TRITON_INTERPRET=0 python3 benchmarks/bench_hf.py --family qwen3_5_text --out $OUT/hf35

CPU check of the script's logic (tiny model, few steps; Liger stacks need a GPU; the speed
and memory criteria are not judged):

    PYTHONPATH=src python benchmarks/bench_hf.py --tiny --out /tmp/bench_hf_tiny
    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/bench_hf.py --tiny --family qwen3_5_text --out /tmp/hf35
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import engine_thread  # noqa: E402

# Qwen3-0.6B's config.json, 4 layers
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                 max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                 tie_word_embeddings=True, attention_bias=False, hidden_act="silu")
TINY = dict(QWEN3_06B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# Qwen3_5TextConfig's defaults (transformers: "the Qwen3.5-9B style configuration") with the
# released Qwen3.5 rotary (theta 1e7, partial 0.25, interleaved mRoPE [11, 11, 10]); 4 layers,
# every one full attention (layer_types is set from num_hidden_layers)
QWEN3_5_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True})
# the tiny mRoPE sections add up to the tiny rotary half (32 * 0.25 / 2 = 4)
TINY_QWEN3_5 = dict(QWEN3_5_9B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                    rope_parameters=dict(QWEN3_5_9B["rope_parameters"], mrope_section=[2, 1, 1]))

# Qwen3-8B's config.json, 4 layers (issue 34's LoRA runs)
QWEN3_8B = dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                tie_word_embeddings=False)
# --lora: the step-time targets of issue 34 (PEFT LoRA all-linear, base frozen)
LORA_MIN_STEP_REDUCTION = {"qwen3_8b": 0.12, "qwen3": 0.25}

STACKS = ("hf-fp32", "hf", "hf+fusedqkv", "hf+liger", "hf+liger+fusedqkv", "compile(hf)", "compile(hf+fusedqkv)",
          "hf-bf16", "compile(hf-bf16)", "hf+fusedqkv:dense-qkv")
DENSE_QKV = "hf+fusedqkv:dense-qkv"  # --lora: the bound above (q/k/v dense, no adapters on them)
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
# with --fp8: the bf16 stacks without float8 (the yardstick of torchao's FP8 loss spread)
BF16_OF = {"hf": "hf-bf16", "hf+fusedqkv": "hf-bf16", "compile(hf)": "compile(hf-bf16)",
           "compile(hf+fusedqkv)": "compile(hf-bf16)"}
BF16_STACKS = frozenset(BF16_OF.values())
FP8_SPREAD_FACTOR = 1.25  # --fp8 loss rule: fused's distance from bf16 <= 1.25 x torchao's + 1e-3
PAIRS = (("hf", "hf+fusedqkv"), ("hf+liger", "hf+liger+fusedqkv"), ("compile(hf)", "compile(hf+fusedqkv)"))
MIN_STEP_REDUCTION = 0.25  # qwen3's target (issue 16)
MAX_MEM_RATIO = 1.05


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family the script builds: its config and model classes, sizes, Liger patch and
    the stacks and step-time target it runs by default."""

    config_class: str
    model_class: str
    sizes: dict
    tiny: dict
    label: str             # what the model is shaped like
    liger: str             # liger_kernel.transformers' patch function
    stacks: tuple          # default --stacks
    steps: int             # default --steps
    min_step_reduction: float
    all_full_attention: bool = False  # hybrid family: every layer set to full attention


FAMILIES = {
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", QWEN3_06B, TINY, "Qwen3-0.6B", "apply_liger_kernel_to_qwen3",
                    STACKS[:5], 50, MIN_STEP_REDUCTION),
    "qwen3_8b": Family("Qwen3Config", "Qwen3ForCausalLM", QWEN3_8B, TINY, "Qwen3-8B", "apply_liger_kernel_to_qwen3",
                       ("hf-fp32", "hf", "hf+fusedqkv"), 30, MIN_STEP_REDUCTION),
    "qwen3_5_text": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5_9B, TINY_QWEN3_5, "Qwen3.5-9B",
                           "apply_liger_kernel_to_qwen3_5",
                           # 30 steps: the fp32 yardstick takes ~2 s a step at this size on an H200
                           ("hf-fp32", "hf", "hf+fusedqkv", "compile(hf)", "compile(hf+fusedqkv)"), 30, 0.0,
                           all_full_attention=True),
}


def family_config(family: str, tiny: bool, layers: int) -> dict:
    """The model config's arguments: the family's sizes (or its tiny ones) with ``layers`` layers
    (tiny: 2), and a hybrid family's ``layer_types`` all full attention."""
    fam = FAMILIES[family]
    kw = dict(fam.tiny if tiny else fam.sizes)
    if not tiny:
        kw["num_hidden_layers"] = layers
    if fam.all_full_attention:
        kw["layer_types"] = ["full_attention"] * kw["num_hidden_layers"]
    return kw


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def import_liger():
    """liger_kernel, installed or from a wheel carried in .whl/ (pure Python: unpacked into a
    temporary directory put on sys.path; zipimport lacks its namespace packages); None when
    neither."""
    try:
        import liger_kernel.transformers as lt
        return lt
    except ImportError:
        pass
    for whl in sorted(glob.glob(os.path.join(REPO, ".whl", "liger_kernel-*.whl"))):
        import tempfile
        import zipfile

        target = tempfile.mkdtemp(prefix="bench_hf_liger_")
        with zipfile.ZipFile(whl) as z:
            z.extractall(target)
        sys.path.insert(0, target)
        try:
            import liger_kernel.transformers as lt
            log(f"liger_kernel from {os.path.relpath(whl, REPO)}")
            return lt
        except ImportError as e:
            log(f"liger_kernel wheel {whl} not importable: {e}")
            sys.path.remove(target)
    return None


def make_data(n_batches, batch, seq, vocab, seed):
    """Learnable token streams: each row repeats a random motif (so the loss falls as the
    model learns to copy through attention), drawn from the first 4096 ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        rows = []
        for _ in range(batch):
            motif_len = int(torch.randint(16, 65, (1,), generator=g))
            motif = torch.randint(3, min(vocab, 4096), (motif_len,), generator=g)
            rows.append(motif.repeat(-(-seq // motif_len))[:seq])
        out.append(torch.stack(rows))
    return out


def select_stacks(spec: str, device: str, error) -> list:
    """The stacks named in ``spec`` (comma-separated; ``error`` is called for an unknown one),
    without the Liger stacks off the GPU, Liger's last."""
    stacks = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        error(f"--stacks: unknown {unknown}; choose from {STACKS}")
    if device != "cuda":
        skipped = [s for s in stacks if "liger" in s]
        if skipped:
            log(f"no GPU: skipping {skipped} (Liger's Triton kernels need one)")
        stacks = [s for s in stacks if "liger" not in s]
    # Liger patches transformers' modules process-wide: its stacks run last
    return sorted(stacks, key=lambda s: ("liger" in s, STACKS.index(s)))


def build_model(cfg_kw, dtype, device, attn, seed, family="qwen3"):
    import transformers

    fam = FAMILIES[family]
    cfg = getattr(transformers, fam.config_class)(**cfg_kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, fam.model_class)(cfg)
    # every stack starts from the same bf16-representable values (fp32 yardstick included)
    model.to(torch.bfloat16)
    return model.to(dtype).train()


def quantize_4bit(model, quant_type: str, compute_dtype, skip=()) -> int:
    """--qlora: every nn.Linear of the decoder (not lm_head) as a bitsandbytes 4-bit layer quantized
    from its weights on its device, double quantisation, as BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=True) loads a checkpoint, but those
    named in ``skip``; returns how many."""
    import bitsandbytes as bnb

    n = 0
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head" or name in skip:
                continue
            w = child.weight
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, quant_type=quant_type, compress_statistics=True,
                                  device="meta")
            q.weight = bnb.nn.Params4bit(w.data, requires_grad=False, quant_type=quant_type, compress_statistics=True)
            if child.bias is not None:
                q.bias = child.bias
            setattr(mod, name, q.to(w.device))  # quantizes
            n += 1
    return n


def add_lora(model, r: int, init: str, seed: int, exclude=None):
    """PEFT LoRA of rank r (alpha 2r) on every linear layer (but ``exclude``, PEFT's
    ``exclude_modules``), the same adapter values in every stack; ``init="random"``: B ~ 0.01 N(0, 1)
    too, so the adapters move the loss from the first step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 7)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0,
                                             exclude_modules=exclude))
    if init == "random":
        g = torch.Generator().manual_seed(seed + 8)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.01 * torch.randn(p.shape, generator=g))
    return model


def stack_dtype(stack: str) -> torch.dtype:
    return torch.float32 if stack == "hf-fp32" else torch.bfloat16


def autocast_of(args, device, dtype):
    """--autocast: what the HF Trainer's bf16=True does (PEFT's fp32 adapters then run bf16 GEMMs)."""
    if getattr(args, "autocast", False) and dtype != torch.float32:
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StackRun:
    """One stack: built (model, optimizer) at construction, then :meth:`step` once per training step
    (CUDA events around each, no sync), then :meth:`result` (which frees it)."""

    def __init__(self, stack, args, cfg_kw, device):
        import fusedqkv

        self.stack, self.args, self.device = stack, args, device
        fam = FAMILIES[args.family]
        self.dtype = dtype = stack_dtype(stack)
        if "liger" in stack:
            lt = import_liger()
            if lt is None:
                raise RuntimeError("liger_kernel is not installed and no .whl/liger_kernel-*.whl was found")
        self.cuda = cuda = device == "cuda"
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        model = build_model(cfg_kw, dtype, device, args.attn, args.seed, args.family)
        dense_qkv = stack == DENSE_QKV
        if args.qlora:  # before apply_to, as a model loaded quantized is
            n_4bit = quantize_4bit(model, args.qlora, dtype, skip=QKV_NAMES if dense_qkv else ())
            log(f"{stack}: {n_4bit} linear layers {args.qlora} 4-bit")
        self.n_fused = 0
        if "liger" in stack:
            getattr(lt, fam.liger)(model=model)
        fp8 = args.fp8 if stack != "hf-fp32" and stack not in BF16_STACKS else None
        if "fusedqkv" in stack:
            self.n_fused = fusedqkv.apply_to(model, fp8=fp8)
            assert self.n_fused == cfg_kw["num_hidden_layers"], self.n_fused
        if fp8:  # torchao's float8 on every linear but the output layer (as torchtitan); fused q/k/v: the block's
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            def convert(mod, fqn):
                name = fqn.split(".")[-1]
                return name != "lm_head" and ("fusedqkv" not in stack or name not in ("q_proj", "k_proj", "v_proj"))
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(fp8), module_filter_fn=convert)
        if args.lora:  # after apply_to (the README's order)
            model = add_lora(model, args.lora, args.lora_init, args.seed,
                             exclude=[*QKV_NAMES, "qkv_proj"] if dense_qkv else None)
        self.compiled = stack.startswith("compile(")
        if self.compiled:  # after apply_to, before the optimizer (the compiled module shares the parameters)
            model = torch.compile(model, backend=args.compile_backend)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=cuda)
        if cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base_mem = torch.cuda.memory_allocated()
            self.own_mem = self.base_mem - mem0  # this stack's model (its optimizer state comes with step 1)
        self.autocast = autocast_of(args, device, dtype)
        self.losses, self.times, self.events, self.step_peaks = [], [], [], []

    def step(self, ids, own_peak: bool = False) -> None:
        """One training step; ``own_peak``: also this step's peak allocation above what was allocated
        when it started (other stacks resident: --interleave)."""
        cuda = self.cuda
        if cuda:
            if own_peak:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        if cuda:
            end.record()
            self.events.append((start, end))
            if own_peak:
                self.step_peaks.append(torch.cuda.max_memory_allocated() - before)
        else:
            self.times.append((time.perf_counter() - t0) * 1e3)
        self.losses.append(loss.detach())

    def result(self) -> dict:
        args, stack = self.args, self.stack
        if self.cuda:
            torch.cuda.synchronize()
            self.times = [s.elapsed_time(e) for s, e in self.events]
        losses = [float(x) for x in self.losses]
        if not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f"{stack}: non-finite loss {losses}")
        times = self.times
        timed = times[args.warmup:] or times
        res = dict(stack=stack, dtype=str(self.dtype).replace("torch.", ""), layers_fused=self.n_fused, losses=losses,
                   step_ms=times, step_ms_median=statistics.median(timed), step_ms_mean=statistics.fmean(timed),
                   step_ms_min=min(timed))
        if self.cuda:
            if self.step_peaks:  # interleaved: the steps' own peaks above their start, plus the stack's model
                res["peak_mem_bytes"] = self.own_mem + max(self.step_peaks)
                res["peak_mem_rule"] = "model + max over steps of the step's peak above its start (interleaved)"
            else:
                res["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            res["mem_before_bytes"] = self.base_mem
        self.free()
        return res

    def free(self) -> None:
        self.model = self.opt = None
        self.losses = [float(x) for x in self.losses]
        if self.compiled:
            torch._dynamo.reset()  # the compiled graphs and their guards go with the model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def run_stack(stack, args, cfg_kw, data, device):
    run = StackRun(stack, args, cfg_kw, device)
    for step in range(args.steps):
        run.step(data[step % len(data)].to(device, non_blocking=True))
    return run.result()


def run_interleaved(stacks, args, cfg_kw, data, device) -> dict:
    """--interleave: every stack built first, then step by step, one step of each stack per round
    in an order rotated every round (a drifting host affects every stack alike)."""
    runs = [StackRun(stack, args, cfg_kw, device) for stack in stacks]
    for step in range(args.steps):
        ids = data[step % len(data)].to(device, non_blocking=True)
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(ids, own_peak=True)
    return {run.stack: run.result() for run in runs}


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def judge(results, tiny, min_step_reduction=MIN_STEP_REDUCTION, fp8=False, paired_from=None):
    """The done criteria per pair; returns (rows, all passed). With ``fp8`` and the pair's bf16
    stack present, the loss rule is FP8's: the fused run's max distance from the bf16 run is at
    most FP8_SPREAD_FACTOR x torchao's (the base's) + 1e-3; otherwise within bf16 noise.
    ``paired_from`` (--interleave: the first timed step): each row also gets the median over rounds
    of the two stacks' step-time ratio in the same round (``step_reduction_per_round``), an
    estimate the host's drift between rounds leaves alone (reported beside the criterion, which
    stays the ratio of the medians)."""
    noise = None
    if "hf-fp32" in results and "hf" in results:
        noise = _max_diff(results["hf"], results["hf-fp32"])
    rows, ok = [], True
    for base, fused in PAIRS:
        if base not in results or fused not in results:
            continue
        b, f = results[base], results[fused]
        bf16 = results.get(BF16_OF.get(base)) if fp8 else None
        if bf16 is not None:
            spread = _max_diff(b, bf16)
            diff, tol = _max_diff(f, bf16), FP8_SPREAD_FACTOR * spread + 1e-3
        else:
            spread = None
            # without hf-fp32 the bf16 noise is unmeasured: the loss is not judged (no verdict from a missing yardstick)
            diff, tol = _max_diff(b, f), (2 * noise + 1e-3 if noise is not None else None)
        row = dict(base=base, fused=fused, step_ms_base=b["step_ms_median"], step_ms_fused=f["step_ms_median"],
                   step_reduction=1.0 - f["step_ms_median"] / b["step_ms_median"], max_loss_diff=diff,
                   bf16_noise=noise, fp8_spread=spread, loss_tol=tol, loss_ok=None if tol is None else diff <= tol)
        if paired_from is not None and len(b["step_ms"]) == len(f["step_ms"]) > paired_from:
            row["step_reduction_per_round"] = 1.0 - statistics.median(
                y / x for x, y in zip(b["step_ms"][paired_from:], f["step_ms"][paired_from:]))
        if "peak_mem_bytes" in b:
            row["mem_ratio"] = f["peak_mem_bytes"] / b["peak_mem_bytes"]
        if tiny:
            row["speed_ok"] = row["mem_ok"] = None  # not judged on a tiny CPU model
        else:
            # FP8: faster than torchao's float8 by any margin
            row["speed_ok"] = row["step_reduction"] > 0 if fp8 else row["step_reduction"] >= min_step_reduction
            row["mem_ok"] = row.get("mem_ratio", float("inf")) <= MAX_MEM_RATIO
        # a pass needs a judged loss; speed and memory are not judged on a tiny CPU model
        row["pass"] = row["loss_ok"] is True and all(v is not False for v in (row["speed_ok"], row["mem_ok"]))
        ok &= row["pass"]
        rows.append(row)
    return rows, ok


def qkv_bound(results, target):
    """With the dense-qkv stack and hf: the most the attention input can cut from hf's step
    (``1 - bound / hf``), and whether the target is within it; None without them."""
    if DENSE_QKV not in results or "hf" not in results:
        return None
    bound, base = results[DENSE_QKV]["step_ms_median"], results["hf"]["step_ms_median"]
    fused = results.get("hf+fusedqkv", {}).get("step_ms_median")
    return dict(step_ms_bound=bound, step_ms_base=base, step_ms_fused=fused, max_reduction=1.0 - bound / base,
                target=target, target_within_bound=1.0 - bound / base >= target,
                fused_over_bound=fused / bound if fused else None)


def plot(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no PNG (redraw elsewhere with --plot JSON)")
        return None
    res = report["results"]
    pairs = [p for p in PAIRS if p[0] in res and p[1] in res]
    fig, axes = plt.subplots(2, max(1, len(pairs)), figsize=(6.5 * max(1, len(pairs)), 7), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]})
    for col, (base, fused) in enumerate(pairs):
        ax, dax = axes[0][col], axes[1][col]
        steps = range(1, len(res[base]["losses"]) + 1)
        if "hf-fp32" in res:
            ax.plot(steps, res["hf-fp32"]["losses"], color="0.6", lw=1, ls=":", label="hf fp32 (yardstick)")
        ax.plot(steps, res[base]["losses"], lw=2, label=f"{base} ({res[base]['step_ms_median']:.1f} ms/step)")
        ax.plot(steps, res[fused]["losses"], lw=1.2, ls="--",
                label=f"{fused} ({res[fused]['step_ms_median']:.1f} ms/step)")
        ax.set_title(f"{base} vs {fused}")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        dax.plot(steps, [f - b for f, b in zip(res[fused]["losses"], res[base]["losses"])], label=f"{fused} - {base}")
        if "hf-fp32" in res and "hf" in res:
            dax.plot(steps, [b - r for b, r in zip(res["hf"]["losses"], res["hf-fp32"]["losses"])], color="0.6",
                     ls=":", label="hf bf16 - hf fp32")
        dax.axhline(0, color="k", lw=0.5)
        dax.set_xlabel("step")
        dax.set_ylabel("loss difference")
        dax.legend(fontsize=8)
        dax.grid(alpha=0.3)
    c = report["config"]
    fig.suptitle(f"{c['model']}: batch {c['batch']} x seq {c['seq']}, {c['attn']}, AdamW lr {c['lr']} "
                 f"({report['env'].get('device_name', c['device'])})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(report):
    res = report["results"]
    lines = [f"{'stack':<20} {'dtype':>9} {'step ms (median)':>17} {'peak GiB':>9} {'loss first':>11} "
             f"{'loss last':>10}"]
    for name in STACKS:
        if name not in res:
            continue
        r = res[name]
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f}" if "peak_mem_bytes" in r else "-"
        lines.append(f"{name:<20} {r['dtype']:>9} {r['step_ms_median']:>17.2f} {mem:>9} {r['losses'][0]:>11.4f} "
                     f"{r['losses'][-1]:>10.4f}")
    lines.append("")
    lines.append(f"{'pair':<36} {'step':>8} {'mem':>7} {'max|dloss|':>11} {'tol':>9}  result")

    def verdict(v):
        return "n/a" if v is None else ("ok" if v else "FAIL")

    def tol_text(tol):
        return "-" if tol is None else f"{tol:.2e}"

    for row in report["criteria"]:
        mem = f"{row['mem_ratio']:.3f}" if "mem_ratio" in row else "-"
        lines.append(f"{row['base'] + ' -> ' + row['fused']:<36} {-100 * row['step_reduction']:>+7.1f}% {mem:>7} "
                     f"{row['max_loss_diff']:>11.2e} {tol_text(row['loss_tol']):>9}  speed {verdict(row['speed_ok'])}, "
                     f"memory {verdict(row['mem_ok'])}, loss "
                     f"{'NOT JUDGED (no hf-fp32 stack)' if row['loss_ok'] is None else verdict(row['loss_ok'])}")
        if "step_reduction_per_round" in row:
            lines.append(f"{'  (the same rounds: median ratio)':<36} {-100 * row['step_reduction_per_round']:>+7.1f}%")
    target = report.get("config", {}).get("min_step_reduction", MIN_STEP_REDUCTION)
    bound = report.get("qkv_bound")
    if bound:
        lines.append(f"bound ({DENSE_QKV}: q/k/v dense, no adapters on them): {bound['step_ms_bound']:.2f} ms, so the "
                     f"attention input can cut at most {100 * bound['max_reduction']:.1f}% of hf's step; the target "
                     f"-{100 * target:.0f}% is {'within' if bound['target_within_bound'] else 'OUT OF REACH for'} it"
                     + (f"; hf+fusedqkv / bound {bound['fused_over_bound']:.3f}" if bound["fused_over_bound"] else ""))
    fp8 = report.get("config", {}).get("fp8")
    speed = (f"step time -{100 * target:.0f}% or better" if target > 0 else
             "step time lower than torchao's float8" if fp8 else "step time no slower")
    losses = "losses within torchao's FP8 spread from bf16" if fp8 else "losses within bf16 noise"
    lines.append(f"done criteria ({speed}, peak memory <= {MAX_MEM_RATIO:.2f}x, {losses}): "
                 f"{'PASS' if report['passed'] else 'FAIL'}")
    if report.get("config", {}).get("backward_on_caller"):
        lines.append(f"(every stack: {engine_thread.LABEL}, torch.autograd.set_multithreading_enabled(False))")
    return "\n".join(lines)


def env_info(device):
    import transformers

    info = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__)
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import importlib.metadata as md
        info["liger_kernel"] = md.version("liger_kernel")
    except Exception:
        mod = sys.modules.get("liger_kernel")
        if mod is not None:
            info["liger_kernel"] = getattr(mod, "__version__", "from wheel")
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=False, help="directory for bench_hf.json and bench_hf_loss.png")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: qwen3 50, qwen3_5_text 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed (still in the loss curves)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--family", default="qwen3", choices=list(FAMILIES),
                   help="qwen3: Qwen3-0.6B shape (issue 16); qwen3_8b: Qwen3-8B shape (issue 34); qwen3_5_text: "
                        "Qwen3.5-9B shape, all full attention")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--stacks", default=None, help="comma-separated subset of " + ",".join(STACKS)
                   + " (default: the family's, see above)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the compile(...) stacks (default inductor; aot_eager on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="PEFT LoRA rank R on every linear layer (all-linear, base frozen), after apply_to; 0: full "
                        "fine-tuning (default)")
    p.add_argument("--lora-init", default="peft", choices=["peft", "random"],
                   help="peft: PEFT's init (B = 0); random: B ~ 0.01 N(0, 1) as well")
    p.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                   help="torchao float8 training of every linear but lm_head in the bf16 stacks; +fusedqkv stacks: "
                        "apply_to(model, fp8=...) and q/k/v left to the block (needs torchao)")
    p.add_argument("--autocast", action="store_true",
                   help="bf16 autocast around each forward, as the HF Trainer's bf16=True (with --lora: PEFT's fp32 "
                        "adapters then compute in bf16, and the fused block takes them inside the op)")
    p.add_argument("--qlora", choices=("nf4", "fp4"), default=None,
                   help="with --lora: QLoRA, the decoder's linear layers bitsandbytes 4-bit (double quantisation, "
                        "the stack's dtype as compute dtype)")
    p.add_argument("--interleave", action="store_true",
                   help="build every stack first, then run them one step each per round, in rotating order (the "
                        "host's drift shared by all; peak memory per stack from its own steps)")
    engine_thread.add_flag(p)  # every stack's steps run on this thread
    p.add_argument("--tiny", action="store_true", help="tiny model, batch 2 x seq 64, 6 steps: the CPU check")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--plot", metavar="JSON",
                   help="only redraw the PNG of an earlier run's JSON (into --out or beside it)")
    args = p.parse_args(argv)

    if args.plot:
        with open(args.plot) as f:
            report = json.load(f)
        out = args.out or os.path.dirname(os.path.abspath(args.plot))
        os.makedirs(out, exist_ok=True)
        print(plot(report, os.path.join(out, "bench_hf_loss.png")))
        print(table(report))
        return 0 if report["passed"] else 1
    if not args.out:
        p.error("--out is required")
    fam = FAMILIES[args.family]
    if args.steps is None:
        args.steps = fam.steps
    for name in ("steps", "batch", "seq", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile_backend is None:
        args.compile_backend = "inductor" if device == "cuda" else "aot_eager"
    elif args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        p.error(f"--compile-backend: unknown {args.compile_backend!r} (torch._dynamo.list_backends(); e.g. inductor, "
                f"aot_eager, eager)")
    cfg_kw = family_config(args.family, args.tiny, args.layers)
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
        args.steps = min(args.steps, 6)
        args.warmup = min(args.warmup, 1)
    stacks = select_stacks(args.stacks or ",".join(fam.stacks), device, p.error)
    if DENSE_QKV in stacks and not args.lora:
        p.error(f"--stacks: {DENSE_QKV} is the bound of a --lora run (q/k/v without adapters)")
    if not args.fp8 and BF16_STACKS.intersection(stacks):
        p.error("--stacks: hf-bf16 and compile(hf-bf16) are the bf16 yardsticks of --fp8 (without it they are hf and "
                "compile(hf))")
    if not args.fp8 and "hf-fp32" not in stacks and any(b in stacks and f in stacks for b, f in PAIRS):
        log("no hf-fp32 stack: the bf16 noise is unmeasured, so no pair's loss is judged and no pair passes "
            "(add hf-fp32 to --stacks)")
    os.makedirs(args.out, exist_ok=True)
    engine_thread.apply(args.backward_on_caller)

    data = make_data(8, args.batch, args.seq, cfg_kw["vocab_size"], args.seed + 1)
    if args.fp8:  # issue 35: faster than torchao's float8 (its own pair), by any margin
        min_reduction = 0.0
    else:
        min_reduction = LORA_MIN_STEP_REDUCTION.get(args.family, 0.0) if args.lora else fam.min_step_reduction
    if args.lora < 0:
        p.error(f"--lora must be >= 0, got {args.lora}")
    if args.qlora and not args.lora:
        p.error("--qlora needs --lora R (QLoRA trains adapters over the frozen 4-bit weights)")
    model_label = (f"{fam.label}-shaped, {cfg_kw['num_hidden_layers']} layers"
                   + (", every layer full attention" if fam.all_full_attention else ""))
    if args.interleave and any(s.startswith("compile(") for s in stacks):
        p.error("--interleave: compile stacks would share dynamo's cache and its reset; run them without it")
    report = dict(config=dict(model="tiny " + fam.label.split("-")[0] if args.tiny else model_label,
                              family=args.family,
                              model_config=cfg_kw, batch=args.batch, seq=args.seq,
                              steps=args.steps, warmup=args.warmup, lr=args.lr, attn=args.attn, device=device,
                              tiny=args.tiny, stacks=stacks, optimizer="AdamW(weight_decay=0.01)",
                              params="bf16 (hf-fp32: fp32, same initial values)",
                              compile_backend=args.compile_backend, min_step_reduction=min_reduction,
                              lora=dict(r=args.lora, alpha=2 * args.lora, target_modules="all-linear",
                                        init=args.lora_init, qlora=args.qlora) if args.lora else None,
                              autocast=args.autocast, fp8=args.fp8, interleave=args.interleave,
                              backward_on_caller=args.backward_on_caller,
                              fp8_loss_rule=(f"max_t |loss_fused - loss_bf16| <= {FP8_SPREAD_FACTOR} max_t "
                                             "|loss_torchao - loss_bf16| + 1e-3" if args.fp8 else None)),
                  env=env_info(device), results={})
    def logged(stack, r):
        report["results"][stack] = r
        log(f"{stack}: {r['step_ms_median']:.2f} ms/step, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
            + (f", peak {r['peak_mem_bytes'] / 2**30:.2f} GiB" if "peak_mem_bytes" in r else ""))

    if args.interleave:
        log(f"{', '.join(stacks)}: {args.steps} steps each, interleaved")
        for stack, r in run_interleaved(stacks, args, cfg_kw, data, device).items():
            logged(stack, r)
    else:
        for stack in stacks:
            log(f"{stack}: {args.steps} steps")
            logged(stack, run_stack(stack, args, cfg_kw, data, device))
    report["env"] = env_info(device)  # liger's version once imported
    report["criteria"], report["passed"] = judge(report["results"], args.tiny, min_reduction, fp8=bool(args.fp8),
                                                 paired_from=args.warmup if args.interleave else None)
    report["qkv_bound"] = qkv_bound(report["results"], min_reduction)
    if not report["criteria"]:
        report["passed"] = False
        log("no stack pair ran: nothing judged")
    path = os.path.join(args.out, "bench_hf.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    png = plot(report, os.path.join(args.out, "bench_hf_loss.png"))
    log(f"wrote {path}" + (f" and {png}" if png else ""))
    print(table(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
