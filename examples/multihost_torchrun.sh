#!/usr/bin/env bash
# Multi-host launch without a scheduler: run this same command on every host, with the same
# HEAD (a host every other host can reach) and NNODES. torchrun's c10d rendezvous assigns node
# ranks; smp only reads the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, ...).
#
#   HEAD=10.0.0.1 NNODES=2 NPROC=8 bash examples/multihost_torchrun.sh --model /shared/llama-8b
#
# One host, two CPU processes, to try it here:
#   HEAD=127.0.0.1 NNODES=1 NPROC=2 PYTHON=.venv/bin/python bash examples/multihost_torchrun.sh --steps 5
set -euo pipefail
cd "$(dirname "$0")/.."
: "${HEAD:?set HEAD to the address of the rendezvous host}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-8}"
PORT="${PORT:-29500}"
RUN_ID="${RUN_ID:-smp-finetune}"   # the same on every host of one job

# Plain torchrun; `smp run -n "$NPROC" --nnodes ... examples/finetune_causal_lm.py` is the same command.
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-id "$RUN_ID" --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" \
    examples/finetune_causal_lm.py "$@"
