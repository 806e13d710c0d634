"""Export fusedqkv as a SOL-ExecBench ``solution.json``.

Field names follow SOL-ExecBench's Solution schema: ``name``, ``definition``,
``description``, ``author``, ``spec`` (``language``, ``target_hardware``,
``entry_point`` as ``file::function``, ``dependencies``, ``destination_passing_style``)
and ``sources`` (``path`` + ``content``). The issue's ``languages: ["triton"]`` is
written too, beside the schema's ``language``.

The sources are the package's ``kernels/`` and ``ops/`` files under a private package
name (``fusedqkv_sol``, so an installed fusedqkv cannot shadow them) plus ``main.py``,
whose ``run`` takes the definition's inputs then its outputs (destination passing),
with the parameter names of the definition.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import problem, records

PKG = "fusedqkv_sol"
ENTRY_FILE = "main.py"
ENTRY_FN = "run"


def _main_source(defn) -> str:
    ins, outs = list(defn.inputs), list(defn.outputs)
    params = ",\n    ".join(ins + outs)
    return f'''"""fusedqkv solution for SOL-ExecBench {defn.name} (destination passing)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from {PKG}.ops.gqa_backward import gqa_qkv_rope_qk_norm_backward  # noqa: E402


def {ENTRY_FN}(
    {params},
):
    gqa_qkv_rope_qk_norm_backward(
        {", ".join(ins)},
        out=({", ".join(outs)},),
    )
'''


def build_solution(name: Optional[str] = None, author: str = "fusedqkv",
                   definition: str = problem.DEFAULT_DEFINITION) -> dict:
    defn = problem.load_definition(definition)
    root = records.package_root()
    sources = [{"path": f"{PKG}/__init__.py", "content": '"""fusedqkv kernels and launchers (solution copy)."""\n'}]
    for sub in ("kernels", "ops"):
        for p in sorted((root / sub).rglob("*.py")):
            content = p.read_text()
            if not content.strip():
                content = "# (empty module)\n"
            sources.append({"path": f"{PKG}/{p.relative_to(root).as_posix()}", "content": content})
    sources.append({"path": ENTRY_FILE, "content": _main_source(defn)})
    digest = records.digest({s["path"]: records.sha256_text(s["content"]) for s in sources})
    from .. import __version__

    return {
        "name": name or f"fusedqkv_triton_{defn.name[:3]}_v{__version__}_{digest[7:15]}",
        "definition": defn.name,
        "description": ("fusedqkv: one Triton kernel for the RoPE + QK-norm backward (reproducing the "
                        "reference's bf16 rounding points) writing dQKV, then dX = dQKV.W and "
                        "dW = dQKV^T.X on cuBLAS; deterministic dW/dnorm partials."),
        "author": author,
        "spec": {
            "language": "triton",
            "languages": ["triton"],
            "target_hardware": ["LOCAL", "B200"],
            "entry_point": f"{ENTRY_FILE}::{ENTRY_FN}",
            "dependencies": ["torch", "triton >= 3.2"],
            "destination_passing_style": True,
        },
        "sources": sources,
    }


def write_solution(path, **kw) -> dict:
    sol = build_solution(**kw)
    Path(path).write_text(json.dumps(sol, indent=1))
    return sol


def materialize(sol: dict, folder) -> Path:
    """Write the sources under folder (as the official builder does); returns the entry file."""
    folder = Path(folder)
    for s in sol["sources"]:
        rel = Path(s["path"])
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"bad source path {s['path']!r}")
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(s["content"])
    return folder / sol["spec"]["entry_point"].split("::")[0]


def load_entry(sol: dict, folder):
    """Materialise and import the entry point; returns the callable."""
    entry = materialize(sol, folder)
    fn_name = sol["spec"]["entry_point"].split("::")[1]
    mod_name = f"_fusedqkv_solution_{abs(hash(str(folder)))}"
    # a fresh private package each time: drop a previous copy of it
    for k in [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]:
        del sys.modules[k]
    spec = importlib.util.spec_from_file_location(mod_name, entry)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, fn_name)


def check_solution(sol: dict, device="cpu", max_tokens: int = 32, workloads=(2, 13)) -> list:
    """Run the exported solution (from a temporary folder) against the reference.

    Returns one dict per workload: name, passed, and the per-output checks.
    """
    import torch

    defn = problem.load_definition(sol["definition"])
    ref, _ = problem.reference_impl(defn.name)
    results = []
    with tempfile.TemporaryDirectory(prefix="fusedqkv_solution_") as tmp:
        run = load_entry(sol, tmp)
        try:
            for i in workloads:
                w = defn.workload(i)
                if torch.device(device).type == "cpu":
                    w = problem.reduced_workload(w, max_tokens)
                args = list(problem.generate_inputs(defn, w, device=device, seed=w.index).values())
                with torch.no_grad():
                    expect = tuple(ref(*args))
                outs = [torch.full_like(t, float("nan")) for t in expect]
                ret = run(*args, *outs)
                checks = problem.check_outputs(list(defn.outputs), outs, expect, w)
                results.append({"workload": w.name, "returned_none": ret is None,
                                "passed": all(c.passed for c in checks), "checks": [c.to_json() for c in checks]})
        finally:
            sys.path[:] = [p for p in sys.path if p != str(tmp)]
            for k in [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]:
                del sys.modules[k]
    return results
