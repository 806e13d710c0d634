"""benchmarks/profile_hf.py on the CPU (issue 16 diagnostic): the --tiny run of the hf and
hf+fusedqkv stacks (every category reported, the attention input seen forward and backward in
both, the categories adding up to the profiler's own total), and the GPU rules of the
attribution on a synthetic Chrome trace (kernels found through their launch calls, backward
kernels sent to their forward regions by sequence number)."""

import json

import pytest

pytest.importorskip("transformers")

from _scripts import load_benchmark  # noqa: E402

EV = "autograd::engine::evaluate_function: "


def load_profile():
    return load_benchmark("profile_hf")


def test_tiny_run_attributes_the_step(tmp_path, capsys):
    ph = load_profile()
    rc = ph.main(["--tiny", "--device", "cpu", "--stacks", "hf,hf+fusedqkv", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads((tmp_path / "profile_hf.json").read_text())
    assert set(report["results"]) == {"hf", "hf+fusedqkv"}
    for stack, r in report["results"].items():
        cats = r["categories"]
        assert set(cats) == set(ph.CATEGORY_KEYS), stack
        total = sum(c["ms"] for c in cats.values())
        # the categories add up to the op time torch's own tables count
        assert abs(total - r["profiler_total_ms"]) <= 0.1 * r["profiler_total_ms"], (stack, total, r)
        assert abs(total - r["kernel_total_ms"]) <= 1e-6 * total
        attn = cats["attn_input"]
        assert attn["ms"] > 0 and attn["fwd_ms"] > 0 and attn["bwd_ms"] > 0, (stack, attn)
        for key in ("attn_core", "mlp", "norm", "lm_head_loss"):
            assert cats[key]["fwd_ms"] > 0 and cats[key]["bwd_ms"] > 0, (stack, key, cats[key])
        assert cats["optimizer"]["ms"] > 0 and cats["embedding"]["ms"] > 0
        # little is left without a region
        assert cats["other"]["ms"] < 0.1 * total, (stack, cats["other"], r["attribution"])
        assert r["attribution"]["attention_interface_calls"] == 2  # one per layer: attn_core split off
        assert len(r["top_kernels"]) == ph.TOP_KERNELS
        assert (tmp_path / r["trace"]).stat().st_size > 1000
    hf_top = [t["name"] for t in report["results"]["hf"]["categories"]["attn_input"]["top"]]
    assert any("MmBackward0" in n for n in hf_top), hf_top  # q/k/v projections' backward
    fused_top = [t["name"] for t in report["results"]["hf+fusedqkv"]["categories"]["attn_input"]["top"]]
    assert "GQAQKVRoPEQKNormFunction" in fused_top[:3] and any("GQAQKVRoPEQKNormFunctionBackward" in n
                                                               for n in fused_top[:3]), fused_top
    assert [p["fused"] for p in report["pairs"]] == ["hf+fusedqkv"]
    tail = out.strip().splitlines()
    # the table last: a header, the categories, six summary rows (no memory rows on the CPU)
    header = tail[-1 - len(ph.CATEGORIES) - 6]
    assert header.startswith("ms/step") and header.split()[-2:] == ["hf", "hf+fusedqkv"], tail
    assert tail[-1].startswith("step if attn input were free")


def _x(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_gpu_trace_attribution():
    """Kineto's event layout: kernels on a stream, linked by correlation id to the runtime or
    driver call on the launching thread and by External id to the op; the backward on
    autograd's thread inside evaluate_function ops that carry the forward op's sequence
    number."""
    ph = load_profile()
    main, autograd, stream = 100, 200, 7
    R, P = ph.REGION, ph.PHASE
    ev = [
        _x("user_annotation", P + "forward", 0, 100, main),
        _x("user_annotation", R + "residual", 5, 60, main),
        _x("user_annotation", R + "attn_input", 10, 20, main),
        _x("cpu_op", "aten::mm", 12, 8, main, **{"External id": 11, "Sequence number": 5}),
        _x("cuda_runtime", "cudaLaunchKernel", 13, 1, main, correlation=1001, **{"External id": 11}),
        _x("user_annotation", R + "attn_core", 30, 20, main),
        _x("cpu_op", "aten::_efficient_attention_forward", 31, 9, main, **{"External id": 12, "Sequence number": 6}),
        _x("cuda_runtime", "cudaLaunchKernel", 32, 1, main, correlation=1002, **{"External id": 12}),
        _x("cuda_driver", "cuLaunchKernelEx", 45, 1, main, correlation=1003),  # a Triton kernel, no op around it
        _x("cpu_op", "aten::add", 55, 2, main, **{"External id": 13, "Sequence number": 7}),  # the layer's own op
        _x("cpu_op", "aten::arange", 80, 2, main, **{"External id": 14}),  # outside every region
        _x("user_annotation", P + "backward", 100, 200, main),
        _x("cpu_op", EV + "AddBackward0", 140, 5, autograd, **{"External id": 20, "Sequence number": 7}),
        _x("cpu_op", EV + "MmBackward0", 150, 20, autograd, **{"External id": 21, "Sequence number": 5}),
        _x("cuda_runtime", "cudaLaunchKernel", 155, 1, autograd, correlation=2001, **{"External id": 21}),
        _x("cpu_op", EV + "EfficientAttentionBackward0", 175, 20, autograd,
           **{"External id": 22, "Sequence number": 6}),
        _x("cuda_runtime", "cudaLaunchKernel", 180, 1, autograd, correlation=2002, **{"External id": 22}),
        _x("cpu_op", EV + "torch::autograd::AccumulateGrad", 200, 5, autograd, **{"External id": 23}),
        _x("cuda_runtime", "cudaLaunchKernel", 201, 1, autograd, correlation=2003, **{"External id": 23}),
        _x("user_annotation", P + "optimizer", 300, 50, main),
        _x("cuda_runtime", "cudaLaunchKernel", 310, 1, main, correlation=3001),
        # GPU side
        _x("kernel", "void gemm_qkv<float>(float*)", 20, 50, stream, correlation=1001, **{"External id": 11}),
        _x("kernel", "fmha_fwd", 70, 40, stream, correlation=1002, **{"External id": 12}),
        _x("kernel", "triton_rope", 110, 5, stream, correlation=1003),
        _x("kernel", "add_kernel", 115, 2, stream, **{"External id": 13}),  # no launch record: External id
        _x("kernel", "arange_kernel", 117, 1, stream, **{"External id": 14}),
        _x("kernel", "gemm_dgrad", 160, 80, stream, correlation=2001, **{"External id": 21}),
        _x("kernel", "fmha_bwd", 240, 60, stream, correlation=2002, **{"External id": 22}),
        _x("kernel", "accumulate", 300, 3, stream, correlation=2003, **{"External id": 23}),
        _x("kernel", "multi_tensor_apply_kernel", 320, 10, stream, correlation=3001),
        _x("gpu_user_annotation", R + "attn_input", 20, 50, stream),  # not a kernel
    ]
    res = ph.attribute(ev, n_steps=1)
    cats = res["categories"]
    ms = {k: round(c["ms"] * 1e3, 6) for k, c in cats.items()}  # back to the trace's microseconds
    assert ms["attn_input"] == 50 + 80
    assert cats["attn_input"]["fwd_ms"] * 1e3 == pytest.approx(50) and cats["attn_input"]["bwd_ms"] * 1e3 == \
        pytest.approx(80)
    assert ms["attn_core"] == 40 + 5 + 60  # the Triton kernel found through its driver call
    assert ms["residual"] == 2 and ms["optimizer"] == 10
    assert ms["other"] == 1 + 3  # arange outside every region, AccumulateGrad without a sequence number
    assert res["kernel_total_ms"] * 1e3 == pytest.approx(50 + 40 + 5 + 2 + 1 + 80 + 60 + 3 + 10)
    assert res["attribution"]["kind"] == "gpu kernels"
    assert res["top_kernels"][0]["name"] == "gemm_dgrad" and res["top_kernels"][0]["category"] == "attn_input"
    assert [t["name"] for t in res["top_kernels"]].count("gemm_qkv<float>") == 1


def test_short_kernel_names():
    ph = load_profile()
    name = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
            "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
    assert ph.short_name(name) == ("at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<>, "
                                   "std::array<> >")
    assert ph.short_name("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN") == "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN"
    assert ph.short_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*)") == \
        "at::native::cunn_SoftMaxForward<4, float>"
    assert len(ph.short_name("k" * 200)) == 90
