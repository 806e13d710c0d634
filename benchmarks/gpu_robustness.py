"""GPU robustness of fusedqkv's Triton paths (issue 5, item 5). Run on a CUDA machine.

Modes (several may be combined; with none, all but --sanitize run):

  --sanitize     every Triton kernel path once at small shapes (ragged sequences, one KV
                 head, 091's heads, seq 1, the forward and the autograd backward, the
                 experimental single-launch backward forced on), each
                 result checked against the CPU path: meant to run under
                 ``compute-sanitizer --tool memcheck`` / ``--tool racecheck`` (see
                 gpu_robustness.sh; run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every
                 tensor is its own allocation and memcheck sees out-of-bounds accesses).
  --graph        the 091 backward captured in a CUDA graph: replays (also after new input
                 values are copied into the static inputs) bitwise equal to eager calls.
  --memory       1000 back-to-back calls (fresh outputs, then out=), synchronize:
                 torch.cuda.memory_allocated() before == after (after a warm-up).
  --determinism  repeated calls bitwise identical (091 backward at a full-size workload
                 shape; forward + autograd backward of the block).

Prints one ``RESULT <check> PASS|FAIL <details>`` line per check, writes them as JSON to
``--out`` (a folder) if given, and exits 1 if any check failed.

    PYTHONPATH=src python3 benchmarks/gpu_robustness.py --graph --memory --determinism --out $OUT
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 benchmarks/gpu_robustness.py --sanitize
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

try:
    import fusedqkv  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch

import fusedqkv
from fusedqkv.bench import problem

RESULTS: list = []


def record(check: str, ok: bool, **details) -> bool:
    RESULTS.append({"check": check, "passed": bool(ok), **details})
    print(f"RESULT {check} {'PASS' if ok else 'FAIL'} " + " ".join(f"{k}={v}" for k, v in details.items()), flush=True)
    return ok


def make_inputs(b, hq, hkv, s, d, hidden, device, dtype=torch.bfloat16, seed=0):
    """The 14 inputs of the 091 backward (official generation heuristics), on ``device``."""
    g = torch.Generator().manual_seed(seed)

    def rn(*sh):
        return torch.randn(*sh, generator=g).to(dtype)

    ang = torch.randn(b, s, d, generator=g).clamp(-math.pi, math.pi)
    qkv = (hq + 2 * hkv) * d
    args = [rn(b, hq, s, d), rn(b, hkv, s, d), rn(b, hkv, s, d), rn(b, s, hidden), ang.cos().to(dtype),
            ang.sin().to(dtype), (torch.randn(qkv, hidden, generator=g) / math.sqrt(hidden)).to(dtype),
            (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype),
            rn(b, hq, s, d), rn(b, hkv, s, d), (torch.randn(b, hq, s, 1, generator=g).abs() + 0.1).to(dtype),
            (torch.randn(b, hkv, s, 1, generator=g).abs() + 0.1).to(dtype), 1e-5]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def to_cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def close_to_cpu(gpu_out, cpu_out, atol=1e-2, rtol=5e-2):
    """Official policy (>= 99% of elements within atol + rtol*|ref|, all finite)."""
    worst = 1.0
    for name, g, c in zip(("gx", "gcos", "gsin", "gw", "gqw", "gkw"), gpu_out, cpu_out):
        chk = problem.check_output(name, g.cpu(), c, atol, rtol)
        if not chk.passed:
            return False, f"{name}:{chk.reason}"
        worst = min(worst, chk.matched_ratio)
    return True, f"min_matched={worst:.4f}"


# (batch, heads, kv_heads, seq, head_dim, hidden): ragged seqs, one KV head, 091's heads, seq 1;
# the last two take the stage's other launch configurations (on the H200: every head of 4-token
# blocks from 1k tokens, of 8-token blocks from 3168; below, head groups)
SANITIZE_SHAPES = [
    (1, 4, 1, 131, 128, 256),
    (2, 8, 2, 293, 64, 128),
    (1, 32, 8, 37, 128, 512),
    (3, 6, 3, 1, 128, 64),
    (1, 6, 2, 1501, 64, 64),
    (2, 4, 1, 1700, 64, 64),
]


def run_sanitize(dev) -> None:
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    for shp in SANITIZE_SHAPES:
        args = make_inputs(*shp, device=dev, seed=sum(shp))
        got = bw(*args, backend="triton")
        # strided (HF-transposed) q/k/v gradients and saved activations through the same kernel
        hf = list(args)
        for i in (0, 1, 2, 9, 10):
            hf[i] = args[i].transpose(1, 2).contiguous().transpose(1, 2)
        got_hf = bw(*hf, backend="triton")
        torch.cuda.synchronize()
        ref = bw(*to_cpu(args), backend="torch")
        ok, info = close_to_cpu(got, ref)
        record(f"sanitize_backward_{'x'.join(map(str, shp))}", ok and same(got, got_hf), vs_cpu=info,
               hf_layout_equal=same(got, got_hf))
    f = getattr(fusedqkv, "gqa_qkv_rope_qk_norm", None)
    if f is None:
        record("sanitize_forward", True, skipped="fusedqkv.gqa_qkv_rope_qk_norm not present")
        return
    for (b, hq, hkv, s, d, hid) in SANITIZE_SHAPES[:3]:
        for pos in ("after_rope", "before_rope"):
            g = torch.Generator().manual_seed(b + s)
            x = torch.randn(b, s, hid, generator=g).to(torch.bfloat16)
            w = (torch.randn((hq + 2 * hkv) * d, hid, generator=g) / math.sqrt(hid)).to(torch.bfloat16)
            qw = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
            kw = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
            ang = torch.randn(b, s, d, generator=g)
            cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
            grads = [torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]

            def step(device, backend):
                leaves = [t.to(device).requires_grad_() for t in (x, w, qw, kw, cos, sin)]
                outs = f(*leaves, num_heads=hq, num_kv_heads=hkv, qk_norm_position=pos, backend=backend)
                torch.autograd.backward(outs, [gr.to(device) for gr in grads])
                return [o.detach().cpu() for o in outs] + [t.grad.cpu() for t in leaves]

            gpu = step(dev, "triton")
            torch.cuda.synchronize()
            cpu = step("cpu", "torch")
            bad = []
            for i, (a, c) in enumerate(zip(gpu, cpu)):
                chk = problem.check_output(str(i), a, c, 2e-2, 5e-2)
                if not chk.passed:
                    bad.append(f"{i}:{chk.reason}")
            record(f"sanitize_forward_autograd_{pos}_{b}x{hq}x{hkv}x{s}x{d}", not bad, mismatches=bad or "none")


# (batch, heads, kv_heads, seq, head_dim, hidden, tag): cuBLAS products; the PDL chain (<= 128 tokens)
GRAPH_SHAPES = [(2, 32, 8, 131, 128, 4096, "cublas"), (1, 32, 8, 128, 128, 4096, "chain")]


def run_graph(dev) -> None:
    for shp in GRAPH_SHAPES:
        _run_graph(dev, shp[:-1], shp[-1])


def _run_graph(dev, shp, tag) -> None:
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    args = make_inputs(*shp, device=dev, seed=7)
    eager = bw(*args)
    static_out = tuple(torch.empty_like(t) for t in eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream (compile, per-stream buffers)
        for _ in range(3):
            bw(*args, out=static_out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            bw(*args, out=static_out)
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        record(f"graph_capture_{tag}", False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    record(f"graph_capture_{tag}", True)
    for i in range(3):
        for t in static_out:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        record(f"graph_{tag}_replay_{i}_bitwise_eq_eager", same(static_out, eager))
    # new values in the static inputs: replay == eager on the new values
    new = make_inputs(*shp, device=dev, seed=8)
    for a, n in zip(args, new):
        if isinstance(a, torch.Tensor):
            a.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    record(f"graph_{tag}_replay_new_inputs_bitwise_eq_eager", same(static_out, bw(*args)))


def run_memory(dev, n=1000) -> None:
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    for shp in [(1, 32, 8, 131, 128, 4096), (2, 4, 1, 293, 64, 256)]:
        args = make_inputs(*shp, device=dev, seed=3)
        for _ in range(3):  # warm-up: compile, per-device/stream buffers
            o = bw(*args)
        out = tuple(torch.empty_like(t) for t in o)
        del o
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            r = bw(*args)
        del r
        for _ in range(n):
            bw(*args, out=out)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(dev)
        record(f"memory_{n}x2_calls_{'x'.join(map(str, shp))}", before == after, before=before, after=after,
               seconds=round(time.perf_counter() - t0, 2))


def run_determinism(dev, n=20) -> None:
    bw = fusedqkv.gqa_qkv_rope_qk_norm_backward
    defn = problem.load_definition()
    for wname in ("w11_b1_s128", "w02_b1_s131", "w13_b2_s293", "w01_b16_s128"):
        w = defn.workload(wname)
        args = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        first = bw(*args)
        ok = all(same(bw(*args), first) for _ in range(n))
        record(f"determinism_backward_{wname}_{n}_calls", ok)
    f = getattr(fusedqkv, "gqa_qkv_rope_qk_norm", None)
    if f is None:
        return
    b, s, hid, hq, hkv, d = 2, 293, 4096, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, hid, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn((hq + 2 * hkv) * d, hid, generator=g) / 64).to(torch.bfloat16).to(dev)
    qw = torch.ones(d, dtype=torch.bfloat16, device=dev)
    kw = torch.ones(d, dtype=torch.bfloat16, device=dev)
    ang = torch.randn(b, s, d, generator=g)
    cos, sin = ang.cos().to(torch.bfloat16).to(dev), ang.sin().to(torch.bfloat16).to(dev)
    grads = [torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).to(dev) for h in (hq, hkv, hkv)]

    def step():
        leaves = [t.clone().requires_grad_() for t in (x, w, qw, kw)]
        outs = f(*leaves, cos, sin, num_heads=hq, num_kv_heads=hkv)
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    first = step()
    record(f"determinism_forward_autograd_{n}_steps", all(same(step(), first) for _ in range(n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--determinism", action="store_true")
    ap.add_argument("--calls", type=int, default=1000, help="back-to-back calls of --memory (default 1000)")
    ap.add_argument("--out", help="folder for gpu_robustness*.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_robustness: error: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if not (a.sanitize or a.graph or a.memory or a.determinism):
        a.graph = a.memory = a.determinism = True
    print(f"device {torch.cuda.get_device_name(dev)}; torch {torch.__version__}", flush=True)
    if a.sanitize:
        run_sanitize(dev)
    if a.graph:
        run_graph(dev)
    if a.memory:
        run_memory(dev, a.calls)
    if a.determinism:
        run_determinism(dev)
    failed = [r["check"] for r in RESULTS if not r["passed"]]
    print(f"SUMMARY {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "sanitize" if a.sanitize else "checks"
        with open(os.path.join(a.out, f"gpu_robustness_{tag}.json"), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "results": RESULTS}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
