#!/usr/bin/env bash
# session 30, call 2: session 29's run_7 again (issue 36's host rows, and the training block at 512 tokens against
# eager and torch.compile) on the tree whose hybrid dW behind dX waits at its start. Carry .shared.
exec bash benchmarks/results/h200-2026-12-06-s29/run_7.sh "$@"
