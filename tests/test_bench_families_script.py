"""benchmarks/bench_families.py's logic on the CPU (issues 25, 38): the --smoke run of the four
families (tiny shapes, the torch path, compile through aot_eager, no CUDA graphs), the JSON and
table it writes, a provider that fails its check not timed, the script's copy of HF's input part
proved against HF's own forward, the released sizes' configs, and the option errors."""

import json

import pytest

pytest.importorskip("transformers")

from _scripts import load_benchmark  # noqa: E402


def load_bench():
    return load_benchmark("bench_families")


def test_smoke_run_checks_times_and_writes_every_row(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads((tmp_path / "bench_families.json").read_text())
    assert report["meta"]["smoke"] and report["checks_passed"] and report["passed"]
    assert set(report["shapes"]) == set(bench.SHAPES) == {"qwen3_5_text", "olmo3", "glm4_moe", "gemma4_text"}
    assert all(c["bitwise_equal"] for c in report["hf_forward_checks"].values())
    assert [(r["family"], r["batch"], r["seq"]) for r in report["rows"]] == [
        (f, b, s) for f in bench.SHAPES for b, s in ((1, 12), (2, 8))]
    for r in report["rows"]:
        assert set(r["ms"]) == set(bench.PROVIDERS), r["family"]
        assert all(set(v) == set(bench.MODES) for v in r["ms"].values())
        c = r["checks"]
        assert c["fp32"]["all_ok"] and all(c["bf16"][p]["all_ok"] for p in bench.CHECKED)
        # every gradient is judged: x, the fused projection (GLM-4.5: and its bias), both norms
        grads = {"grad_x", "grad_qkv_weight", "grad_q_norm_weight", "grad_k_norm_weight"}
        grads |= {"grad_qkv_bias"} if r["family"] == "glm4_moe" else set()
        outputs = {"q", "k", "v"} | ({"gate"} if r["family"] == "qwen3_5_text" else set())
        assert set(c["tensors"]) == outputs | grads
        for mode in bench.MODES:  # CPU: ratios reported, not judged
            crit = r["criteria"][mode]
            assert crit["fused_over_compile"] > 0 and crit["as_fast_as_compile"] is None and crit["eager_2x"] is None
    assert "n/a (CPU smoke run)" in last


def test_a_provider_failing_its_check_is_not_timed(tmp_path, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "THREE_WAY_ATOL", -1.0)  # no bf16 result can pass
    assert bench.main(["--smoke", "--families", "olmo3", "--tokens", "1x8", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "bench_families.json").read_text())
    (row,) = report["rows"]
    assert not report["checks_passed"] and not report["passed"]
    assert set(row["ms"]) == {"hf_eager", "floor"}
    assert row["criteria"]["fwd+bwd"]["fused_over_compile"] is None


def test_an_input_part_that_differs_from_hf_s_forward_refuses_the_family(tmp_path, monkeypatch):
    bench = load_bench()

    def k_and_v_swapped(self, modeling, x, cos, sin):
        q, k, v = bench.olmo3_input_part(self, modeling, x, cos, sin)
        return q, v, k

    shapes = dict(bench.SHAPES, olmo3=bench.dataclasses.replace(bench.SHAPES["olmo3"], input_part=k_and_v_swapped))
    monkeypatch.setattr(bench, "SHAPES", shapes)
    assert bench.main(["--smoke", "--families", "olmo3", "--tokens", "1x8", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "bench_families.json").read_text())
    assert not report["hf_forward_checks"]["olmo3"]["bitwise_equal"]
    assert report["rows"][0]["ms"] == {}


def test_released_sizes_build_their_configs():
    bench = load_bench()
    heads = {}
    for fam, shape in bench.SHAPES.items():
        cfg = bench.build_config(shape, smoke=False)
        layer = getattr(cfg, "per_layer_config", {0: cfg})[0]  # Gemma 4: the layer's own head sizes
        d = getattr(layer, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        heads[fam] = (cfg.hidden_size, cfg.num_attention_heads, layer.num_key_value_heads, d)
    assert heads == {"qwen3_5_text": (5120, 24, 4, 256), "olmo3": (4096, 32, 32, 128), "glm4_moe": (5120, 96, 8, 128),
                     "gemma4_text": (5376, 32, 4, 512)}


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "2048"], "--tokens: expected BATCHxSEQ"),
    (["--tokens", "1x0"], "--tokens: expected BATCHxSEQ"),
    (["--families", "qwen3,olmo3"], "--families: unknown ['qwen3']"),
    (["--reps", "0"], "--reps must be >= 1"),
])
def test_bad_options_are_one_line_errors(argv, message, tmp_path, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke", "--out", str(tmp_path), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bench_families.json").exists()
