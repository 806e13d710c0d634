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
