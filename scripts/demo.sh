#!/usr/bin/env bash
# Set up (if needed) and run the main job: a short fine-tuning run of a tiny Llama on the
# built-in corpus, across 2 processes on CPU (torchrun, gloo). Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-2}" examples/finetune_causal_lm.py "$@"
