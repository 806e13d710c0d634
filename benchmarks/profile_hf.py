"""Where the time of one training step goes, per stack of benchmarks/bench_hf.py (issue 16 diagnostic).

The same model, data and stacks as bench_hf.py (Qwen3-0.6B shape cut to 4 layers, batch x seq
4 x 2048, bf16, sdpa, AdamW fused on CUDA; hf, hf+fusedqkv, hf+liger, hf+liger+fusedqkv, each
built as ``bench_hf.run_stack`` builds it). Per stack: --warmup plain steps, --timed-steps plain
steps timed by CUDA events (the wall step time), one plain step with the peak memory of the
forward, the backward and the optimizer step read separately (where the step's peak is), then
--profile-steps steps under torch.profiler (CUDA activities on a GPU, CPU ops otherwise) with
the kernel time attributed to categories:

  attn_input    q/k/v projections, q_norm/k_norm, RoPE application -- what fusedqkv replaces
                (in the patched stacks: the fused block)
  attn_core     the attention backend (sdpa) + o_proj
  mlp           gate/up/down projections and the activation
  norm          the decoder layers' input/post-attention RMSNorms and the final norm
  residual      the decoder layers' own ops (the residual adds)
  embedding     the token embedding (its backward includes the tied LM-head weight's grad sum)
  rope_tables   the cos/sin tables (computed once per step, not replaced by fusedqkv)
  lm_head_loss  the LM head and the loss (HF: lm_head matmul + fp32 cross-entropy; Liger: its
                fused linear cross-entropy, which computes the gradients in the forward)
  optimizer     zero_grad + AdamW step
  other         everything else (attention masks, positions, unattributed work)

How a kernel finds its category:
* forward: module hooks open/close ``torch.profiler.record_function`` ranges (regions) on the
  calling thread; the attention module's range starts as attn_input and switches to attn_core
  when HF's attention interface (ALL_ATTENTION_FUNCTIONS[impl], wrapped for the profiled steps)
  is called. A kernel belongs to the innermost region around its launch (the CUDA runtime/driver
  call that launched it, matched by correlation id; else the CPU op of its External id).
* backward: kernels run on autograd's thread, outside those ranges. Each one is launched inside
  an ``autograd::engine::evaluate_function: <Node>`` op whose sequence number is the one of the
  forward op that created the node; the node's region is that forward op's region (of the ops
  that carry a sequence number, the last one started before the node was created). The grad
  sums autograd makes when passing a node's outputs on are inside that node's op, so they go
  with the node that produced the second gradient (the tied embedding/LM-head weight: embedding).
* optimizer: ranges around zero_grad and opt.step().
On the CPU the "kernels" are the top-level CPU ops of each thread. The sum of the categories is
the total kernel time of the profiled steps by construction; ``profiler_total_ms`` is the same
total from torch's own key_averages() (a check of the attribution's bookkeeping), and the
``attribution`` counters say how much landed in "other" for want of a region.

Writes --out/profile_hf.json and, unless --no-traces, each stack's Chrome trace for Perfetto
(--out/trace_<stack>.json.gz, "+" written "_"); prints the top kernels per stack, then a table
last (categories x stacks in ms per step and % of the wall step time, the kernel total, the wall
step, the idle time, the peak memory).

Device (Liger carried as a wheel in .whl/, found there by bench_hf.import_liger):

    PYTHONPATH=src python3 benchmarks/profile_hf.py --out $OUT/phf

CPU check of the script's logic (tiny model; the Liger stacks need a GPU and are skipped):

    PYTHONPATH=src python benchmarks/profile_hf.py --tiny --out /tmp/profile_hf_tiny
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.autograd.profiler import record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf  # noqa: E402

DEFAULT_STACKS = ("hf", "hf+fusedqkv", "hf+liger", "hf+liger+fusedqkv")
CATEGORIES = (
    ("attn_input", "attention input (qkv, q/k norm, RoPE)"),
    ("attn_core", "attention core (sdpa) + o_proj"),
    ("mlp", "MLP"),
    ("norm", "RMSNorm (layers + final)"),
    ("residual", "residual adds"),
    ("embedding", "embedding"),
    ("rope_tables", "RoPE cos/sin tables"),
    ("lm_head_loss", "LM head + loss"),
    ("optimizer", "optimizer (zero_grad + step)"),
    ("other", "other"),
)
CATEGORY_KEYS = tuple(k for k, _ in CATEGORIES)
REGION = "profile_hf.region:"   # prefixes of our record_function ranges
PHASE = "profile_hf.phase:"
EVALUATE = "autograd::engine::evaluate_function: "
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_KERNELS = 15
CATEGORY_TOP = 12  # kernels listed per category in the JSON
TARGET_REDUCTION = bench_hf.MIN_STEP_REDUCTION

log = bench_hf.log


# --------------------------------------------------------------------------- building and stepping


def build_stack(stack, args, cfg_kw, device):
    """The model and optimizer of one stack, as bench_hf.run_stack builds them."""
    import fusedqkv

    dtype = bench_hf.stack_dtype(stack)
    lt = None
    if "liger" in stack:
        lt = bench_hf.import_liger()
        if lt is None:
            raise RuntimeError("liger_kernel is not installed and no .whl/liger_kernel-*.whl was found")
    model = bench_hf.build_model(cfg_kw, dtype, device, args.attn, args.seed)
    dense_qkv = stack == bench_hf.DENSE_QKV
    if args.qlora:  # as bench_hf --qlora: before apply_to, q/k/v left dense in the bound stack
        bench_hf.quantize_4bit(model, args.qlora, dtype, skip=bench_hf.QKV_NAMES if dense_qkv else ())
    if lt is not None:
        lt.apply_liger_kernel_to_qwen3(model=model)
    if "fusedqkv" in stack:
        n_fused = fusedqkv.apply_to(model)
        assert n_fused == cfg_kw["num_hidden_layers"], n_fused
    if args.lora:  # as bench_hf --lora: after apply_to, PEFT all-linear, base frozen
        model = bench_hf.add_lora(model, args.lora, "random", args.seed,
                                  exclude=[*bench_hf.QKV_NAMES, "qkv_proj"] if dense_qkv else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=device == "cuda")
    return model, opt


def no_phase(name):
    return contextlib.nullcontext()


def phase_range(name):
    return record_function(PHASE + name)


def train_step(model, opt, ids, phase=no_phase, autocast=None):
    """One step in bench_hf.run_stack's order; ``phase`` wraps each part in a range; ``autocast``
    (a context manager factory) around the forward."""
    with phase("optimizer"):
        opt.zero_grad(set_to_none=True)
    with phase("forward"), (autocast() if autocast is not None else contextlib.nullcontext()):
        loss = model(input_ids=ids, labels=ids).loss
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        opt.step()
    return loss.detach()


class Clock:
    """Step times: CUDA events on a GPU (no sync per step, as bench_hf), perf_counter otherwise."""

    def __init__(self, cuda):
        self.cuda, self.marks = cuda, []

    @contextlib.contextmanager
    def step(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.marks.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.marks.append((time.perf_counter() - t0) * 1e3)

    def ms(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.marks]
        return list(self.marks)


def memory_step(model, opt, ids):
    """One plain step with the peak allocated memory of each part (a sync and a peak reset
    between parts; cheap next to a step)."""
    gib = 2.0 ** 30
    torch.cuda.synchronize()
    out = dict(start_gib=torch.cuda.memory_allocated() / gib)
    parts = {}

    def part(name, fn):
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        parts[name] = dict(peak_gib=torch.cuda.max_memory_allocated() / gib,
                           end_gib=torch.cuda.memory_allocated() / gib)
        return r

    part("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    loss = part("forward", lambda: model(input_ids=ids, labels=ids).loss)
    part("backward", loss.backward)
    part("step", opt.step)
    del loss
    out["parts"] = parts
    peak_part = max(parts, key=lambda k: parts[k]["peak_gib"])
    out["step_peak_gib"] = parts[peak_part]["peak_gib"]
    out["peak_in"] = peak_part
    # what the backward adds on top of the activations held at the forward's end
    out["backward_peak_above_forward_end_gib"] = parts["backward"]["peak_gib"] - parts["forward"]["end_gib"]
    return out


# --------------------------------------------------------------------------- forward regions


class Regions:
    """Forward regions as record_function ranges, opened and closed by module hooks (they nest:
    a stack on the calling thread)."""

    def __init__(self):
        self.stack, self.handles = [], []
        self.attention_calls = 0
        self._restore = None

    def open(self, key):
        rf = record_function(REGION + key)
        rf.__enter__()
        self.stack.append(rf)

    def close(self):
        if self.stack:
            self.stack.pop().__exit__(None, None, None)

    def switch(self, key):
        self.close()
        self.open(key)

    def _hook(self, module, key):
        self.handles.append(module.register_forward_pre_hook(lambda m, a: self.open(key)))
        self.handles.append(module.register_forward_hook(lambda m, a, o: self.close()))

    def install(self, model):
        base = getattr(model, model.base_model_prefix)
        self._hook(base.embed_tokens, "embedding")
        self._hook(base.rotary_emb, "rope_tables")
        self._hook(base.norm, "norm")
        for layer in base.layers:
            self._hook(layer, "residual")  # the layer's own ops; its submodules open inner ranges
            self._hook(layer.input_layernorm, "norm")
            self._hook(layer.post_attention_layernorm, "norm")
            self._hook(layer.self_attn, "attn_input")  # switched to attn_core by the interface
            self._hook(layer.mlp, "mlp")
        # LM head + loss: what the causal-LM forward does after the base model returns (HF:
        # lm_head + loss_function; Liger: its fused linear cross-entropy on lm_head.weight)
        self.handles.append(base.register_forward_hook(lambda m, a, o: self.open("lm_head_loss")))
        self.handles.append(model.register_forward_hook(lambda m, a, o: self.close()))
        self._wrap_attention_interface(model)

    def _wrap_attention_interface(self, model):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions

        impl = model.config._attn_implementation
        eager = sys.modules[type(model).__module__].eager_attention_forward
        original = functions.get_interface(impl, eager)
        local = getattr(functions, "_local_mapping", {})
        had_local, previous = impl in local, local.get(impl)

        def attention_interface(*args, **kwargs):
            self.attention_calls += 1
            self.switch("attn_core")
            return original(*args, **kwargs)

        # HF's and fusedqkv's attention forwards look the interface up per call
        functions[impl] = attention_interface

        def restore():
            if had_local:
                functions[impl] = previous
            else:
                del functions[impl]

        self._restore = restore

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._restore is not None:
            self._restore()
            self._restore = None
        while self.stack:
            self.close()


# --------------------------------------------------------------------------- trace attribution


class Nested:
    """Properly nested intervals (start, end, payload) of one thread: the innermost one
    around a time."""

    def __init__(self, intervals):
        self.iv = sorted(intervals, key=lambda t: (t[0], -t[1]))
        self.starts = [s for s, _, _ in self.iv]
        self.parent, stack = [], []
        for i, (s, _, _) in enumerate(self.iv):
            while stack and self.iv[stack[-1]][1] < s:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def find(self, t):
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.iv[i][1] < t:
            i = self.parent[i]
        return self.iv[i][2] if i >= 0 else None


def _by_thread(events):
    out = defaultdict(list)
    for e in events:
        out[e["tid"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e))
    return {tid: Nested(iv) for tid, iv in out.items()}


def _top_level(cpu_ops):
    """The CPU ops not inside another CPU op of their thread."""
    out = []
    by_tid = defaultdict(list)
    for e in cpu_ops:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        end = -float("inf")
        for e in evs:
            if float(e["ts"]) >= end:
                out.append(e)
                end = float(e["ts"]) + float(e.get("dur", 0.0))
    return out


def attribute(trace_events, n_steps):
    """Kernel (or, with no GPU events, top-level CPU op) time per category and pass, per step,
    from a Chrome trace's events; see the module docstring for the rules."""
    events = [e for e in trace_events if e.get("ph") == "X" and "ts" in e]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    annotations = [e for e in events if e.get("cat") == "user_annotation"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    regions = _by_thread([e for e in annotations if e["name"].startswith(REGION)])
    phases = _by_thread([e for e in annotations if e["name"].startswith(PHASE)])
    evaluates = _by_thread([e for e in cpu_ops if e["name"].startswith(EVALUATE)])

    def find(index, tid, t):
        nested = index.get(tid)
        return nested.find(t) if nested is not None else None

    # forward op sequence number -> region of the last op started with it
    seq_region = {}
    for e in sorted(cpu_ops, key=lambda e: float(e["ts"])):
        seq = e.get("args", {}).get("Sequence number")
        if seq is None or e["name"].startswith(EVALUATE):
            continue
        ph = find(phases, e["tid"], float(e["ts"]))
        if ph is None or ph["name"] != PHASE + "forward":
            continue
        r = find(regions, e["tid"], float(e["ts"]))
        seq_region[seq] = r["name"][len(REGION):] if r is not None else "other"

    if gpu:
        launches = {}  # correlation id -> the runtime/driver call that launched the kernel or copy
        for e in events:
            corr = e.get("args", {}).get("correlation")
            if corr is not None and str(e.get("cat", "")).endswith(("_runtime", "_driver")):
                launches[corr] = e
        by_external = {e["args"]["External id"]: e for e in cpu_ops + annotations
                       if "External id" in e.get("args", {})}
        cpu_tids = {e["tid"] for e in cpu_ops}
        items = []
        for k in gpu:
            args = k.get("args", {})
            src = launches.get(args.get("correlation"))
            if src is None or src["tid"] not in cpu_tids:
                src = by_external.get(args.get("External id"))
            where = (src["tid"], float(src["ts"])) if src is not None else None
            items.append((k, where))
    else:
        items = [(e, (e["tid"], float(e["ts"]))) for e in _top_level(cpu_ops)]

    cats = {k: dict(ms=0.0, fwd_ms=0.0, bwd_ms=0.0, count=0) for k in CATEGORY_KEYS}
    diag = defaultdict(float)
    per_kernel = {}
    for ev, where in items:
        ms = float(ev.get("dur", 0.0)) / 1e3
        cat, pass_ = "other", "other"
        if where is None:
            diag["no_launch_point_ms"] += ms
        else:
            tid, t = where
            ev_fn = find(evaluates, tid, t)
            if ev_fn is not None:
                pass_ = "backward"
                seq = ev_fn.get("args", {}).get("Sequence number")
                if seq is None:
                    diag["backward_without_sequence_ms"] += ms  # e.g. AccumulateGrad
                elif seq not in seq_region:
                    diag["backward_unmatched_sequence_ms"] += ms
                else:
                    cat = seq_region[seq]
            else:
                ph = find(phases, tid, t)
                name = ph["name"][len(PHASE):] if ph is not None else None
                if name == "forward":
                    pass_ = "forward"
                    r = find(regions, tid, t)
                    if r is not None:
                        cat = r["name"][len(REGION):]
                    else:
                        diag["forward_outside_regions_ms"] += ms
                elif name == "optimizer":
                    cat = pass_ = "optimizer"
                else:
                    diag["outside_phases_ms" if name is None else "backward_outside_nodes_ms"] += ms
        if cat not in cats:
            cat = "other"
        c = cats[cat]
        c["ms"] += ms
        c["count"] += 1
        if pass_ == "forward":
            c["fwd_ms"] += ms
        elif pass_ == "backward":
            c["bwd_ms"] += ms
        pk = per_kernel.setdefault(ev["name"], dict(ms=0.0, count=0, by_cat=defaultdict(float)))
        pk["ms"] += ms
        pk["count"] += 1
        pk["by_cat"][cat] += ms

    for c in cats.values():
        for key in ("ms", "fwd_ms", "bwd_ms"):
            c[key] /= n_steps
        c["count"] = c["count"] / n_steps
    total = sum(c["ms"] for c in cats.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1]["ms"])[:TOP_KERNELS]
    top_kernels = [dict(name=short_name(name), ms=v["ms"] / n_steps, count=v["count"] / n_steps,
                        category=max(v["by_cat"], key=v["by_cat"].get), full_name=name) for name, v in top]
    # what each category is made of: its largest kernels
    for key, c in cats.items():
        mine = sorted(((v["by_cat"][key], name) for name, v in per_kernel.items() if v["by_cat"].get(key)),
                      reverse=True)[:CATEGORY_TOP]
        c["top"] = [dict(name=short_name(name), ms=ms / n_steps) for ms, name in mine]
    diag = {k: v / n_steps for k, v in diag.items()}
    diag["work_items_per_step"] = len(items) / n_steps
    diag["kind"] = "gpu kernels" if gpu else "top-level cpu ops"
    diag["forward_sequence_numbers"] = len(seq_region)
    return dict(categories=cats, kernel_total_ms=total, top_kernels=top_kernels, attribution=diag)


def short_name(name, width=90):
    """A kernel name without ``void``, its argument list and template arguments below the first
    level, cut to ``width``."""
    n = name.replace("(anonymous namespace)::", "")
    if n.startswith("void "):
        n = n[5:]
    if n.endswith(")"):  # the argument list: from its matching "("
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i] if i > 0 else n
                break
    out, depth = [], 0
    for ch in n:
        if ch == "<":
            depth += 1
            if depth <= 2:
                out.append(ch)
        elif ch == ">":
            if depth <= 2:
                out.append(ch)
            depth -= 1
        elif depth <= 1:
            out.append(ch)
    n = re.sub(r"\s+", " ", "".join(out)).strip()
    return n if len(n) <= width else n[:width - 3] + "..."


def profiler_total_ms(prof, gpu, n_steps):
    """The same total from torch's own event tables: device self time of the device events,
    or CPU self time of the CPU ops (our ranges and other annotations left out)."""
    total = 0.0
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False) or e.key.startswith((REGION, PHASE)):
            continue
        dev = str(getattr(e, "device_type", "")).rsplit(".", 1)[-1]
        if gpu and dev == "CUDA":
            total += e.self_device_time_total
        elif not gpu and dev == "CPU":
            total += e.self_cpu_time_total
    return total / 1e3 / n_steps


# --------------------------------------------------------------------------- one stack


def profile_stack(stack, args, cfg_kw, data, device, out_dir):
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    model, opt = build_stack(stack, args, cfg_kw, device)
    dtype = bench_hf.stack_dtype(stack)
    ac = (lambda: bench_hf.autocast_of(args, device, dtype))
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    batches = [d.to(device) for d in data]
    step = 0
    for _ in range(args.warmup):
        train_step(model, opt, batches[step % len(batches)], autocast=ac)
        step += 1
    clock = Clock(cuda)
    for _ in range(args.timed_steps):
        with clock.step():
            train_step(model, opt, batches[step % len(batches)], autocast=ac)
        step += 1
    wall = clock.ms()
    res = dict(stack=stack, step_wall_ms=statistics.median(wall), step_wall_ms_all=wall)
    if cuda:
        res["run_peak_gib"] = torch.cuda.max_memory_allocated() / 2.0 ** 30  # as bench_hf: from step 0 on
        res["memory"] = memory_step(model, opt, batches[step % len(batches)])
        step += 1
    else:
        res["memory"] = None

    regions = Regions()
    regions.install(model.get_base_model() if hasattr(model, "get_base_model") else model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    pclock = Clock(cuda)
    try:
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                with pclock.step():
                    loss = train_step(model, opt, batches[step % len(batches)], phase_range, autocast=ac)
                step += 1
            if cuda:
                torch.cuda.synchronize()
    finally:
        regions.remove()
    res["profiled_step_wall_ms"] = statistics.median(pclock.ms())
    res["loss_last"] = float(loss)
    expected_calls = args.profile_steps * cfg_kw["num_hidden_layers"]
    if regions.attention_calls != expected_calls:
        log(f"{stack}: the attention interface was called {regions.attention_calls} times, expected "
            f"{expected_calls}: attn_core is inside attn_input")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if not args.no_traces:
            name = os.path.join(out_dir, f"trace_{stack.replace('+', '_')}.json.gz")  # no "+" in file names
            with open(path, "rb") as fin, gzip.open(name, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            res["trace"] = os.path.basename(name)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    res.update(attribute(events, args.profile_steps))
    res["attribution"]["attention_interface_calls"] = regions.attention_calls
    res["profiler_total_ms"] = profiler_total_ms(prof, any(e.get("cat") in GPU_CATS for e in events),
                                                 args.profile_steps)
    wall_ms = res["step_wall_ms"]
    res["idle_ms"] = wall_ms - res["kernel_total_ms"]
    for c in res["categories"].values():
        c["pct_of_step"] = 100.0 * c["ms"] / wall_ms
        c["pct_of_kernels"] = 100.0 * c["ms"] / res["kernel_total_ms"] if res["kernel_total_ms"] else 0.0
    # removing the whole attention input block is the most any fused block can save
    attn = res["categories"]["attn_input"]["ms"]
    res["attn_input_free_step_ms"] = wall_ms - attn
    res["attn_input_max_saving_pct"] = 100.0 * attn / wall_ms

    del model, opt, prof, trace, events, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def pair_summary(results):
    """Per bench_hf pair: the observed change of the attention input and of the step, and
    what the step would be with no attention input at all in the fused stack."""
    out = []
    for base, fused in bench_hf.PAIRS:
        if base not in results or fused not in results:
            continue
        b, f = results[base], results[fused]
        wb, wf = b["step_wall_ms"], f["step_wall_ms"]
        ab, af = b["categories"]["attn_input"]["ms"], f["categories"]["attn_input"]["ms"]
        out.append(dict(base=base, fused=fused, step_ms=(wb, wf), step_change_pct=100.0 * (wf / wb - 1.0),
                        attn_input_ms=(ab, af), attn_input_saved_ms=ab - af,
                        kernel_total_ms=(b["kernel_total_ms"], f["kernel_total_ms"]),
                        target_step_ms=wb * (1.0 - TARGET_REDUCTION),
                        # the fused stack with its remaining attention input at zero
                        best_case_change_pct=100.0 * ((wf - af) / wb - 1.0)))
    return out


# --------------------------------------------------------------------------- output


def table(report):
    res = report["results"]
    stacks = [s for s in report["config"]["stacks"] if s in res]
    w0, w = 38, 19
    unit = "ms/step (% of wall step)" if report["config"]["device"] == "cuda" else "ms/step, CPU op time"
    lines = [f"{unit:<{w0}}" + "".join(f"{s:>{w}}" for s in stacks)]

    def row(label, cells):
        lines.append(f"{label:<{w0}}" + "".join(f"{c:>{w}}" for c in cells))

    for key, label in CATEGORIES:
        row(label, [f"{res[s]['categories'][key]['ms']:.2f} ({res[s]['categories'][key]['pct_of_step']:.1f}%)"
                    for s in stacks])
    row("sum: kernel total", [f"{res[s]['kernel_total_ms']:.2f}" for s in stacks])
    row("  profiler's own total", [f"{res[s]['profiler_total_ms']:.2f}" for s in stacks])
    row("wall step (median)", [f"{res[s]['step_wall_ms']:.2f}" for s in stacks])
    row("idle / host-bound", [f"{res[s]['idle_ms']:.2f}" for s in stacks])
    row("  attn input fwd / bwd", [f"{res[s]['categories']['attn_input']['fwd_ms']:.2f}/"
                                   f"{res[s]['categories']['attn_input']['bwd_ms']:.2f}" for s in stacks])
    row("step if attn input were free", [f"{res[s]['attn_input_free_step_ms']:.2f} (-"
                                         f"{res[s]['attn_input_max_saving_pct']:.1f}%)" for s in stacks])
    if stacks and all(res[s]["memory"] for s in stacks):
        row("step peak GiB (in)", [f"{res[s]['memory']['step_peak_gib']:.2f} ({res[s]['memory']['peak_in']})"
                                   for s in stacks])
        row("  GiB at forward end", [f"{res[s]['memory']['parts']['forward']['end_gib']:.2f}" for s in stacks])
    return "\n".join(lines)


def print_details(report):
    for stack, r in report["results"].items():
        print(f"\n{stack}: top {TOP_KERNELS} {r['attribution']['kind']} (ms/step, count/step, category)")
        for k in r["top_kernels"]:
            print(f"  {k['ms']:8.3f} {k['count']:7.1f}  {k['category']:<13} {k['name']}")
        a = r["attribution"]
        unattributed = {k: round(v, 3) for k, v in a.items() if k.endswith("_ms") and v}
        if unattributed:
            print(f"  in 'other' for want of a region (ms/step): {unattributed}")
        m = r["memory"]
        if m:
            p = m["parts"]
            print(f"  memory GiB: start {m['start_gib']:.2f}, forward peak {p['forward']['peak_gib']:.2f} / end "
                  f"{p['forward']['end_gib']:.2f}, backward peak {p['backward']['peak_gib']:.2f} / end "
                  f"{p['backward']['end_gib']:.2f}, optimizer step peak {p['step']['peak_gib']:.2f}; step peak "
                  f"in {m['peak_in']}; run peak {r['run_peak_gib']:.2f}")
    print()
    for p in report["pairs"]:
        print(f"{p['base']} -> {p['fused']}: step {p['step_ms'][0]:.2f} -> {p['step_ms'][1]:.2f} ms "
              f"({p['step_change_pct']:+.1f}%), attention input {p['attn_input_ms'][0]:.2f} -> "
              f"{p['attn_input_ms'][1]:.2f} ms; with no attention input left the step would be "
              f"{p['best_case_change_pct']:+.1f}% vs {p['base']} (target -{100 * TARGET_REDUCTION:.0f}%: "
              f"<= {p['target_step_ms']:.2f} ms)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for profile_hf.json and the traces")
    p.add_argument("--stacks", default=",".join(DEFAULT_STACKS), help="comma-separated subset of "
                   + ",".join(bench_hf.STACKS))
    p.add_argument("--warmup", type=int, default=3, help="plain steps first (compiles, allocator, AdamW state)")
    p.add_argument("--timed-steps", type=int, default=10, help="plain steps timed for the wall step time")
    p.add_argument("--profile-steps", type=int, default=2, help="steps under the profiler (averaged)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", type=int, default=0, metavar="R", help="as bench_hf.py --lora (random B)")
    p.add_argument("--autocast", action="store_true", help="as bench_hf.py --autocast")
    p.add_argument("--qlora", choices=("nf4", "fp4"), default=None, help="as bench_hf.py --qlora (with --lora)")
    p.add_argument("--tiny", action="store_true", help="tiny model, batch 2 x seq 64, few steps: the CPU check")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--no-traces", action="store_true", help="do not keep the Chrome traces")
    args = p.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg_kw = dict(bench_hf.TINY if args.tiny else bench_hf.QWEN3_06B)
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
        args.warmup, args.timed_steps, args.profile_steps = min(args.warmup, 1), min(args.timed_steps, 2), 1
    else:
        cfg_kw["num_hidden_layers"] = args.layers
    stacks = bench_hf.select_stacks(args.stacks, device, p.error)
    if any(s.startswith("compile(") for s in stacks):  # build_stack builds eager stacks only
        p.error(f"--stacks: {[s for s in stacks if s.startswith('compile(')]} are bench_hf.py's; profile_hf.py "
                f"profiles the eager stacks")
    os.makedirs(args.out, exist_ok=True)

    data = bench_hf.make_data(8, args.batch, args.seq, cfg_kw["vocab_size"], args.seed + 1)
    report = dict(config=dict(model="Qwen3-0.6B-shaped, %d layers" % cfg_kw["num_hidden_layers"] if not args.tiny
                              else "tiny Qwen3", model_config=cfg_kw, batch=args.batch, seq=args.seq,
                              warmup=args.warmup, timed_steps=args.timed_steps, profile_steps=args.profile_steps,
                              lr=args.lr, attn=args.attn, device=device, tiny=args.tiny, stacks=stacks,
                              optimizer="AdamW(weight_decay=0.01)", params="bf16 (hf-fp32: fp32)",
                              lora=args.lora, autocast=args.autocast),
                  categories=dict(CATEGORIES), results={})
    for stack in stacks:
        log(f"{stack}: {args.warmup} warm-up + {args.timed_steps} timed + {args.profile_steps} profiled steps")
        r = profile_stack(stack, args, cfg_kw, data, device, args.out)
        report["results"][stack] = r
        log(f"{stack}: wall {r['step_wall_ms']:.2f} ms/step, kernels {r['kernel_total_ms']:.2f} ms, attention input "
            f"{r['categories']['attn_input']['ms']:.2f} ms ({r['categories']['attn_input']['pct_of_step']:.1f}%)")
    report["env"] = bench_hf.env_info(device)  # liger's version once imported
    report["pairs"] = pair_summary(report["results"])
    path = os.path.join(args.out, "profile_hf.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    log(f"wrote {path}")
    print_details(report)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
