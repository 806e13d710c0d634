#!/usr/bin/env bash
# Session 40, device call (carry .whl .bnb .shared): on an H200, session 37's run_2.sh in full (issue 34's QLoRA
# 0.6B row, issue 36's user clock and host rows); on any other card it stops at once (nothing new to run there).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TOTAL=430 bash benchmarks/results/h200-2026-12-07-s37/run_2.sh
  exit 0
fi
nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: stopped"
