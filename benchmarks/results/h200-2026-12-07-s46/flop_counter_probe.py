"""Session 46 probe: torch.utils.flop_counter.FlopCounterMode over a fused HF model's fwd+bwd against the
unfused one, on the GPU (eager) and on the CPU, tiny Qwen3 (hidden 64) and a Qwen3-0.6B-like layer shape.
Prints the totals and the fused/unfused ratio per device."""
import copy
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, "tests")
import fusedqkv  # noqa: E402
from _hf_models import build  # noqa: E402


def flops(m, ids):
    with FlopCounterMode(display=False) as fc:
        m(input_ids=ids, labels=ids).loss.backward()
    return fc.get_total_flops()


rows = []
for dev, dtype, over in (("cpu", torch.float32, {}), ("cuda", torch.bfloat16, {}),
                         ("cuda", torch.bfloat16, dict(hidden_size=1024, head_dim=128, num_attention_heads=16,
                                                      num_key_value_heads=8, intermediate_size=3072))):
    if dev == "cuda" and not torch.cuda.is_available():
        continue
    m0 = build("qwen3", **over).to(dev, dtype)
    m1 = copy.deepcopy(m0)
    fusedqkv.apply_to(m1)
    ids = torch.randint(3, 97, (2, 256), device=dev)
    for m in (m0, m1):
        m(input_ids=ids, labels=ids).loss.backward()  # plans built, launches bound
    a, b = flops(m0, ids), flops(m1, ids)
    rows.append((dev, over.get("hidden_size", 64), a, b, b / a))
print(f"{'device':8s} {'hidden':>6s} {'unfused':>14s} {'fused':>14s} {'fused/unfused':>14s}")
for r in rows:
    print(f"{r[0]:8s} {r[1]:6d} {r[2]:14d} {r[3]:14d} {r[4]:14.4f}")
