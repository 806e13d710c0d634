#!/usr/bin/env bash
# Session 40, a last ask with ~300 s of budget (carry .whl .bnb .shared): on an H200 only, issue 34's QLoRA 0.6B row
# (session 37's run_2.sh cut to it by TOTAL=200); any other card stops at once.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TOTAL=200 bash benchmarks/results/h200-2026-12-07-s37/run_2.sh
  exit 0
fi
nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: stopped"
