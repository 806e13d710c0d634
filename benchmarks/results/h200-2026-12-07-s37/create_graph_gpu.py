"""Session 37: backward(create_graph=True) through the fused block on the GPU (the kernels' path): first-order
gradients bitwise those without create_graph, each requiring grad, and a second backward refused with the reason.
bf16, 091's head layout (32/8 heads of 128, hidden 4096), 131 and 2048 tokens."""
import sys
import torch
from fusedqkv import GQAQKVRoPEQKNorm

rows, ok = [], True
for tokens in (131, 2048):
    torch.manual_seed(0)
    m = GQAQKVRoPEQKNorm(4096, 32, 8, 128, eps=1e-6, dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(1, tokens, 4096, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(tokens, device="cuda", dtype=torch.float32)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    e = torch.cat([pos[..., None] * inv] * 2, -1)
    cos, sin = e.cos().bfloat16(), e.sin().bfloat16()
    params = [m.qkv_weight, m.q_norm_weight, m.k_norm_weight]

    def first(create_graph):
        x = x0.clone().requires_grad_()
        q, k, v = m(x, cos, sin)
        loss = (q.float().square().sum() + k.float().sum() + v.float().square().sum())
        return torch.autograd.grad(loss, [x] + params, create_graph=create_graph)

    want, got = first(False), first(True)
    same = all(torch.equal(a.detach(), b) for a, b in zip(got, want))
    need = all(a.requires_grad for a in got)
    try:
        sum(g.float().square().sum() for g in got).backward()
        refused = "no error"
    except RuntimeError as err:
        refused = str(err)[:80]
    good = same and need and "not itself differentiable" in refused
    ok &= good
    rows.append((tokens, same, need, refused, good))
for r in rows:
    print("create_graph tokens=%d bitwise=%s requires_grad=%s second-order: %s -> %s" % r)
print("RESULT create_graph", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
