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


# The same interpreter patches the language again at every call of a @jit helper inside a launch (15
# thousand calls in two of 091's cases: ~13 % of their time), with the same stateless wrappers the launch's
# own call already put in place, into a scope nobody restores (the launch's scope restores the originals).
# Inside a launch, a helper whose language modules are patched already (by the launch, or by an earlier
# helper: triton.language.standard's see tl.core) is left as it is: the same state.
_PATCH_LANG = '''
def _patch_lang(fn):
    scope = _LangPatchScope()
    langs = [value for _, value in fn.__globals__.items() if inspect.ismodule(value) and value in [tl, tl.core]]
    assert len(langs) >= 1, "triton.language must be visible from within jit'd function"
    for lang in langs:
        _patch_builtin(lang, interpreter_builder, scope)
        _patch_builtin(lang.tensor, interpreter_builder, scope)
        if lang == tl:
            _patch_builtin(lang.math, interpreter_builder, scope)
        _patch_lang_tensor(lang.tensor, scope)
        _patch_lang_core(lang, scope)
    _patch_builtin(tl.core.tensor_descriptor_base, interpreter_builder, scope)
    return scope
'''

# ... and builds its 19-entry dtype table (hashing every key) at each of ~10^5 calls: built once here
_GET_NP_DTYPE = '''
def _get_np_dtype(tt_dtype):
    if isinstance(tt_dtype, tl.pointer_type):
        return np.dtype(np.uint64)
    np_types = {
        tl.int1: np.dtype(bool),
        tl.float16: np.dtype(np.float16),
        tl.float32: np.dtype(np.float32),
        tl.float64: np.dtype(np.float64),
        tl.int8: np.dtype(np.int8),
        tl.uint8: np.dtype(np.uint8),
        tl.int16: np.dtype(np.int16),
        tl.uint16: np.dtype(np.uint16),
        tl.int32: np.dtype(np.int32),
        tl.uint32: np.dtype(np.uint32),
        tl.int64: np.dtype(np.int64),
        tl.uint64: np.dtype(np.uint64),
        # bfloat16 types are stored as uint16
        tl.bfloat16: np.dtype(np.uint16),
        # float8 types are stored as uint8
        tl.float8e5: np.dtype(np.uint8),
        tl.float8e5b16: np.dtype(np.uint8),
        tl.float8e4nv: np.dtype(np.uint8),
        tl.float8e4b8: np.dtype(np.uint8),
        tl.float8e4b15: np.dtype(np.uint8),
    }
    if isinstance(tt_dtype, tl.block_type):
        if isinstance(tt_dtype.element_ty, tl.pointer_type):
            return np.dtype(np.uint64)
        return np_types[tt_dtype.element_ty]
    return np_types[tt_dtype]
'''


def _same_source(fn, text) -> bool:
    try:
        return fn is not None and textwrap.dedent(inspect.getsource(fn)).strip() == text.strip()
    except (OSError, TypeError):
        return False


def _patch_lang_once_per_launch():
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    original = getattr(interpreter, "_patch_lang", None)
    if grid_call is None or not _same_source(original, _PATCH_LANG):
        return
    # None: outside a launch; "start": the launch's own call comes next; a frozenset: the ids of the
    # language modules the launch patched
    state = {"launch": None}
    langs_of: dict = {}

    def langs(fn):
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in [tl, tl.core])
        return langs_of[fn]

    def _patch_lang(fn):
        patched = state["launch"]
        if isinstance(patched, frozenset) and langs(fn) and langs(fn) <= patched:
            return interpreter._LangPatchScope()
        scope = original(fn)
        if patched == "start":
            state["launch"] = langs(fn)
        elif isinstance(patched, frozenset):  # e.g. triton.language.standard's helpers (tl.core): patched now
            state["launch"] = patched | langs(fn)
        return scope

    def __call__(self, *args, **kwargs):
        outer = state["launch"]
        state["launch"] = "start"
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["launch"] = outer

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__


def _np_dtype_table_once():
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    if not _same_source(getattr(interpreter, "_get_np_dtype", None), _GET_NP_DTYPE):
        return
    table = {tl.int1: np.dtype(bool), tl.float16: np.dtype(np.float16), tl.float32: np.dtype(np.float32),
             tl.float64: np.dtype(np.float64), tl.int8: np.dtype(np.int8), tl.uint8: np.dtype(np.uint8),
             tl.int16: np.dtype(np.int16), tl.uint16: np.dtype(np.uint16), tl.int32: np.dtype(np.int32),
             tl.uint32: np.dtype(np.uint32), tl.int64: np.dtype(np.int64), tl.uint64: np.dtype(np.uint64),
             tl.bfloat16: np.dtype(np.uint16), tl.float8e5: np.dtype(np.uint8), tl.float8e5b16: np.dtype(np.uint8),
             tl.float8e4nv: np.dtype(np.uint8), tl.float8e4b8: np.dtype(np.uint8), tl.float8e4b15: np.dtype(np.uint8)}
    pointer = np.dtype(np.uint64)

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return pointer
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    interpreter._get_np_dtype = _get_np_dtype


if os.environ["TRITON_INTERPRET"] == "1":
    _list_builtins_once()
    _patch_lang_once_per_launch()
    _np_dtype_table_once()


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
        out["oracle_gemms"] = _gemm_audit.ORACLE.rows()
        if _AUDIT_FILE:  # and writes the per-test table from every worker's
            out["audit_gemms"] = {k: t.rows() for k, t in _AUDIT.items()}
        return
    why = _gemm_audit.check_oracle_budget()
    if why:
        print(f"\nFAILED (GEMM budget): {why}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's oracle GEMMs join the session's tally (the budget is the
    whole suite's)."""
    out = getattr(node, "workeroutput", {})
    _gemm_audit.ORACLE.add_rows(out.get("oracle_gemms", []))
    for nodeid, rows in out.get("audit_gemms", {}).items():
        _AUDIT.setdefault(nodeid, _gemm_audit.Tally()).add_rows(rows)


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
    # pytest-xdist >= 3.7 hands files out by their number of tests, most first (``--loadscope-reorder``, on by
    # default), not in the order pytest_collection_modifyitems below sets: the controller keeps that order
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if os.environ.get("PYTEST_XDIST_WORKER") is None or workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // int(workers))
    _THREADS.update(all=(torch.get_num_threads(), None), share=(share, str(share)))
    _set_threads(*_THREADS["share"])


# pytest-xdist hands out whole files in this order (--dist loadfile): the longest first, so that no worker ends
# on a long one alone -- by CPU seconds in session 23's suite (threads shared; NOTES): the offline compiles ~105
# with a warm Triton cache and ~440 cold, then 091's interpreter cases ~57, the FP8 casts ~55, ... -- then the
# others in collection order. Files with `serial` tests go last: a serial test waits for every running test to
# end, and behind the offline compiles' setup (one test, minutes) the other worker would idle all that time.
LONGEST_FIRST = ("tests/test_gpu_targets.py", "tests/test_091_backward.py", "tests/test_fp8.py",
                 "tests/test_hf_families.py", "tests/test_properties.py", "tests/test_bench_solution.py",
                 "tests/test_block_variants.py", "tests/distributed/test_dist_gloo.py", "tests/test_hf_peft.py",
                 "tests/test_fast_path_gate.py", "tests/test_bench_cli.py", "tests/test_bench_floor_script.py",
                 "tests/test_hf_bench_script.py", "tests/test_unusual_inputs.py", "tests/test_determinism.py",
                 "tests/test_bench_families_script.py", "tests/test_forward_autograd.py")


def pytest_collection_modifyitems(config, items):
    # the same order on every worker, as xdist requires (a stable sort: each file's tests keep theirs)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    serial = {it.nodeid.split("::")[0] for it in items if it.get_closest_marker("serial") is not None}

    def key(it):
        name = it.nodeid.split("::")[0]
        return name in serial, rank.get(name, len(LONGEST_FIRST))

    items.sort(key=key)


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

