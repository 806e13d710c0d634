"""Session 45, device call 3: EmbeddingGemma 2's bf16 gradients on the GPU -- HF's own bf16 model against fp32 (the
three-way test's judge) and fusedqkv's, per block parameter, seeds 0-2, the test's batch (2 x 24, padded)."""
import copy
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "tests")
import _hf_families as H  # noqa: E402
import fusedqkv  # noqa: E402

fam = H.family(sys.argv[1] if len(sys.argv) > 1 else "embedding_gemma2_text")
for seed in range(3):
    exact = H.build(fam, fam.bias, attn=fam.fast_attn, seed=seed).cuda().train()
    ref = copy.deepcopy(exact).to(torch.bfloat16)
    m = copy.deepcopy(ref)
    fusedqkv.apply_to(m)
    ids = H.batch(2, 24, seed=seed).cuda()
    losses = [fam.loss(x(**fam.inputs(ids))) for x in (m, ref, exact)]
    for x in losses:
        x.backward()
    ours, hf, ex = dict(m.named_parameters()), dict(ref.named_parameters()), dict(exact.named_parameters())
    rows = []
    for name, p in ours.items():
        if ".qkv_proj." not in name and not (".self_attn." in name and "norm" in name):
            continue
        g_exact, g_hf = H.hf_grad(m, name, ex), H.hf_grad(m, name, hf)
        if g_exact is None or not float(g_exact.norm()):
            continue
        e_ours = float((p.grad.float() - g_exact).norm() / g_exact.norm())
        e_hf = float((g_hf.float() - g_exact).norm() / g_exact.norm())
        rows.append(f"{name.split('layers.')[-1]}: hf {e_hf:.3f} ours {e_ours:.3f}")
    print(f"seed {seed} loss ours/hf/fp32 {float(losses[0]):.5f} {float(losses[1]):.5f} {float(losses[2]):.5f}")
    print("  " + "\n  ".join(rows))
