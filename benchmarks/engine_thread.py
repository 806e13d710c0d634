"""Which thread runs a CUDA backward, as an option of the host-time benchmarks (NOTES, session 27).

torch's autograd engine hands every CUDA backward to a per-device thread; on the device hosts the
hand-off, and that thread running on a core whose caches hold none of the step's state, cost a
fused fwd+bwd more host time than all of fusedqkv's own work. ``--backward-on-caller`` sets
``torch.autograd.set_multithreading_enabled(False)`` (thread-local) on the thread that runs the
benchmark, so its backwards run there instead."""

from __future__ import annotations

FLAG = "--backward-on-caller"
HELP = ("torch.autograd.set_multithreading_enabled(False) on this (the calling) thread: the engine runs the CUDA "
        "backward here instead of handing it to its device thread (NOTES, session 27)")
LABEL = "backward on the calling thread"


def add_flag(parser) -> None:
    parser.add_argument(FLAG, action="store_true", help=HELP)


def apply(enabled: bool) -> None:
    if enabled:
        import torch

        torch.autograd.set_multithreading_enabled(False)
