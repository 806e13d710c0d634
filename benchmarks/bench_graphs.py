"""Training-step time of a 3-layer model using the fused block (block + SDPA + o_proj, as
``../shared/repro/cuda_graphs.py``) under three ways of running it: eager, ``torch.cuda.
make_graphed_callables`` and ``torch.compile(mode="reduce-overhead")`` -- the user's clock (host
included), per step (forward, backward, SGD step), at 1x512 and 4x2048 tokens.

Each provider trains its own copy of the model on the same inputs; after warm-up, blocks of
``--steps`` steps are timed with CUDA events (the host's work inside the block counts whenever the
GPU waits for it), providers interleaved block by block in a rotating order (the H200's clock
follows its recent load). Losses of the first 8 steps are printed beside: they must agree.

    PYTHONPATH=src python3 benchmarks/bench_graphs.py --out $OUT/graphs.json
"""

import argparse
import copy
import json
import statistics

import torch
from torch import nn

import fusedqkv
from fusedqkv.bench.timing import rotated_orders

HID, HQ, HKV, D = 1024, 16, 8, 128


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = fusedqkv.GQAQKVRoPEQKNorm(hidden_size=HID, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
        self.o = nn.Linear(HQ * D, HID, bias=False)

    def forward(self, x, cos, sin):
        q, k, v = self.block(x, cos, sin)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.o(a.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x.float().pow(2).mean()


def rope(b, s, dt):
    ang = torch.arange(s)[None, :, None] / 10000 ** (torch.arange(D)[None, None] % (D // 2) / (D // 2))
    return ang.cos().expand(b, s, D).to("cuda", dt), ang.sin().expand(b, s, D).to("cuda", dt)


def provider(kind, base, x0, cos, sin):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if kind == "eager":
        fn = model
    elif kind == "make_graphed_callables":
        fn = torch.cuda.make_graphed_callables(model, (x0.clone(), cos, sin))
    else:
        fn = torch.compile(model, mode="reduce-overhead")

    def step(x):
        loss = fn(x, cos, sin)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def run(b, s, steps, rounds):
    torch.manual_seed(0)
    base = Model().cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, s, HID, generator=g).cuda().to(torch.bfloat16) for _ in range(steps)]
    cos, sin = rope(b, s, torch.bfloat16)
    kinds = ("eager", "make_graphed_callables", "reduce_overhead")
    steppers = {k: provider(k, base, xs[0], cos, sin) for k in kinds}
    losses = {k: [float(steppers[k](x)) for x in xs[:8]] for k in kinds}  # warm-up (and compiles)
    for k in kinds:
        for x in xs:
            steppers[k](x)
    torch.cuda.synchronize()
    per_step = {k: [] for k in kinds}
    for order in rotated_orders(kinds, rounds * len(kinds)):
        for k in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for x in xs:
                steppers[k](x)
            end.record()
            torch.cuda.synchronize()
            per_step[k].append(start.elapsed_time(end) / steps)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    return dict(batch=b, seq=s, steps_per_block=steps, median_ms=med, samples_ms=per_step, losses_first8=losses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rows = [run(b, s, a.steps, a.rounds) for b, s in ((1, 512), (4, 2048))]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print(f"{'tokens':>10} {'eager ms':>10} {'graphed ms':>11} {'reduce-ovh ms':>14} {'ro/eager':>9} {'ro/graphed':>11}")
    for r in rows:
        m = r["median_ms"]
        print(f"{r['batch']}x{r['seq']:<8} {m['eager']:10.3f} {m['make_graphed_callables']:11.3f} "
              f"{m['reduce_overhead']:14.3f} {m['reduce_overhead'] / m['eager']:9.3f} "
              f"{m['reduce_overhead'] / m['make_graphed_callables']:11.3f}")
        print("   losses (first 8):", {k: [round(v, 5) for v in vs[:3]] for k, vs in r["losses_first8"].items()})


if __name__ == "__main__":
    main()
