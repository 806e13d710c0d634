"""Triton kernels only: no validation, no dispatch (see :mod:`fusedqkv.ops`)."""
