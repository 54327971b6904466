#!/usr/bin/env bash
# Set up (if needed) and run the main job: a short fine-tuning run of a tiny Llama on the
# built-in corpus, across 2 processes on CPU (torchrun, gloo). Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The demo again (no arguments): keep the previous demo's output beside it and start afresh, as a
# new run may not write over another run's checkpoints.
if [ "$#" -eq 0 ] && [ -d runs/finetune ]; then
  kept="runs/finetune.$(date +%Y%m%d-%H%M%S)"
  mv runs/finetune "$kept"
  echo "demo: the previous demo's output moved to $kept"
fi
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-2}" examples/finetune_causal_lm.py "$@"
