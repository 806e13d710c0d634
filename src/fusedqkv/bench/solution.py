"""Export fusedqkv as a SOL-ExecBench ``solution.json`` that runs on its own.

Field names follow SOL-ExecBench's Solution schema: ``name``, ``definition``,
``description``, ``author``, ``spec`` (``languages``, ``target_hardware``,
``entry_point`` as ``file::function``, ``dependencies``, ``destination_passing_style``)
and ``sources`` (``path`` + ``content``); ``language`` is written beside ``languages``.

What is shipped is what runs: the modules reached from the module that defines the
entry function (``ops/backward_091.py``) by following its relative imports (``ast``,
imports anywhere in a module, lazy ones included), plus the ``__init__`` of every package
on the way, under a private package name (``fusedqkv_sol``, so an installed fusedqkv can
neither shadow nor serve them), and ``main.py``, whose ``run`` takes the definition's inputs
then its outputs (destination passing). Benchmark-only code (``bench/``, the L2 flush
kernel, unreferenced kernels) stays out. The solution's digest is over the shipped sources.

The export refuses (``ExportError``, at export time) a shipped module that refers to the
installed package -- an absolute ``fusedqkv`` import, a dynamic import (``importlib``:
the closure cannot follow it), a string naming ``fusedqkv.<module>`` -- or imports
anything but the standard library, torch and triton.

``check_solution`` runs the exported sources in a subprocess in which ``import fusedqkv``
raises (a meta-path finder), as NVIDIA's evaluator would on a machine without fusedqkv.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import problem, records

PKG = "fusedqkv_sol"
ENTRY_FILE = "main.py"
ENTRY_FN = "run"
# the module (relative to the package root) that defines the function main.py calls
ENTRY_MODULE = "ops.backward_091"
ENTRY_FUNCTION = "gqa_qkv_rope_qk_norm_backward"
# the package's subpackages a shipped module may import from (bench/ & co. are benchmark-only)
SHIPPABLE = ("kernels", "ops")
ALLOWED_THIRD_PARTY = ("torch", "triton")
# calls that import by a runtime value: the closure cannot follow them
DYNAMIC_IMPORTS = ("import_module", "__import__", "find_spec", "spec_from_file_location", "spec_from_loader",
                   "module_from_spec", "load_module", "exec_module", "run_module", "run_path")
# a string naming the installed package or one of its modules ("fusedqkv", "fusedqkv.kernels...")
_INSTALLED_REF = re.compile(r"(?<![\w.])fusedqkv(?=\.|$)")
ISOLATION_RUNNER = Path(__file__).with_name("isolated_run.py")


class ExportError(Exception):
    """The package cannot be exported as a self-contained solution; the message lists why."""


# ----------------------------------------------------------------------------- the closure


def _module_file(root: Path, parts: tuple) -> Optional[Path]:
    if not parts:
        return None
    f = root.joinpath(*parts).with_suffix(".py")
    if f.is_file():
        return f
    f = root.joinpath(*parts, "__init__.py")
    return f if f.is_file() else None


def _is_package(root: Path, parts: tuple) -> bool:
    return bool(parts) and root.joinpath(*parts, "__init__.py").is_file()


def module_closure(root: Optional[Path] = None, entry: str = ENTRY_MODULE) -> dict:
    """The modules importing ``entry`` runs: relative path (``ops/launch.py``) -> source text,
    sorted by path. Follows every relative import of every reached module, and adds each
    reached module's parent packages (their ``__init__`` runs first). Raises ExportError for
    a relative import that cannot be resolved, one that reaches outside SHIPPABLE, or one
    that takes a name from the package root (the export replaces the root ``__init__``)."""
    root = Path(root) if root is not None else records.package_root()
    problems: list = []
    found: dict = {}
    todo = [tuple(entry.split("."))]
    while todo:
        parts = todo.pop()
        if parts in found:
            continue
        f = _module_file(root, parts)
        dotted = ".".join(parts)
        if f is None:
            problems.append(f"module {dotted!r} (imported by the entry's closure) has no file under {root}")
            continue
        if parts[0] not in SHIPPABLE:
            problems.append(f"{dotted!r} is imported by the entry's closure but is outside "
                            f"{', '.join(p + '/' for p in SHIPPABLE)} (benchmark-only or training code)")
            continue
        rel = f.relative_to(root).as_posix()
        found[parts] = (rel, f.read_text())
        todo.extend(parts[:i] for i in range(1, len(parts)))
        try:
            tree = ast.parse(found[parts][1], filename=rel)
        except SyntaxError as e:
            problems.append(f"{rel}:{e.lineno}: cannot be parsed ({e.msg})")
            continue
        pkg = parts if f.name == "__init__.py" else parts[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            up = node.level - 1
            if up > len(pkg):
                problems.append(f"{rel}:{node.lineno}: relative import beyond the package root")
                continue
            base = pkg[:len(pkg) - up]
            target = base + (tuple(node.module.split(".")) if node.module else ())
            names = [a.name for a in node.names if a.name != "*"]
            if target:
                todo.append(target)
            if not target or _is_package(root, target):
                for n in names:
                    if _module_file(root, target + (n,)) is not None:
                        todo.append(target + (n,))
                    elif not target:
                        problems.append(f"{rel}:{node.lineno}: imports {n!r} from the package root, "
                                        f"which the export replaces (import it from its module)")
    if problems:
        raise ExportError("\n".join(problems))
    return dict(sorted(found.values()))


def _doc_strings(tree) -> set:
    """ids of the string constants that are statements (docstrings and other bare strings)."""
    return {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}


def _call_name(func) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def self_containment_problems(rel: str, text: str, own: tuple = ()) -> list:
    """Why a shipped module is not self-contained: absolute imports of anything but the
    standard library, torch, triton (and ``own``, the shipped package's name, for main.py);
    dynamic imports; strings that name the installed package. Docstrings are documentation."""
    allowed = set(sys.stdlib_module_names) | set(ALLOWED_THIRD_PARTY) | {"__future__"} | set(own)
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as e:
        return [f"{rel}:{e.lineno}: cannot be parsed ({e.msg})"]
    docs = _doc_strings(tree)
    out = []
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mods = [node.module or ""]
        for m in mods:
            top = m.split(".")[0]
            if top == "fusedqkv":
                out.append(f"{rel}:{node.lineno}: imports the installed package ({m!r}); use a relative import")
            elif top not in allowed:
                out.append(f"{rel}:{node.lineno}: imports {m!r}; a solution may import only itself, "
                           f"{', '.join(ALLOWED_THIRD_PARTY)} and the standard library")
        if isinstance(node, ast.Call) and _call_name(node.func) in DYNAMIC_IMPORTS:
            out.append(f"{rel}:{node.lineno}: dynamic import ({_call_name(node.func)}): the export cannot "
                       f"follow it; use a static relative import")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and _INSTALLED_REF.search(node.value)):
            out.append(f"{rel}:{node.lineno}: string {node.value!r} names the installed package")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def _entry_defined(text: str, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(text).body)


def shipped_modules(root: Optional[Path] = None, entry: str = ENTRY_MODULE,
                    entry_function: Optional[str] = ENTRY_FUNCTION) -> dict:
    """The package's modules the solution ships (relative path -> text), checked: ExportError
    if one is not self-contained or the entry module lacks the entry function."""
    mods = module_closure(root, entry)
    problems = []
    for rel, text in mods.items():
        problems += self_containment_problems(rel, text)
    entry_rel = entry.replace(".", "/") + ".py"
    if entry_function and entry_rel in mods and not _entry_defined(mods[entry_rel], entry_function):
        problems.append(f"{entry_rel}: does not define {entry_function} at module level")
    if problems:
        raise ExportError("\n".join(problems))
    return mods


def shipped_digest_sources(root: Optional[Path] = None) -> dict:
    """relative path -> sha256 of each module the solution ships (what the bench records digest)."""
    return {rel: records.sha256_text(text) for rel, text in shipped_modules(root).items()}


# ----------------------------------------------------------------------------- solution.json


def _main_source(defn) -> str:
    ins, outs = list(defn.inputs), list(defn.outputs)
    params = ",\n    ".join(ins + outs)
    return f'''"""fusedqkv solution for SOL-ExecBench {defn.name} (destination passing)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the evaluator puts this folder on sys.path; a loader by file path may not
    sys.path.insert(0, _HERE)

from {PKG}.{ENTRY_MODULE} import {ENTRY_FUNCTION}  # noqa: E402


def {ENTRY_FN}(
    {params},
):
    {ENTRY_FUNCTION}(
        {", ".join(ins)},
        out=({", ".join(outs)},),
    )
'''


def build_solution(name: Optional[str] = None, author: str = "fusedqkv",
                   definition: str = problem.DEFAULT_DEFINITION, root: Optional[Path] = None,
                   modules: Optional[dict] = None) -> dict:
    """The solution dict; ExportError if the package cannot be shipped self-contained.
    ``modules``: ``shipped_modules(root)`` where the caller already has them."""
    defn = problem.load_definition(definition)
    sources = [{"path": f"{PKG}/__init__.py",
                "content": '"""fusedqkv kernels and launchers (the solution\'s copy; imports only itself, '
                           'torch and triton)."""\n'}]
    for rel, content in (shipped_modules(root) if modules is None else modules).items():
        sources.append({"path": f"{PKG}/{rel}", "content": content if content.strip() else "# (empty module)\n"})
    main = _main_source(defn)
    problems = self_containment_problems(ENTRY_FILE, main, own=(PKG,))
    if problems:  # (the template itself)
        raise ExportError("\n".join(problems))
    sources.append({"path": ENTRY_FILE, "content": main})
    digest = records.digest({s["path"]: records.sha256_text(s["content"]) for s in sources})
    from .. import __version__

    return {
        "name": name or f"fusedqkv_triton_{defn.name[:3]}_v{__version__}_{digest[7:15]}",
        "definition": defn.name,
        "description": ("fusedqkv: one Triton kernel for the RoPE + QK-norm backward (reproducing the "
                        "reference's bf16 rounding points) writing dQKV, then dX = dQKV.W and "
                        "dW = dQKV^T.X (Triton kernels chained behind it at few tokens, else cuBLAS); "
                        f"deterministic dW/dnorm partials. Sources digest {digest}."),
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


def sources_digest(sol: dict) -> str:
    """The digest of a solution's sources (as in its name)."""
    return records.digest({s["path"]: records.sha256_text(s["content"]) for s in sol["sources"]})


def write_solution(path, **kw) -> dict:
    sol = build_solution(**kw)
    Path(path).write_text(json.dumps(sol, indent=1))
    return sol


def materialize(sol: dict, folder) -> Path:
    """Write the sources under folder (as the official packager does); returns the entry file."""
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
    """Materialise and import the entry point in this process; returns the callable.
    (In-process: fusedqkv stays importable here; ``check_solution`` is the isolated run.)"""
    entry = materialize(sol, folder)
    fn_name = sol["spec"]["entry_point"].split("::")[1]
    mod_name = f"_fusedqkv_solution_{abs(hash(str(folder)))}"
    for k in [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]:
        del sys.modules[k]
    spec = importlib.util.spec_from_file_location(mod_name, entry)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, fn_name)


# ----------------------------------------------------------------------------- isolated check


class IsolationError(Exception):
    """The isolated subprocess did not produce results (crash, timeout)."""


def _env_without_package(device_type: str) -> dict:
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "fusedqkv" / "__init__.py").is_file()]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    if not keep:
        env.pop("PYTHONPATH")
    if device_type == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the package's Triton path on CPU tensors
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_isolated(sol: dict, cases: list, device_type: str = "cpu", timeout: float = 900) -> dict:
    """Run ``cases`` against the exported sources in a subprocess where ``import fusedqkv``
    raises. A case: {"mode": "entry" | "package", "args": [...], "outs": [(shape, dtype)],
    "backend": None | "triton" | "torch"}. Returns the runner's report: "blocked" (the
    blocker was active), "cases" (per case: "error" or "outputs"), "loaded" (shipped modules
    imported), "installed_loaded" (fusedqkv modules in sys.modules: must be [])."""
    import torch

    with tempfile.TemporaryDirectory(prefix="fusedqkv_isolation_") as tmp:
        tmp = Path(tmp)
        stage = tmp / "solution"
        materialize(sol, stage)
        job = {"pkg": PKG, "entry_point": sol["spec"]["entry_point"], "entry_module": ENTRY_MODULE,
               "entry_function": ENTRY_FUNCTION, "cases": cases}
        torch.save(job, tmp / "job.pt")
        runner = tmp / "isolated_run.py"
        runner.write_text(ISOLATION_RUNNER.read_text())
        try:
            r = subprocess.run([sys.executable, str(runner), str(stage), str(tmp / "job.pt"), str(tmp / "report.pt")],
                               cwd=stage, env=_env_without_package(device_type), capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise IsolationError(f"the isolated run took over {timeout:.0f} s") from None
        if r.returncode != 0 or not (tmp / "report.pt").is_file():
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
            raise IsolationError(f"the isolated run exited with {r.returncode}:\n{tail}")
        return torch.load(tmp / "report.pt", weights_only=True)


def check_solution(sol: dict, device="cpu", max_tokens: int = 4, workloads=(2, 13), triton_tokens: int = 4,
                   triton_workload: int = 13, timeout: float = 900) -> list:
    """Run the exported solution in isolation (``run_isolated``) against the reference.

    On a CPU: the entry point (DPS, torch path) on ``workloads`` cut to ``max_tokens``, and
    the shipped package's Triton path (``backend="triton"``, TRITON_INTERPRET=1) on
    ``triton_workload`` cut to ``triton_tokens``. On CUDA: the entry point on the full
    ``workloads``. Returns one dict per case: workload, path, passed, checks, error,
    returned_none, shipped modules loaded.
    """
    import torch

    dev = torch.device(device)
    cpu = dev.type == "cpu"
    defn = problem.load_definition(sol["definition"])
    ref, ref_label = problem.reference_impl(defn.name)
    plan = [(i, "entry", None) for i in workloads]
    if cpu and triton_tokens:
        plan.append((triton_workload, "package", "triton"))
    cases, meta = [], []
    for i, mode, backend in plan:
        w = defn.workload(i)
        if cpu:
            w = problem.reduced_workload(w, triton_tokens if mode == "package" else max_tokens)
        args = list(problem.generate_inputs(defn, w, device=dev, seed=w.index).values())
        with torch.no_grad():
            expect = tuple(ref(*args))
        cases.append({"mode": mode, "backend": backend, "args": args,
                      "outs": [(tuple(t.shape), t.dtype) for t in expect]})
        path = ("entry point " + ("(torch path on CPU)" if cpu else "(Triton + cuBLAS)") if mode == "entry"
                else f"{PKG}.{ENTRY_MODULE}.{ENTRY_FUNCTION}(backend='triton'), TRITON_INTERPRET=1")
        meta.append((w, path, expect))
    report = run_isolated(sol, cases, dev.type, timeout)
    results = []
    for (w, path, expect), got in zip(meta, report["cases"]):
        res = {"workload": w.name, "tokens": w.tokens, "path": path, "reference": ref_label,
               "blocked_fusedqkv": report["blocked"], "installed_loaded": report["installed_loaded"],
               "shipped_loaded": got.get("loaded", []), "returned_none": got.get("returned_none")}
        if got.get("error"):
            res.update(passed=False, error=got["error"], checks=[])
        else:
            checks = problem.check_outputs(list(defn.outputs), got["outputs"], expect, w)
            res["checks"] = [c.to_json() for c in checks]
            res["passed"] = all(c.passed for c in checks)
            if path.startswith(PKG) and not any(m.startswith(f"{PKG}.kernels.") for m in res["shipped_loaded"]):
                res.update(passed=False, error="the Triton path loaded no shipped kernel module")
        if not report["blocked"] or report["installed_loaded"]:
            res.update(passed=False, error=res.get("error") or
                       f"not isolated: blocker active {report['blocked']}, fusedqkv modules loaded "
                       f"{report['installed_loaded']}")
        results.append(res)
    return results


def describe_failure(res: dict) -> str:
    """One line on why an isolated case failed."""
    if res.get("error"):
        return res["error"].strip().splitlines()[-1][:300]
    bad = [c for c in res["checks"] if not c["passed"]]
    return "; ".join(f"{c['name']}: {c['reason']} (max abs err {c['max_abs_err']:.3g})"
                     if math.isfinite(c["max_abs_err"]) else f"{c['name']}: {c['reason']}" for c in bad)
