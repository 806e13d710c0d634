"""The bench report read as a browser and a markdown viewer would: the plot scales to the page,
and every per-workload number has its own column."""

import copy
import math
import re
from html.parser import HTMLParser

import pytest

from fusedqkv.bench import harness, report

NUM = re.compile(r"^[-+]?\d+(\.\d+)?(e[-+]?\d+)?$")


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.imgs, self.style, self._cell, self._in_style = [], [], "", None, False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.imgs.append(dict(attrs))
        elif tag == "style":
            self._in_style = True

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None
        elif tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        elif self._in_style:
            self.style += data


@pytest.fixture(scope="module")
def gpu_like(tmp_path_factory):
    """A real (CPU) run of the harness dressed as a GPU run: kernel span primary with CUDA events
    beside it, a two-GEMM floor, one implementation erroring on one workload."""
    cfg = harness.BenchConfig(device="cpu", workloads=["2", "13"], reps=1, warmup=0, max_tokens=2, progress=False)
    res = harness.run_bench(cfg)
    res = copy.deepcopy(res)
    res.update(cpu_run=False, hardware="NVIDIA H200", primary_timer="kernel_span", statistic="median")
    res["implementations"] = res["implementations"] + ["gemm_floor"]
    for i, row in enumerate(res["workloads"]):
        for n, x in row["impls"].items():
            lat = x["latency_ms"]
            x["timings"] = {"kernel_span": {"median": lat, "mean": lat, "n": 1},
                            "cuda_events": {"median": lat * 1.25, "mean": lat * 1.25, "n": 1}}
        row["impls"]["gemm_floor"] = {"status": "ok", "role": "bound", "correct": None, "latency_ms": 0.5 + i,
                                      "timings": {"kernel_span": {"median": 0.5 + i, "mean": 0.5 + i},
                                                  "cuda_events": {"median": 0.7 + i, "mean": 0.7 + i}}}
    res["summary"]["gemm_floor"] = {**res["summary"]["eager"], "label": "floor", "role": "bound", "sol_score": None,
                                    "all_correct": None, "correct_count": 0}
    bad = res["workloads"][1]["impls"]["eager"]
    bad.clear()
    bad.update(status="error", role="reference", correct=False, error="RuntimeError: out of memory")
    recs = harness.build_records(res)
    out = tmp_path_factory.mktemp("report")
    report.write_report(res, recs, recs["fusedqkv"], out)
    return res, out


def test_plot_scales_to_the_page(gpu_like):
    _, out = gpu_like
    page = _Page()
    page.feed((out / "report.html").read_text())
    imgs = [i for i in page.imgs if i.get("alt") == "latency"]
    assert len(imgs) == 1 and "plot" in imgs[0]["class"].split()
    rule = re.search(r"img\.plot\{([^}]*)\}", page.style)
    assert rule and "max-width:100%" in rule.group(1) and "height:auto" in rule.group(1)
    assert re.search(r"\.scroll\{[^}]*overflow-x:auto", page.style)  # wide tables scroll in their own box


def _workload_table(tables):
    return next(t for t in tables if t and "workload" in t[0] and "tokens" in t[0])


def test_per_workload_numbers_have_their_own_columns(gpu_like):
    res, out = gpu_like
    page = _Page()
    page.feed((out / "report.html").read_text())
    table = _workload_table(page.tables)
    head, rows = table[0], table[1:]
    for n in ("fusedqkv", "eager"):
        for col in (f"{n} span ms", f"{n} events ms", f"{n} check", f"{n} S"):
            assert col in head, (col, head)
    assert "gemm_floor span ms" in head and "gemm_floor events ms" in head and "fusedqkv / floor" in head
    assert "gemm_floor S" not in head and "fusedqkv" not in head
    assert len(rows) == 2 and all(len(r) == len(head) for r in rows)
    numeric = [i for i, h in enumerate(head) if h.endswith((" ms", " S", "/ floor"))]
    for r in rows:
        for i in numeric:
            assert NUM.match(r[i]) or r[i] == "—", (head[i], r[i])
    col = dict(zip(head, rows[0]))
    assert col["fusedqkv check"] == "ok" and col["eager check"] == "ok"
    x = res["workloads"][0]["impls"]["fusedqkv"]
    assert float(col["fusedqkv span ms"]) == pytest.approx(x["latency_ms"], rel=1e-3, abs=1e-4)
    assert float(col["fusedqkv events ms"]) == pytest.approx(x["latency_ms"] * 1.25, rel=1e-3, abs=1e-4)
    assert float(col["fusedqkv / floor"]) == pytest.approx(x["latency_ms"] / 0.5, rel=1e-3)
    err = dict(zip(head, rows[1]))
    assert err["eager check"].startswith("ERROR: RuntimeError") and err["eager span ms"] == "—"


def test_markdown_has_the_same_columns_and_the_floor_geomean(gpu_like):
    res, out = gpu_like
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| workload | tokens |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert "fusedqkv span ms" in cols and "fusedqkv events ms" in cols and "fusedqkv S" in cols
    g = math.exp(sum(math.log(r["impls"]["fusedqkv"]["latency_ms"] / r["impls"]["gemm_floor"]["latency_ms"])
                     for r in res["workloads"]) / 2)
    assert report.floor_ratio_geomean(res) == pytest.approx(g)
    assert f"Geomean fusedqkv / two-GEMM floor: {g:.3f}" in md
