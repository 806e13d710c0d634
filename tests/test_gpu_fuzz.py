"""benchmarks/gpu_fuzz.py on the CPU: a handful of cases through its main function with the
Triton kernels in the interpreter, replays, and that a wrong result or a crash fails the run."""

import json

import pytest
import torch

from _scripts import load_benchmark

import fusedqkv
from fusedqkv.bench import problem

fuzz = load_benchmark("gpu_fuzz")

needs_pack = pytest.mark.skipif(problem.official_pack_dir() is None,
                                reason="official SOL-ExecBench pack not found beside the repo")
SMALL = ["--device", "cpu", "--max-tokens", "6", "--max-hidden", "100", "--max-heads", "4", "--head-dims", "16,64"]


@needs_pack
def test_fuzz_cases_pass_in_the_interpreter(tmp_path, capsys):
    rc = fuzz.main(["--backend", "triton", "--cases", "8", "--seed", "3", "--out", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "fuzz.json").read_text())
    assert data["summary"]["cases"] == 8 and data["summary"]["failed"] == 0
    assert {r["case"]["api"] for r in data["results"]} == {"091", "train"}
    assert "RESULT gpu_fuzz PASS cases=8/8" in out


def test_cases_are_reproducible_and_within_the_caps():
    caps = dict(max_tokens=64, max_hidden=128, max_heads=8, head_dims=[64, 128])
    cases = [fuzz.draw_case(5, i, caps) for i in range(200)]
    assert cases == [fuzz.draw_case(5, i, caps) for i in range(200)]
    assert cases != [fuzz.draw_case(6, i, caps) for i in range(200)]
    for c in cases:
        assert 1 <= c["batch"] * c["seq"] <= 64 and c["hidden"] <= 128 and c["num_heads"] <= 8
        assert c["num_heads"] % c["num_kv_heads"] == 0 and c["head_dim"] in (64, 128)
    # the shape classes come up: one token, one head group, 2-3 tokens, odd seq, both APIs
    assert any(c["batch"] == 1 and c["seq"] == 1 for c in cases)
    assert any(c["num_heads"] == c["num_kv_heads"] == 1 for c in cases)
    assert any(c["batch"] * c["seq"] in (2, 3) for c in cases)
    assert any(c["seq"] % 2 == 1 and c["seq"] > 1 for c in cases)
    assert {c["api"] for c in cases} == {"091", "train"}
    assert {c["layout"] for c in cases} == set(fuzz.LAYOUTS)
    assert {c["dtype"] for c in cases} == {"bf16", "fp16", "fp32"}
    # the FP8 projection's recipes, only where its GEMMs take the sizes
    train = [c for c in cases if c["api"] == "train"]
    assert {c["fp8"] for c in train} == {None, "rowwise", "tensorwise", "rowwise_with_gw_hp"}
    assert all(c["hidden"] % 16 == 0 for c in train if c["fp8"])


@needs_pack
def test_head_dim_512_cases_take_the_per_head_norm():
    """head_dim 512 comes up with its variants (Gemma 4's: v normed, v the raw k), never the norm over all
    heads (the block refuses it there)."""
    caps = dict(max_tokens=64, max_hidden=128, max_heads=8, head_dims=[128, 512])
    cases = [fuzz.draw_case(5, i, caps, api="train") for i in range(300)]
    wide = [c for c in cases if c["head_dim"] == 512]
    assert wide and all(c["norm_scope"] == "head" for c in wide)
    assert any(c["v_norm"] and c["k_eq_v"] for c in wide) and any(c["norm_scope"] == "all_heads" for c in cases)


def test_a_wrong_091_result_fails_the_run_with_a_replay_line(monkeypatch, tmp_path, capsys):
    real = fusedqkv.gqa_qkv_rope_qk_norm_backward

    def off_by_a_bit(*args, **kw):
        out = list(real(*args, **kw))
        out[1] = out[1] * 1.1  # grad_cos 10% off
        return tuple(out)

    monkeypatch.setattr(fusedqkv, "gqa_qkv_rope_qk_norm_backward", off_by_a_bit)
    rc = fuzz.main(["--backend", "torch", "--cases", "3", "--api", "091", "--out", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILING CASE:" in out and "mismatch grad_cos" in out and "replay: python3 benchmarks/gpu_fuzz.py" in out
    # the replay line runs that one case again (and passes with the real implementation)
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("replay: python3"))
    argv = line.split("benchmarks/gpu_fuzz.py", 1)[1].split()
    monkeypatch.setattr(fusedqkv, "gqa_qkv_rope_qk_norm_backward", real)
    assert fuzz.main(argv) == 0


def test_a_wrong_training_result_or_a_crash_fails_the_run(monkeypatch, capsys):
    real = fusedqkv.gqa_qkv_rope_qk_norm

    def q_scaled(*args, **kw):
        q, k, v = real(*args, **kw)
        return q * 1.01, k, v

    monkeypatch.setattr(fusedqkv, "gqa_qkv_rope_qk_norm", q_scaled)
    assert fuzz.main(["--backend", "torch", "--cases", "4", "--api", "train", *SMALL]) == 1
    assert "mismatch q:" in capsys.readouterr().out

    def crash(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(fusedqkv, "gqa_qkv_rope_qk_norm", crash)
    assert fuzz.main(["--backend", "torch", "--cases", "2", "--api", "train", *SMALL]) == 1
    assert "crash: RuntimeError: boom" in capsys.readouterr().out


def test_strided_layouts_keep_the_values():
    mk = fuzz.Maker(dict(layout="contiguous", data_seed=1), torch.device("cpu"))
    t = torch.randn(2, 3, 4, 6)
    for layout in fuzz.LAYOUTS:
        p = mk.place(t, layout)
        assert torch.equal(p, t), layout
        assert p.is_contiguous() == (layout == "contiguous"), layout
