"""Other Tritons than the installed one, importable side by side (used by test_fast_path_gate and
test_gpu_targets): a release's wheel fetched from the package index (``pip download``) and cached
unpacked under ``$XDG_CACHE_HOME/fusedqkv`` or ``~/.cache/fusedqkv``; a child process puts
``triton_path(version)`` first on its PYTHONPATH."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

# unused offline (the probe, offline compiles), and a sixth of the unpacked size: Triton's profiling libraries
SKIPPED_MEMBERS = ("triton/backends/nvidia/lib/cupti/",)


def _installed() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.replace("+", ".").split("."))


INSTALLED = _installed()


def _cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fusedqkv" / "tritons"


def _download(version: str, wheels: Path) -> Path:
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    found = sorted(wheels.glob(f"triton-{version}-{tag}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"triton=={version}",
           "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob(f"triton-{version}-{tag}-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.fail(f"cannot download triton=={version} for this Python ({' '.join(cmd)}: exit {proc.returncode}):\n"
                    f"{(proc.stdout + proc.stderr)[-2000:]}\nThis test needs Triton {version}: the package "
                    f"index (CI has the mirror), or the wheel in {wheels}.", pytrace=False)
    return found[0]


def _unpack(wheel: Path, dest: Path) -> None:
    """The wheel unpacked at ``dest`` (atomically: a half-unpacked Triton is never used)."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + ".part-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.filename.startswith(SKIPPED_MEMBERS):
                    continue
                path = z.extract(info, tmp)
                mode = info.external_attr >> 16
                if mode & 0o111:  # ptxas and friends stay executable
                    os.chmod(path, (mode & 0o777) | 0o600)
        try:
            os.rename(tmp, dest)
        except OSError:  # another run unpacked it meanwhile
            if not (dest / "triton" / "__init__.py").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def triton_path(version: str) -> Path | None:
    """A directory to put first on PYTHONPATH to import Triton ``version`` (None: the installed)."""
    if version == INSTALLED:
        return None
    cache = _cache()
    dest = cache / f"triton-{version}-cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    if not (dest / "triton" / "__init__.py").exists():
        wheels = cache / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        wheel = _download(version, wheels)
        _unpack(wheel, dest)
        wheel.unlink(missing_ok=True)  # the unpacked copy is the cache
    return dest
