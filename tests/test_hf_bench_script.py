"""benchmarks/bench_hf.py's logic on the CPU (issue 16): the --tiny run of the HF stacks (no
GPU: the Liger stacks are skipped), the JSON/PNG/table it writes, and how the done criteria
are judged."""

import json

import pytest

pytest.importorskip("transformers")

from _scripts import load_benchmark  # noqa: E402
from _fp8_cpu import needs_cpu_row_scales  # noqa: E402


def load_bench():
    return load_benchmark("bench_hf")


def test_tiny_run_writes_json_png_and_table(tmp_path, capsys):
    bench = load_bench()
    rc = bench.main(["--tiny", "--steps", "3", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "bench_hf.json").read_text())
    assert rc == 0 and report["passed"]
    assert set(report["results"]) == {"hf-fp32", "hf", "hf+fusedqkv"}  # Liger stacks need a GPU
    fused = report["results"]["hf+fusedqkv"]
    assert fused["layers_fused"] == 2 and len(fused["losses"]) == 3
    # the same initial weights and data: the first losses agree within bf16 noise
    assert abs(fused["losses"][0] - report["results"]["hf"]["losses"][0]) < 1e-2
    (row,) = report["criteria"]
    assert row["loss_ok"] and row["speed_ok"] is None and row["mem_ok"] is None
    assert (tmp_path / "bench_hf_loss.png").stat().st_size > 1000
    assert "done criteria" in out.strip().splitlines()[-1]


def _result(ms, mem, losses):
    return dict(step_ms_median=ms, peak_mem_bytes=mem, losses=losses, dtype="bfloat16")


def test_judge_applies_the_done_criteria():
    bench = load_bench()
    base = [10.0, 9.0, 8.0]
    res = {"hf-fp32": _result(50.0, 100, [10.0, 9.0, 8.001]), "hf": _result(30.0, 100, base),
           "hf+fusedqkv": _result(20.0, 104, [10.0, 9.0005, 8.0]),
           "hf+liger": _result(28.0, 80, base), "hf+liger+fusedqkv": _result(22.0, 80, base)}
    rows, ok = bench.judge(res, tiny=False)
    assert [r["pass"] for r in rows] == [True, False] and not ok  # 28 -> 22 ms is only -21 %
    assert rows[1]["speed_ok"] is False and rows[1]["loss_ok"] and rows[1]["mem_ok"]
    res["hf+fusedqkv"]["peak_mem_bytes"] = 106  # 6 % above
    rows, _ = bench.judge(res, tiny=False)
    assert rows[0]["mem_ok"] is False
    res["hf+fusedqkv"] = _result(20.0, 100, [10.0, 9.0, 8.01])  # off by 10x the bf16 noise
    rows, _ = bench.judge(res, tiny=False)
    assert rows[0]["loss_ok"] is False and rows[0]["bf16_noise"] == pytest.approx(1e-3)
    text = bench.table(dict(results=res, criteria=rows, passed=False))
    assert "FAIL" in text.splitlines()[-1]


def test_without_the_fp32_yardstick_the_loss_is_not_judged():
    """No hf-fp32 stack: the bf16 noise is unmeasured, so no pair's loss is judged -- neither failed against a
    bare 1e-3 (session 30's 28-layer compile pair) nor passed -- and no pair passes."""
    bench = load_bench()
    res = {"compile(hf)": _result(30.0, 100, [10.0, 9.0, 8.0]),
           "compile(hf+fusedqkv)": _result(20.0, 100, [10.0, 9.2, 8.1])}
    rows, ok = bench.judge(res, tiny=False)
    assert len(rows) == 1 and rows[0]["loss_ok"] is None and rows[0]["loss_tol"] is None
    assert rows[0]["speed_ok"] and not rows[0]["pass"] and not ok
    text = bench.table(dict(results=res, criteria=rows, passed=ok))
    assert "loss NOT JUDGED (no hf-fp32 stack)" in text and "FAIL" in text.splitlines()[-1]
    res["hf"], res["hf-fp32"] = _result(40.0, 100, [10.0, 9.0, 8.0]), _result(60.0, 100, [10.0, 9.1, 8.0])
    rows, ok = bench.judge(res, tiny=False)  # with it: 0.2 <= 2 x 0.1 + 1e-3
    assert rows[0]["loss_ok"] and rows[0]["pass"] and ok


def test_qwen3_5_tiny_run_with_the_compile_stacks(tmp_path, capsys):
    """--family qwen3_5_text (issue 25): every layer full attention, the default stacks with
    the two compile stacks (aot_eager on the CPU), both pairs judged on their losses."""
    bench = load_bench()
    rc = bench.main(["--tiny", "--family", "qwen3_5_text", "--device", "cpu", "--steps", "3", "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads((tmp_path / "bench_hf.json").read_text())
    assert rc == 0 and report["passed"]
    cfg = report["config"]
    assert cfg["family"] == "qwen3_5_text" and cfg["compile_backend"] == "aot_eager"
    assert cfg["model_config"]["layer_types"] == ["full_attention"] * 2
    assert list(report["results"]) == ["hf-fp32", "hf", "hf+fusedqkv", "compile(hf)", "compile(hf+fusedqkv)"]
    for stack in ("hf+fusedqkv", "compile(hf+fusedqkv)"):
        assert report["results"][stack]["layers_fused"] == 2 and len(report["results"][stack]["losses"]) == 3
    assert [(r["base"], r["fused"]) for r in report["criteria"]] == [("hf", "hf+fusedqkv"),
                                                                      ("compile(hf)", "compile(hf+fusedqkv)")]
    assert all(r["loss_ok"] and r["speed_ok"] is None for r in report["criteria"])
    assert "step time no slower" in last


def test_qwen3_5_full_size_config():
    """The device run's model: Qwen3.5-9B's attention and vocabulary, --layers layers of full attention."""
    import transformers

    bench = load_bench()
    kw = bench.family_config("qwen3_5_text", tiny=False, layers=6)
    cfg = transformers.Qwen3_5TextConfig(**kw)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        248320, 4096, 16, 4, 256)
    assert cfg.layer_types == ["full_attention"] * 6 and cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert bench.family_config("qwen3", tiny=False, layers=4) == bench.QWEN3_06B  # qwen3 as before


@needs_cpu_row_scales
def test_tiny_fp8_run_converts_every_linear_and_fuses_q_k_v_in_fp8(tmp_path):
    pytest.importorskip("torchao.float8")
    bench = load_bench()
    rc = bench.main(["--tiny", "--steps", "2", "--device", "cpu", "--fp8", "rowwise", "--stacks",
                     "hf-bf16,hf,hf+fusedqkv", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_hf.json").read_text())
    assert rc in (0, 1) and report["results"]["hf+fusedqkv"]["layers_fused"] == 2
    # FP8 in both stacks: the first losses agree within FP8's noise, not bf16's alone
    res = report["results"]
    hf, fused, bf16 = res["hf"]["losses"], res["hf+fusedqkv"]["losses"], res["hf-bf16"]["losses"]
    assert abs(hf[0] - fused[0]) < 5e-2
    # the loss rule is FP8's: the distance from the bf16 run, against torchao's own
    (row,) = report["criteria"]
    spread = max(abs(a - b) for a, b in zip(hf, bf16))
    assert row["fp8_spread"] == pytest.approx(spread) and row["loss_tol"] == pytest.approx(1.25 * spread + 1e-3)
    assert row["max_loss_diff"] == pytest.approx(max(abs(a - b) for a, b in zip(fused, bf16)))
    assert report["config"]["fp8"] == "rowwise" and "1.25" in report["config"]["fp8_loss_rule"]
    with pytest.raises(SystemExit):  # the bf16 yardstick only means something beside --fp8
        bench.main(["--tiny", "--device", "cpu", "--stacks", "hf-bf16,hf", "--out", str(tmp_path)])


def test_tiny_qlora_run(tmp_path, capsys):
    """--lora --qlora nf4: the decoder's linears 4-bit before apply_to, the fused stack over them
    (skipped without bitsandbytes)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    bench = load_bench()
    rc = bench.main(["--tiny", "--steps", "2", "--device", "cpu", "--lora", "4", "--qlora", "nf4", "--lora-init",
                     "random", "--stacks", "hf-fp32,hf,hf+fusedqkv", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "bench_hf.json").read_text())
    assert report["config"]["lora"]["qlora"] == "nf4" and "linear layers nf4 4-bit" in out
    assert rc == 0 and report["passed"] and report["results"]["hf+fusedqkv"]["layers_fused"] == 2
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--qlora", "nf4", "--device", "cpu", "--out", str(tmp_path)])


def test_dense_qkv_bound_says_when_a_target_is_out_of_reach(tmp_path):
    """--lora: the dense-qkv stack (q/k/v without adapters) bounds what any attention input can
    cut from hf's step; a target above ``1 - bound / hf`` is reported out of reach."""
    bench = load_bench()
    base = [10.0, 9.0]
    res = {"hf": _result(100.0, 100, base), "hf+fusedqkv": _result(82.0, 100, base),
           bench.DENSE_QKV: _result(78.0, 100, base)}
    bound = bench.qkv_bound(res, 0.25)
    assert bound["max_reduction"] == pytest.approx(0.22) and not bound["target_within_bound"]
    assert bound["fused_over_bound"] == pytest.approx(82 / 78)
    assert bench.qkv_bound(res, 0.20)["target_within_bound"]
    rows, _ = bench.judge(res, tiny=False, min_step_reduction=0.25)
    assert [(r["base"], r["fused"]) for r in rows] == [("hf", "hf+fusedqkv")]  # the bound is not a pair
    text = bench.table(dict(results=res, criteria=rows, passed=False, qkv_bound=bound,
                            config=dict(min_step_reduction=0.25)))
    assert "OUT OF REACH" in text and "22.0%" in text
    with pytest.raises(SystemExit):  # a bound of adapters only means something beside --lora
        bench.main(["--tiny", "--device", "cpu", "--stacks", f"hf,{bench.DENSE_QKV}", "--out", str(tmp_path)])
