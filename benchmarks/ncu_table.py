"""Join an ncu --csv metrics file with the launch order printed by profile_stage.py (or
profile_single_launch.py): one line per profiled (non-warm-up) launch.

    python3 benchmarks/ncu_table.py sweep.csv sweep.order
"""

import csv
import sys


def main(csv_path: str, order_path: str) -> int:
    order = [line.strip() for line in open(order_path) if line.startswith(("launch", "warmup"))]
    rows = list(csv.reader(line for line in open(csv_path) if line.startswith('"')))
    if not rows:
        print("no ncu rows")
        return 1
    hdr, data = rows[0], rows[1:]
    i_id, i_name, i_val = hdr.index("ID"), hdr.index("Metric Name"), hdr.index("Metric Value")
    by_id: dict = {}
    for r in data:
        by_id.setdefault(int(r[i_id]), {})[r[i_name]] = r[i_val]
    short = {"gpu__time_duration.sum": "ns", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
             "launch__registers_per_thread": "regs", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
             "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%", "dram__bytes.sum": "bytes"}
    for i, line in enumerate(order):
        if line.startswith("launch"):
            m = by_id.get(i, {})
            print(line[len("launch "):], " ".join(f"{short.get(k, k)}={v}" for k, v in m.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
