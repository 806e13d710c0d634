"""transformers is optional: `from fusedqkv import UnsupportedModelError` needs none, and apply_to
without it says how to install it from a clone."""

import ast
import runpy
import sys
from pathlib import Path

import pytest
from torch import nn

import fusedqkv

SRC = Path(__file__).resolve().parents[1] / "src" / "fusedqkv"


def _module_level_imports(path: Path) -> list:
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


def test_unsupported_model_error_is_exported_without_transformers(monkeypatch):
    from fusedqkv import UnsupportedModelError
    from fusedqkv.integrations import transformers as hf

    # one class: what apply_to raises is what users catch
    assert UnsupportedModelError is fusedqkv.errors.UnsupportedModelError is hf.UnsupportedModelError
    assert issubclass(UnsupportedModelError, ValueError) and "UnsupportedModelError" in fusedqkv.__all__
    # the package takes it from a module that imports nothing (not from integrations.transformers) ...
    assert "from .errors import UnsupportedModelError" in (SRC / "__init__.py").read_text()
    assert _module_level_imports(SRC / "errors.py") == ["__future__"]
    # ... and that module runs where transformers cannot be imported
    monkeypatch.setitem(sys.modules, "transformers", None)
    ns = runpy.run_path(str(SRC / "errors.py"))
    assert issubclass(ns["UnsupportedModelError"], ValueError)


def test_apply_to_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    with pytest.raises(fusedqkv.UnsupportedModelError,
                       match=r"transformers is not imported; from the clone: pip install -e '\.\[transformers\]'"):
        fusedqkv.apply_to(nn.Linear(2, 2))
