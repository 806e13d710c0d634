"""The GQA input block on two GPUs: correctness under DDP, FSDP2 and head-parallel TP=2, and
tokens/s of fusedqkv.GQAQKVRoPEQKNorm against the plain-PyTorch block (eager and torch.compile)
under each engine.

One command on a 2-GPU machine (NCCL; < 5 minutes):

    TRITON_INTERPRET=0 PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out $OUT/dist

and its logic on the CPU (gloo, tiny sizes, wall clock):

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny --out /tmp/dist

1. Checks (tests/distributed/dist_harness.py): DDP (also the functional API, activation
   checkpointing, autocast), FSDP2 (also bf16 mixed precision with fp32 reduction, activation
   checkpointing, torch.compile of the FSDP2-wrapped layer), TP=2 (fusedqkv and the plain
   block, a sequence-sharded input, state dicts): one-step gradients and a 20-step loss curve
   against the single process's whole batch, bf16 (fp32 where noted) on the GPU.
2. Throughput of the block alone (HunyuanImage-3.0 sizes: hidden 4096, 32 query / 8 KV heads,
   head_dim 128, norm after RoPE), forward + backward (input and parameter gradients) of
   ``--tokens`` global tokens (batch 2), under:
     * ``1gpu``: every GPU runs the whole batch alone (no communication): per-GPU tokens/s;
     * ``ddp``: bf16 parameters, half the batch per GPU, gradients all-reduced;
     * ``fsdp2``: fp32 parameters sharded, MixedPrecisionPolicy(bf16, reduce fp32), half the batch per GPU;
     * ``tp2``: HeadParallelQKV, bf16 parameters, the whole batch on both GPUs, 16+4 heads each;
   for fusedqkv, the plain block eager and the plain block under torch.compile (sequence length
   marked dynamic: one compilation per engine). tokens/s = global tokens / step time (the
   median of ``--reps`` steps, the slowest rank's); peak memory per GPU.

Prints the checks, then a table last; writes ``bench_distributed.json`` under --out; exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "distributed"))
import dist_harness as H  # noqa: E402  (the checks are shared with tests/distributed)

import fusedqkv  # noqa: E402
from fusedqkv import distributed as fdist  # noqa: E402

BLOCK = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm_position="after_rope")
TINY_BLOCK = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm_position="after_rope")
ENGINES = ("1gpu", "ddp", "fsdp2", "tp2")
PROVIDERS = ("fusedqkv", "eager", "compile")
BATCH = 2
T0 = time.monotonic()


def log(msg):
    if dist.get_rank() == 0:
        print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def rope(b, s, d, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=device, dtype=torch.float32)[None, :].expand(b, s)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def build(engine, provider, cfg, device, mesh, compile_backend):
    """The block for one (engine, provider), and how many of the batch's rows this rank takes."""
    cls = fusedqkv.GQAQKVRoPEQKNorm if provider == "fusedqkv" else fusedqkv.ReferenceGQAQKVRoPEQKNorm
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        block = cls(**cfg, device=device, dtype=torch.float32)
        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    else:
        block = cls(**cfg, device=device, dtype=bf16)
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            block = DDP(block, device_ids=[device.index] if device.type == "cuda" else None)
        elif engine == "tp2":
            block = fdist.parallelize_block(block, mesh)
    run = block
    if provider == "compile":
        run = torch.compile(block, backend=compile_backend)
    data_parallel = engine in ("ddp", "fsdp2")
    return block, run, data_parallel, bf16


def measure(engine, provider, tokens, cfg, device, mesh, reps, warmup, compile_backend):
    rank, ws = dist.get_rank(), dist.get_world_size()
    block, run, data_parallel, dtype = build(engine, provider, cfg, device, mesh, compile_backend)
    seq = tokens // BATCH
    b_local = BATCH // ws if data_parallel else BATCH
    hq, hkv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    if engine == "tp2":
        hq, hkv = hq // ws, hkv // ws
    g = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(b_local, seq, cfg["hidden_size"], device=device, dtype=dtype, generator=g)
    if engine == "tp2":  # hidden_states is replicated over the TP group
        dist.broadcast(x, src=0)
    cos, sin = rope(b_local, seq, d, device, dtype)
    grads = [torch.randn(b_local, h, seq, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv)]
    compiled = provider == "compile"
    if compiled:  # one compilation for every sequence length
        torch._dynamo.maybe_mark_dynamic(cos, 1)
        torch._dynamo.maybe_mark_dynamic(sin, 1)
    params = list(block.parameters())

    def step():
        for p in params:
            p.grad = None
        xx = x.detach().requires_grad_()
        if compiled:
            torch._dynamo.maybe_mark_dynamic(xx, 1)
        out = run(xx, cos, sin)
        torch.autograd.backward(out, grads)

    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            times.append((start, end))
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in times]
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0], dtype=torch.float64,
                        device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = float(med)
    del block, run
    return dict(engine=engine, provider=provider, tokens=tokens, step_ms=step_s * 1e3,
                tokens_per_s=tokens / step_s, peak_mib=float(peak), local_batch=b_local, seq=seq,
                local_heads=[hq, hkv])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run of the logic)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="global tokens per step (batch 2)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="stop starting measurements after this many seconds (the rest are reported as skipped)")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=240))
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if ws != 2:
        log(f"note: world size {ws}; the engines assume 2 ranks")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (ws,))
    compile_backend = "inductor" if cuda else "aot_eager"
    cfg = TINY_BLOCK if args.tiny else BLOCK
    tokens = args.tokens or ([64, 256] if args.tiny else [4096, 16384, 32768])
    nccl = torch.cuda.nccl.version() if cuda else None
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if cuda else "cpu", world_size=ws,
               nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
               triton_interpret=os.environ.get("TRITON_INTERPRET", "0"))
    log(f"env: {env}")
    if cuda and env["triton_interpret"] == "1":
        log("TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 on the GPU")
        return 2

    checks = []
    if not args.skip_checks:
        tmp = [tempfile.mkdtemp(prefix="fusedqkv_dist_") if rank == 0 else None]
        dist.broadcast_object_list(tmp, src=0)
        sizes = H.TINY if (args.tiny or not cuda) else H.GPU
        dtype = torch.bfloat16 if cuda else torch.float32
        checks = H.run_checks(device, sizes, dtype, compile_backend=compile_backend, tmpdir=tmp[0], log=log)
        if cuda:  # fp32 too, at fp32 tolerance
            checks += [dict(r, key=r["key"] + "_fp32", check=r["check"] + "[fp32]") for r in
                       H.run_checks(device, sizes, torch.float32, tmpdir=tmp[0], log=log,
                                    only=["ddp", "fsdp", "tp"])]

    # fusedqkv and eager first, torch.compile (the slow one to start) last: if the time budget
    # runs out, only compiled rows are skipped
    rows, skipped = [], []
    for provider in args.providers:
        for engine in args.engines:
            for t in tokens:
                if time.monotonic() - T0 > args.budget_s:
                    skipped.append(dict(engine=engine, provider=provider, tokens=t))
                    continue
                r = measure(engine, provider, t, cfg, device, mesh, args.reps, args.warmup, compile_backend)
                rows.append(r)
                log(f"{engine:6s} {provider:9s} {t:6d} tokens: {r['step_ms']:8.3f} ms/step "
                    f"{r['tokens_per_s'] / 1e3:10.1f} k tokens/s  peak {r['peak_mib']:8.0f} MiB")
            if provider == "compile":
                torch._dynamo.reset()
    if skipped:
        log(f"budget of {args.budget_s} s reached: skipped {len(skipped)} measurements")

    ok = all(r["ok"] for r in checks)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_distributed.json"), "w") as f:
            json.dump(dict(env=env, block=cfg, batch=BATCH, checks=checks, throughput=rows, skipped=skipped,
                           all_checks_ok=ok, seconds=time.monotonic() - T0), f, indent=1, default=str)
        print("\nchecks (gradients: ||dist - single|| / ||single||, loss curve: max relative difference, 20 steps)")
        for r in checks:
            g = max([v for k, v in r["errors"].items() if k.startswith("grad:")], default=0.0)
            lc = r["errors"].get("loss_curve")
            print(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['check']:48s} grad {g:.1e}"
                  + (f"  loss {lc:.1e}" if lc is not None else "") + f"  (tol {r['tolerances'].get('grad', 0):.0e})")
        by = {(r["engine"], r["provider"], r["tokens"]): r for r in rows}
        print(f"\nthroughput, {'tiny' if args.tiny else 'hidden 4096, 32q/8kv heads, D 128'}, fwd+bwd, "
              f"k tokens/s (global; 1gpu: per GPU), {ws} x {env['device']}")
        print(f"{'engine':7s}{'tokens':>7s}{'fusedqkv':>10s}{'eager':>10s}{'compile':>10s}"
              f"{'x eager':>9s}{'x compile':>10s}{'peak MiB f/e/c':>22s}")
        for engine in args.engines:
            for t in tokens:
                cells = [by.get((engine, p, t)) for p in PROVIDERS]
                if not any(cells):
                    continue
                tps = [c["tokens_per_s"] / 1e3 if c else float("nan") for c in cells]
                mem = "/".join(f"{c['peak_mib']:.0f}" if c else "-" for c in cells)
                print(f"{engine:7s}{t:7d}{tps[0]:10.1f}{tps[1]:10.1f}{tps[2]:10.1f}"
                      f"{tps[0] / tps[1]:9.2f}{tps[0] / tps[2]:10.2f}{mem:>22s}")
        print(f"\nchecks: {sum(r['ok'] for r in checks)}/{len(checks)} ok; {time.monotonic() - T0:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
