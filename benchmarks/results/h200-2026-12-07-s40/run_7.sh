#!/usr/bin/env bash
# Session 40, last device call (carry .whl .bnb .shared): on an H200, issue 34's QLoRA 0.6B row first (session 37's
# run_2.sh cut to it by TOTAL=230); on any card, the one-rank CUDA check of apply_to under FSDP2.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  TOTAL=230 bash benchmarks/results/h200-2026-12-07-s37/run_2.sh
fi
export TRITON_INTERPRET=0 PYTHONPATH=src
timeout 120 python3 benchmarks/results/h200-2026-12-07-s40/fsdp_cuda_check.py 2>&1 | grep -v Warning | tail -4
