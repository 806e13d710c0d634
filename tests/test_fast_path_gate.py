"""The fast launch path is on, and exact, on every supported Triton; when it cannot be used the
gate says why, once.

:class:`fusedqkv.ops.launch.BoundLaunch` calls a compiled kernel's launcher directly through
Triton internals (:mod:`fusedqkv.ops.internals`). On an unsupported or restructured Triton the
gate turns the raw path off and every launch goes through the JIT: right results, more host
time. So that such a Triton fails here instead of slowing users down, one release of every
supported minor version (and the installed Triton) runs ``_fast_path_probe.py`` in a child
process: kernels compiled offline for sm_90, launched once by Triton's own path and then raw,
both launcher calls recorded and compared argument for argument; the probe fails where the gate
is not active. On Triton 3.6 the comparison is at the driver: Triton's own C launcher and
fusedqkv's ctypes launch (and, with FUSEDQKV_RAW_LAUNCH=triton, fusedqkv through Triton's launcher)
must hand a recording stand-in libcuda the same launch config and parameter bytes; a layout
mistake made on purpose must be caught. The Tritons other than the installed one come from the package index
(``_tritons.py``: ``pip download``, cached unpacked under ``$XDG_CACHE_HOME/fusedqkv`` or
``~/.cache/fusedqkv``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _tritons import INSTALLED, triton_path, version_key

from fusedqkv.ops import internals

PINNED = ("3.6.0", "3.7.1", "3.8.0", "3.9.0")  # a release of each supported minor version
SRC = Path(__file__).resolve().parents[1] / "src"
PROBE = Path(__file__).with_name("_fast_path_probe.py")
VERSIONS = sorted(set(PINNED) | ({INSTALLED} if INSTALLED else set()), key=version_key)


DRIVER_VERSION = "3.6.0"  # the Triton whose launcher's parameter layout the driver launch mirrors
MUTATIONS = {"fp32-as-fp64": "parameter", "map-offset": "parameter 0 (128 bytes)", "pdl-attribute": "attrs"}
# the driver Triton's checks in one probe process, in this order: the default and Triton-launcher runs after the
# mutations show that each run starts from the unmutated state
DRIVER_RUNS = (*MUTATIONS, "triton", "default")


def run_probe(version: str, runs=(), **env_extra) -> dict:
    """The probe's result with Triton ``version`` importable (``env_extra``: more environment); with
    ``runs`` (names of ``_fast_path_probe.RUNS``), those checks in turn in the one process: run -> result."""
    path = triton_path(version)
    entries = [str(p) for p in (path, SRC) if p] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(entries))
    env.pop("FUSEDQKV_RAW_LAUNCH", None)  # the default mode unless asked
    env.update(env_extra)
    if runs:
        env["FUSEDQKV_PROBE_RUNS"] = ",".join(runs)
    try:
        proc = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        tail = f"{str(e.stdout)[-2000:]}\n{str(e.stderr)[-2000:]}"
        failed = {"ok": False, "problems": [f"the probe ran past 600 s:\n{tail}"]}
        return {run: failed for run in runs} if runs else failed
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    missing = {"ok": False, "problems": [f"the probe exited {proc.returncode} without a result:\n"
                                         f"{(proc.stdout + proc.stderr)[-4000:]}"]}
    if not runs:
        return results[-1] if results else missing
    by_run = {r.get("run"): r for r in results}
    return {run: by_run.get(run, missing) for run in runs}


@pytest.fixture(scope="module")
def probes() -> dict:
    """version (or (version, mode) / (version, mutation)) -> the probe's result; each version
    fetched (when not cached) and probed side by side. The driver Triton's default mode, its Triton
    launcher mode and its mutations are checked in turn in one process (each from the state the
    probe imported: ``_fast_path_probe.main``): one process's imports and driver build instead of
    five, and its kernels compiled once."""
    with concurrent.futures.ThreadPoolExecutor(len(VERSIONS)) as pool:
        futures = {v: pool.submit(run_probe, v, *([DRIVER_RUNS] if v == DRIVER_VERSION else []))
                   for v in VERSIONS}
        out = {}
        for v, f in futures.items():
            if v != DRIVER_VERSION:
                out[v] = f.result()
                continue
            for run, result in f.result().items():
                out[v if run == "default" else (v, run)] = result
        return out


def test_every_supported_minor_version_is_checked():
    (lo_major, lo_minor), (hi_major, hi_minor) = internals.TRITON_SUPPORTED
    assert lo_major == hi_major
    assert {v.rsplit(".", 1)[0] for v in PINNED} == {f"{lo_major}.{m}" for m in range(lo_minor, hi_minor + 1)}


@pytest.mark.parametrize("version", VERSIONS)
def test_raw_launch_is_active_and_matches_tritons_own_launch(probes, version):
    result = probes[version]
    assert result["ok"], f"Triton {version}:\n" + "\n".join(result["problems"])
    assert result["info"]["triton"] == version
    driver = internals._in_range(version, internals.DRIVER_LAUNCH_SUPPORTED)
    assert result["info"]["launch"] == ("ctypes" if driver else "triton")


def test_tritons_launcher_stays_available_for_ab(probes):
    """FUSEDQKV_RAW_LAUNCH=triton on the driver launch's Triton: bound launches through Triton's C
    launcher, the same bytes at the driver."""
    result = probes[(DRIVER_VERSION, "triton")]
    assert result["ok"], "\n".join(result["problems"])
    assert (result["info"]["launch"], result["info"]["driver_launches"]) == ("triton", 0)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_probe_catches_a_wrong_parameter_layout(probes, mutation):
    result = probes[(DRIVER_VERSION, mutation)]
    assert not result["ok"], f"{mutation}: a wrong layout went unnoticed"
    assert any(MUTATIONS[mutation] in p for p in result["problems"]), result["problems"]


def test_the_launch_mode_is_checked(monkeypatch):
    monkeypatch.setenv("FUSEDQKV_RAW_LAUNCH", "driver")
    with pytest.raises(ValueError, match="FUSEDQKV_RAW_LAUNCH='driver': expected 'ctypes'"):
        internals._launch_mode_from_env()
    for mode in ("ctypes", "triton"):
        monkeypatch.setenv("FUSEDQKV_RAW_LAUNCH", mode)
        assert internals._launch_mode_from_env() == mode
    monkeypatch.delenv("FUSEDQKV_RAW_LAUNCH")
    assert internals._launch_mode_from_env() is None


def test_the_driver_launch_asked_for_where_unproven_warns(fresh_fallbacks, monkeypatch):
    """Unset, the mode is ctypes where proven and Triton's launcher elsewhere (reported, not
    warned: nothing is slower than before); asked for explicitly where unproven, it warns."""
    monkeypatch.setattr(internals, "_DRIVER_GATE", {})
    assert "proven on Triton 3.6" in internals._driver_gate(internals.SHARED_ABI)
    monkeypatch.setattr(internals, "LAUNCH_MODE", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        assert internals.launch_mode(internals.SHARED_ABI) == "triton"
    monkeypatch.setattr(internals, "LAUNCH_MODE", "ctypes")
    with pytest.warns(internals.FastPathWarning, match="proven on Triton 3.6.*Triton's C launcher"):
        assert internals.launch_mode(internals.SHARED_ABI) == "triton"
    monkeypatch.setattr(internals, "LAUNCH_MODE", "triton")
    assert internals.launch_mode(internals.MODULE_ABI) == "triton"


# ------------------------------------------------------------------------------ the gate itself


@pytest.fixture
def fresh_fallbacks():
    saved = dict(internals._FALLBACKS)
    internals._FALLBACKS.clear()
    yield
    internals._FALLBACKS.clear()
    internals._FALLBACKS.update(saved)


def test_interpreter_reports_inactive_without_warning(fresh_fallbacks):
    with warnings.catch_warnings():
        warnings.simplefilter("error", internals.FastPathWarning)
        info = internals.fast_path_info()
        assert internals.raw_launch_gate() is None
    assert (info["active"], info["reason"], info["abi"]) == (False, "interpreter", None)
    assert info["supported"] == {"triton": "3.6-3.9", "torch": "2.11-2.15", "driver_launch": "3.6-3.6"}
    assert (info["launch"], info["launch_reason"]) == (None, None)


def test_a_fallback_warns_once_naming_the_reason_and_is_recorded(fresh_fallbacks, monkeypatch):
    monkeypatch.setattr(internals, "_GATE", [("shared", None)])  # as on a GPU with a supported Triton
    assert internals.fast_path_info()["active"]
    with pytest.warns(internals.FastPathWarning, match="a_kernel: it needs scratch memory") as caught:
        internals.fall_back("a_kernel: it needs scratch memory")
        internals.fall_back("a_kernel: it needs scratch memory")
    assert len(caught) == 1
    info = internals.fast_path_info()
    assert not info["active"] and info["reason"] == "a_kernel: it needs scratch memory"
    assert info["fallbacks"] == ["a_kernel: it needs scratch memory"]


@pytest.mark.parametrize("version, rng, expected", [
    ("3.6.0", internals.TRITON_SUPPORTED, True), ("3.9.1", internals.TRITON_SUPPORTED, True),
    ("3.10.0", internals.TRITON_SUPPORTED, False), ("3.5.1", internals.TRITON_SUPPORTED, False),
    ("2.11.0+cu128", internals.TORCH_SUPPORTED, True), ("2.16.0.dev20260101", internals.TORCH_SUPPORTED, False),
    ("nightly", internals.TORCH_SUPPORTED, False)])
def test_supported_version_ranges(version, rng, expected):
    assert internals._in_range(version, rng) is expected


def test_an_unknown_launcher_structure_is_refused():
    """The ABI comes from the exact call CudaLauncher makes: another order is refused."""
    import types

    class CudaLauncher:
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_pdl, self.launch_cooperative_grid,
                        global_scratch, profile_scratch, *args)  # noqa: F821 - never run

    with pytest.raises(internals.Refused, match="calls its launcher in a way"):
        internals._launcher_abi(types.SimpleNamespace(CudaLauncher=CudaLauncher, _BASE_ARGS_FORMAT="iiiKKppOOOOOO"))


def test_torch_internals_are_in_use():
    """On a supported torch every torch internal is taken (none fell back at import)."""
    import torch

    assert internals._TORCH_PROBLEM is None
    assert internals.TensorGuards is not None
    assert internals.set_grad_enabled is torch._C._set_grad_enabled
    t = torch.empty(3, 4)
    g = internals.tensor_guards([t])
    assert g.check(t) and not g.check(torch.empty(4, 3))
    views = [t, t[:, ::2], t.t(), torch.empty(3, 1).expand(3, 4), torch.empty(1, 4).expand(1, 4),
             torch.empty(4).as_strided((2, 3), (1, 1)), torch.empty(0, 1).expand(0, 4),
             torch.empty(2, 1).expand(2, 4).t(), torch.empty(3, 1, 2).expand(3, 5, 2)[:, :, :1]]
    assert [internals.has_internal_overlap(v) for v in views] == [torch._debug_has_internal_overlap(v) == 1
                                                                   for v in views]
    assert internals.has_internal_overlap(views[3])


def test_the_constant_result_mark_is_torchs_and_import_leaves_dynamo_unloaded():
    """internals.assume_constant_result sets what torch.compiler.assume_constant_result sets (torch's
    decorator imports torch._dynamo for it: ~2 s of `import fusedqkv` on a slow host), and importing
    fusedqkv with its CLI loads no torch._dynamo. (That dynamo takes the mark as it traces:
    test_fp8.py::test_compiled_block_traces_no_cpu_scaled_mm_probe.)"""
    import torch

    def ours():
        return 1

    def torchs():
        return 1

    assert internals.assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) and vars(ours)
    code = "import sys, fusedqkv, fusedqkv.cli; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
