"""The host layer's structure: no import circle among ``fusedqkv.ops`` modules (lazy imports
inside functions included), and the exported 091 solution ships only the 091 path."""

import ast
from pathlib import Path

import fusedqkv
from fusedqkv.bench import solution

OPS = Path(fusedqkv.__file__).parent / "ops"


def _ops_imports() -> dict:
    """module -> the ops modules it imports (every relative import, anywhere in the file)."""
    graph = {}
    for path in OPS.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
        graph[path.stem] = {d for d in deps if (OPS / f"{d}.py").exists() and d != path.stem}
    return graph


def test_no_import_circle_in_ops():
    graph = _ops_imports()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_exported_solution_ships_only_the_091_path():
    shipped = set(solution.module_closure())
    assert "ops/backward_091.py" in shipped
    # the training block's plans, its forward stage and its kernel stay out of the solution
    for training in ("ops/training_forward.py", "ops/training_backward.py", "ops/gqa_forward.py",
                     "kernels/rope_qk_norm_fwd.py"):
        assert training not in shipped, training
