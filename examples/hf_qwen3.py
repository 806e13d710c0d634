"""fusedqkv in a Hugging Face model: build a small Qwen3 from a config (random weights, nothing
downloaded), fuse its attention input blocks with one call, train a few AdamW steps, save an
ordinary HF checkpoint and load it back into an unpatched model, and generate with the KV
cache.

    pip install -e '.[transformers]'      # from the clone (fusedqkv is not on PyPI)
    python examples/hf_qwen3.py            # GPU if present (bf16), else CPU (fp32)

With a pretrained model the call is the same: ``model = AutoModelForCausalLM.from_pretrained(...)``
then ``fusedqkv.apply_to(model)`` -- before the optimizer is created (the three projection
weights become one parameter) and before ``torch.compile`` / DDP / FSDP wrap the model.
"""

import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import fusedqkv


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype)

    n = fusedqkv.apply_to(model)  # in place; returns the number of attention layers fused
    print(f"fused {n} attention layers; layer 0 is now:\n{model.model.layers[0].self_attn}")

    # train: the fused [Q|K|V] weight is an ordinary parameter of the model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(3, config.vocab_size, (4, 16), generator=g)
    ids = motif.repeat(1, 8).to(device)  # 4 sequences of 128 tokens, each a repeated motif
    for step in range(20):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == 19:
            print(f"step {step:2d}  loss {loss.item():.4f}")

    # the state dict is HF's: q_proj/k_proj/v_proj keys, as save_pretrained writes them
    keys = [k for k in model.state_dict() if k.startswith("model.layers.0.self_attn.")]
    print("state dict keys of layer 0's attention:", keys)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        plain = Qwen3ForCausalLM.from_pretrained(d, dtype=dtype).to(device)  # an unpatched model
    with torch.no_grad():
        a = model(input_ids=ids).logits.float()
        b = plain(input_ids=ids).logits.float()
    print(f"patched vs reloaded plain model: max |logit difference| {float((a - b).abs().max()):.3g}")

    # generation with the KV cache runs through the fused block too (one token per step)
    model.eval()
    out = model.generate(ids[:1, :24], max_new_tokens=16, do_sample=False)
    print("prompt  :", ids[0, :24].tolist())
    print("continued:", out[0, 24:].tolist())


if __name__ == "__main__":
    main()
