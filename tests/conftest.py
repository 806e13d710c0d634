import inspect
import os
import textwrap

# Triton kernels run on the CPU through the interpreter; must be set before triton
# decorates any kernel (i.e. before fusedqkv.kernels is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning, module="triton")

# Triton 3.6-3.9's interpreter, at every call of a @jit function (each launch, and again at each
# call of a @jit helper inside it), wraps the builtins of triton.language, finding them with
# inspect.getmembers over the whole package: a quarter of the interpreter's time in this suite.
# The builtins of a package are fixed at import, so the same wrapping with each package's builtin
# names listed once does the same. Only where _patch_builtin is exactly that function.
_PATCH_BUILTIN = '''
def _patch_builtin(pkg, builder, scope: _LangPatchScope):
    for name, member in inspect.getmembers(pkg):
        if tl.core.is_builtin(member):
            _patch_attr(pkg, name, member, builder, scope)
'''


def _list_builtins_once():
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no Triton: the torch backends only
        return
    fn = getattr(interpreter, "_patch_builtin", None)
    try:
        same = fn is not None and textwrap.dedent(inspect.getsource(fn)).strip() == _PATCH_BUILTIN.strip()
    except (OSError, TypeError):
        same = False
    if not same:
        return
    names = {}

    def builtin_names(pkg):
        if pkg not in names:  # listed while unwrapped: the first call wraps, nested calls find wrappers
            names[pkg] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        return names[pkg]

    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        builtin_names(pkg)

    def _patch_builtin(pkg, builder, scope):
        for name in builtin_names(pkg):
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


if os.environ["TRITON_INTERPRET"] == "1":
    _list_builtins_once()


# --------------------------------------------------------------------------- GEMM budget
# The official reference's GEMMs are tallied wherever it runs (the tests' oracle, the bench's
# eager baseline: both load it through problem.load_official_reference); the session fails when
# its half-precision NN FLOPs exceed _gemm_audit.ORACLE_NN_BUDGET, whatever the host.
# FUSEDQKV_GEMM_AUDIT=FILE also tallies every test's CPU GEMMs and writes them to FILE (JSON).

import json  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import _gemm_audit  # noqa: E402  (the tests' folder is on sys.path: pytest puts a conftest's there)
from fusedqkv.bench import problem as _problem  # noqa: E402

_load_official_reference = _problem.load_official_reference


def _counted_official_reference(*args, **kwargs):
    run = _load_official_reference(*args, **kwargs)
    return None if run is None else _gemm_audit.counted_oracle(run)


_problem.load_official_reference = _counted_official_reference
_AUDIT_FILE = os.environ.get("FUSEDQKV_GEMM_AUDIT")
_AUDIT: dict = {}


if _AUDIT_FILE:
    @pytest.fixture(autouse=True)
    def _gemm_audit_per_test(request):
        tally = _gemm_audit.Tally()
        with _gemm_audit.GemmCounter(tally=tally):
            yield
        if tally.flops:
            _AUDIT[request.node.nodeid] = tally


def pytest_terminal_summary(terminalreporter):
    o = _gemm_audit.ORACLE
    tr = terminalreporter
    tr.write_line(f"official reference GEMMs: {o.half('NN') / 1e9:.3f} GFLOP half-precision NN (budget "
                  f"{_gemm_audit.ORACLE_NN_BUDGET / 1e9:.1f}), {o.half() / 1e9:.3f} GFLOP half-precision in all, "
                  f"~{o.predicted_s():.0f} s on an AVX2-only CPU")
    if _AUDIT_FILE:
        total = _gemm_audit.Tally()
        for t in _AUDIT.values():
            total.merge(t)
        rows = {k: dict(predicted_s=t.predicted_s(), half_gflop=t.half() / 1e9, rows=t.rows())
                for k, t in sorted(_AUDIT.items(), key=lambda kv: -kv[1].predicted_s())}
        with open(_AUDIT_FILE, "w") as f:
            json.dump(dict(total=dict(predicted_s=total.predicted_s(), rows=total.rows()),
                           oracle=dict(predicted_s=o.predicted_s(), rows=o.rows()), tests=rows), f, indent=1)
        tr.write_line(f"GEMM audit: {total.half() / 1e9:.3f} GFLOP half-precision over the suite, "
                      f"~{total.predicted_s():.0f} s on an AVX2-only CPU; per test in {_AUDIT_FILE}")


def pytest_sessionfinish(session, exitstatus):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # a pytest-xdist worker: the controller adds up every worker's oracle GEMMs
        o = _gemm_audit.ORACLE
        out["oracle_gemms"] = [(str(dt).replace("torch.", ""), la, f, o.calls[(dt, la)]) for (dt, la), f in o.flops.items()]
        return
    why = _gemm_audit.check_oracle_budget()
    if why:
        print(f"\nFAILED (GEMM budget): {why}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's oracle GEMMs join the session's tally (the budget is the
    whole suite's)."""
    import torch

    for dt, la, flops, calls in getattr(node, "workeroutput", {}).get("oracle_gemms", []):
        key = (getattr(torch, dt), la)
        _gemm_audit.ORACLE.flops[key] += flops
        _gemm_audit.ORACLE.calls[key] += calls


# --------------------------------------------------------------------------- workers (pytest-xdist)
# The README's test command runs files on every core (``-n auto --dist loadfile``). Tests marked
# ``serial`` time the CPU (the bench's CPU runs and their noise flags): each runs alone, the other
# workers waiting between their tests -- a readers-writer lock over the whole test (module fixtures'
# setup included), on two files: a test takes ``gate`` then ``run`` shared, a serial one both
# exclusive (``gate`` first, so that a waiting serial test lets no new test start).
#
# Threads: each worker's torch, and the processes its tests start (OMP_NUM_THREADS), take an equal share
# of the cores; a serial test, alone, takes every thread back. Two workers of two OpenMP threads each on
# two cores spin against each other in OpenMP's barriers: the torch-heavy files took 2.3x the CPU time
# and the wall clock of one thread each (NOTES, session 20). Where OMP_NUM_THREADS is set, it is kept.
_THREADS: dict = {}


def _set_threads(torch_threads, omp):
    import torch

    torch.set_num_threads(torch_threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if os.environ.get("PYTEST_XDIST_WORKER") is None or workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // int(workers))
    _THREADS.update(all=(torch.get_num_threads(), None), share=(share, str(share)))
    _set_threads(*_THREADS["share"])


def pytest_collection_modifyitems(config, items):
    # the longest files first, so that no worker ends on one alone (the offline compiles, 091's
    # interpreter cases); the same order on every worker, as xdist requires
    first = ("tests/test_gpu_targets.py", "tests/test_091_backward.py", "tests/test_properties.py")
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(first)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:  # one process: nothing runs beside a test
        yield
        return
    import fcntl
    import tempfile

    base = os.path.join(tempfile.gettempdir(), f"fusedqkv-tests-{uid}")
    serial = item.get_closest_marker("serial") is not None
    mode = fcntl.LOCK_EX if serial else fcntl.LOCK_SH
    with open(base + ".gate", "a") as gate, open(base + ".run", "a") as run:
        fcntl.flock(gate, mode)
        fcntl.flock(run, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        if serial and _THREADS:
            _set_threads(*_THREADS["all"])
        try:
            yield
        finally:
            if serial and _THREADS:
                _set_threads(*_THREADS["share"])
            fcntl.flock(run, fcntl.LOCK_UN)
