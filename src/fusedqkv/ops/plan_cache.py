"""The plan cache every entry point keeps: plans by input signature, fronted by guards.

A call of a public entry point (1) checks its tensors against the guards of the plans it used
last (shapes, strides, dtypes, devices, in C++: ``TensorGuards``) and its scalars against
theirs; (2) on a miss, takes the full fingerprint (the same, in Python, plus each tensor's
16-byte alignment and the config) to the cache, and on a miss there validates the arguments
fully -- the clear errors come from the build -- and builds the plan; (3) runs the plan. A call
whose tensors differ from a plan's in anything the plan depends on never runs on it: guards and
fingerprint cover shapes, strides, dtypes and devices, and each plan's run checks the alignment
it was built for (raising :class:`Misaligned`, after which the caller takes the full key).

Every cache registers with :mod:`fusedqkv.ops.device`, which clears and describes them.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch

from . import config as _config
from . import device, host_gemm
from .internals import refuse_functorch_wrapped, tensor_guards


class Misaligned(Exception):
    """A call whose addresses are not aligned as its plan's were (the caller re-plans)."""


def _tensor_key(t) -> tuple:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested:
        return (type(t), id(t))  # not a plannable tensor: the build's validation names it
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.layout, t.data_ptr() % 16 == 0)


class PlanCache:
    """Plans by full fingerprint (LRU, ``capacity``), fronted by the guards of the ``recent``
    (plan, guards) pairs that were used last: a repeated call costs one guard check."""

    def __init__(self, name: str, build: Callable, capacity: int = 64, recent: int = 4):
        self.name, self.build = name, build
        self.capacity, self.n_recent = capacity, recent
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self.recent: list = []  # [(guards, scalars, plan)], most recent first
        self.builds = 0  # plans built
        self.misses = 0  # calls that missed the guards (the full key was taken)
        device.register_plan_cache(name, self)

    def clear(self) -> None:
        self.plans.clear()
        self.recent.clear()

    def info(self) -> dict:
        return dict(plans=len(self.plans), builds=self.builds, misses=self.misses)

    def last(self):
        """The plan the last call used (tests and benchmarks inspect it)."""
        return self.recent[0][2] if self.recent else None

    def lookup(self, tensors: Sequence[torch.Tensor], scalars: tuple, build_args: tuple):
        """The plan for these tensors (all ``torch.Tensor``) and scalars (hashable; the config is
        added here); ``build_args`` go to ``build`` on a miss."""
        cfg = _config.current()
        for entry in self.recent:
            g, sc, plan = entry
            if sc == scalars and plan.cfg is cfg and g is not None and g.check(*tensors):
                if entry is not self.recent[0]:
                    self.recent.remove(entry)
                    self.recent.insert(0, entry)
                return plan
        return self.full_lookup(tensors, scalars, build_args)

    def full_lookup(self, tensors, scalars, build_args, remember: bool = True):
        """The plan by full fingerprint (alignment included); ``remember=False`` for a call that
        an aligned plan refused (its guards would match the aligned plan's calls too)."""
        self.misses += 1
        refuse_functorch_wrapped(tensors)  # a transform's wrapper has no address to fingerprint
        cfg = _config.current()
        key = (scalars, cfg, tuple(map(_tensor_key, tensors)))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.build(*build_args, cfg=cfg)
            self.builds += 1
            self.plans[key] = plan
            if len(self.plans) > self.capacity:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        # guards are shapes/strides/dtypes/devices: the fast path checks the config by identity,
        # the plan's run the alignment it was built for
        if remember:
            self.recent.insert(0, (tensor_guards(tensors), scalars, plan))
            del self.recent[self.n_recent:]
        return plan


def as_matrix(t: torch.Tensor, rows: int, cols: int):
    """``t`` as a [rows, cols] view (no copy), or None when its strides do not allow one."""
    try:
        return t.view(rows, cols)
    except RuntimeError:
        return None


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` through ``torch.mm`` (the paths without a planned cuBLASLt call; on the CPU
    in fp32, :mod:`fusedqkv.ops.host_gemm`)."""
    if out.is_contiguous():
        host_gemm.mm(a, b, out=out.view(a.shape[0], b.shape[1]))
    else:  # a strided destination: cuBLAS writes contiguous memory
        out.copy_(host_gemm.mm(a, b).view(out.shape))
