#!/usr/bin/env bash
# Session 37, device call 3 (any card; carry .whl .shared), on the tree with this session's three fixes: the
# block's create_graph path on the GPU, gpu_fuzz 200 and the graph and fast-path tests (the Functions' backward
# changed: a grad-mode branch), then host_costs' training rows (a host path changed).
source benchmarks/results/device_setup.sh
TOTAL=${TOTAL:-400}
cat $W/gpu.txt
step cgraph 60 cgraph.txt python3 benchmarks/results/h200-2026-12-07-s37/create_graph_gpu.py
step fuzz 130 fuzz.txt python3 benchmarks/gpu_fuzz.py --cases 200 --time-limit 115 --out $J/fuzz
step t_gpu 100 t_gpu.txt python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py tests/test_gpu_fast_path.py
step host 100 host.txt python3 benchmarks/host_costs.py --workloads=2 --train-tokens 128,512 --out $J/host
tail -3 $W/cgraph.txt; tail -1 $W/fuzz.txt; tail -1 $W/t_gpu.txt
grep -A3 "^091 / two torch.mm" $W/host.txt; grep -A5 "^training fwd+bwd / two torch.mm, interleaved" $W/host.txt
cat $W/status
