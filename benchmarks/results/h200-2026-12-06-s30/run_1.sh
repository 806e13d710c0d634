#!/usr/bin/env bash
# session 30, call 1: session 29's run_6 again on the tree whose hybrid dW behind dX waits at its start (not at its end),
# and whose 091 plan derives its launch order after dX (the review): the user and official clocks with dW first
# as a variant in the same rounds, gpu_fuzz 200, the graph cases and the GPU tests. Carry .shared.
exec bash benchmarks/results/h200-2026-12-06-s29/run_6.sh "$@"
