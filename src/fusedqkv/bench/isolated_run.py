"""Runs an exported solution with ``import fusedqkv`` blocked (a standalone script).

``python isolated_run.py <solution_dir> <job.pt> <report.pt>``: ``fusedqkv.bench.solution``
copies this file next to a job and runs it in a fresh interpreter. It imports nothing of
fusedqkv (it must not: the point is a process in which fusedqkv cannot be imported, as on
NVIDIA's evaluator machine); it loads the entry module the way the evaluator does
(solution folder first on ``sys.path``, ``importlib.import_module("main")``).
"""

import importlib
import importlib.abc
import math
import sys
import traceback

BLOCKED = "fusedqkv"


class BlockInstalledPackage(importlib.abc.MetaPathFinder):
    """Any import of fusedqkv or one of its modules raises."""

    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"isolation: {name!r} imported, but the exported solution must not use the "
                                      f"installed fusedqkv package", name=name)
        return None


def _blocked() -> bool:
    try:
        importlib.import_module(BLOCKED)
    except ModuleNotFoundError as e:
        return str(e).startswith("isolation:")
    return False


def main(folder: str, job_path: str, report_path: str) -> int:
    for k in [k for k in sys.modules if k == BLOCKED or k.startswith(BLOCKED + ".")]:
        del sys.modules[k]
    sys.meta_path.insert(0, BlockInstalledPackage())
    sys.path.insert(0, folder)
    import torch

    job = torch.load(job_path, weights_only=True)
    pkg = job["pkg"]
    report = {"blocked": _blocked(), "cases": []}
    for case in job["cases"]:
        res = {}
        try:
            outs = [torch.full(shape, math.nan, dtype=dtype, device=case["args"][0].device)
                    for shape, dtype in case["outs"]]
            if case["mode"] == "entry":
                file, fn = job["entry_point"].split("::")
                mod = importlib.import_module(file[:-3].replace("/", "."))
                ret = getattr(mod, fn)(*case["args"], *outs)
            else:
                mod = importlib.import_module(f"{pkg}.{job['entry_module']}")
                ret = getattr(mod, job["entry_function"])(*case["args"], out=outs, backend=case["backend"])
                ret = None if ret is not None and all(a is b for a, b in zip(ret, outs)) else ret
            if outs and outs[0].is_cuda:
                torch.cuda.synchronize()
            res["outputs"] = [t.cpu() for t in outs]
            res["returned_none"] = ret is None
        except BaseException:  # noqa: BLE001 - reported to the parent
            res["error"] = traceback.format_exc(limit=-6)
        res["loaded"] = sorted(k for k in sys.modules if k == pkg or k.startswith(pkg + "."))
        report["cases"].append(res)
    report["installed_loaded"] = sorted(k for k in sys.modules if k == BLOCKED or k.startswith(BLOCKED + "."))
    torch.save(report, report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
