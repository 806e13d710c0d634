import os

# Triton kernels run on the CPU through the interpreter; must be set before triton
# decorates any kernel (i.e. before fusedqkv.kernels is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning, module="triton")
