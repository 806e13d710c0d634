"""The README says what works: its quick starts run, its `fusedqkv bench` option list is the CLI's,
its install lines work from a clone (fusedqkv is not on PyPI), and benchmarks/README.md names every
benchmark script."""

import re
from pathlib import Path

import pytest
import torch

from fusedqkv import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _bench_parser():
    sub = next(a for a in cli._parser()._actions if a.dest == "cmd")
    return sub.choices["bench"]


def _documented_bench_options() -> dict:
    """{flag: spec} from the README's list under 'Options of `fusedqkv bench`': each item's
    backticked specs before ' -- ', e.g. `--device auto|cpu|cuda`, `--out DIR`, `--quick`."""
    lines = README.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Options of `fusedqkv bench`"))
    items = []
    for ln in lines[start + 1:]:
        if ln.startswith("- `--"):
            items.append(ln)
        elif items and not ln.strip():
            break
    assert items, "the README's bench option list is empty"
    specs = {}
    for item in items:
        head = item[2:].split(" -- ")[0]
        for spec in re.findall(r"`(--[^`]+)`", head):
            flag, _, arg = spec.partition(" ")
            assert flag not in specs, f"{flag} listed twice"
            specs[flag] = arg
    return specs


def test_readme_bench_options_are_the_clis():
    documented = _documented_bench_options()
    actions = {s: a for a in _bench_parser()._actions for s in a.option_strings if s not in ("-h", "--help")}
    assert sorted(documented) == sorted(actions), "README's `fusedqkv bench` options differ from the CLI's"
    for flag, arg in documented.items():
        a = actions[flag]
        takes_value = a.nargs != 0
        assert bool(arg) == takes_value, f"{flag}: README gives {arg!r}; the CLI's takes a value: {takes_value}"
        if a.choices is not None:
            assert sorted(arg.split("|")) == sorted(a.choices), f"{flag}: README {arg}, CLI {a.choices}"


def _texts():
    """The README, the examples, the benchmarks and the package's sources: where install lines are."""
    paths = [README, *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "src").rglob("*.py"))]
    return [(p, p.read_text()) for p in paths]


def test_install_lines_work_from_a_clone():
    """`pip install 'fusedqkv[transformers]'` fails (not on PyPI): every install of fusedqkv and its
    extras is `pip install -e '.[extra]'` (or `-e .`), with extras pyproject.toml declares."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^(\w[\w-]*)\s*=", section, re.M))
    assert "transformers" in extras
    seen = 0
    for path, text in _texts():
        for m in re.finditer(r"pip install[^\n`\"]*", text):
            line = m.group(0)
            assert not re.search(r"pip install\s+(-U\s+|--upgrade\s+)?['\"]?fusedqkv\b", line), f"{path}: {line}"
            for extra_list in re.findall(r"-e\s+'?\.\[([^\]]+)\]", line):
                seen += 1
                assert set(extra_list.split(",")) <= extras, f"{path}: {line}: extras {extras}"
    assert seen >= 3  # the README's, the example's and apply_to's error message


def test_benchmarks_readme_names_every_script():
    """benchmarks/README.md gives a command for each script there, and names no removed one."""
    bench = ROOT / "benchmarks"
    text = (bench / "README.md").read_text()
    scripts = {p.name for p in bench.iterdir() if p.suffix in (".py", ".sh")}
    named = set(re.findall(r"`([\w-]+\.(?:py|sh))`", text))
    assert scripts <= named, f"not in benchmarks/README.md: {sorted(scripts - named)}"
    assert named <= scripts, f"benchmarks/README.md names missing scripts: {sorted(named - scripts)}"
    for name in scripts:
        # each script's one-line command (the helpers sol_execbench_eval.py / gpu_robustness.py run
        # through their .sh; engine_thread.py is an option the host-time scripts import)
        helper = name in ("sol_execbench_eval.py", "gpu_robustness.py", "engine_thread.py")
        assert helper or f"benchmarks/{name}" in text, f"no command for {name}"


def _quick_start_blocks() -> list:
    """(subsection title, code) of every ```python block in the README's "## Quick start"."""
    section = README.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for part in re.split(r"^### ", section, flags=re.M)[1:]:
        title = part.splitlines()[0]
        blocks += [(title, code) for code in re.findall(r"^```python\n(.*?)^```", part, re.M | re.S)]
    return blocks


QUICK_STARTS = _quick_start_blocks()


def test_quick_starts_are_mostly_runnable():
    # a block that cannot run on the CPU says why on its first line ("# needs: ..."); the others run below
    runnable = [title for title, code in QUICK_STARTS if not code.startswith("# needs:")]
    assert len(runnable) >= 3, runnable
    assert {"Fine-tuning a Hugging Face model", "The block in your own model"} <= set(runnable)


@pytest.mark.parametrize("title, code", QUICK_STARTS, ids=[f"{i}-{t}" for i, (t, _) in enumerate(QUICK_STARTS)])
def test_quick_start_block_runs_on_the_cpu(title, code, tmp_path, monkeypatch):
    if code.startswith("# needs:"):
        pytest.skip(f"README quick start '{title}': {code.splitlines()[0][2:]}")
    if "transformers" in code:
        pytest.importorskip("transformers")  # the optional dependency (a test extra)
    monkeypatch.chdir(tmp_path)  # what a block writes (a checkpoint) stays in the test's folder
    torch.manual_seed(0)
    exec(compile(code, f"README.md, quick start '{title}'", "exec"), {"__name__": "__readme__"})
