#!/usr/bin/env bash
# The bandwidth-bound measurements quoted in BENCHMARKS.md (gradient sync): gradient
# reduce-scatter and whole training steps on emulated nodes at several link rates.
# Needs root (network namespaces, tc); ~20 minutes on 2 cores. Results: bench/results/*emulated*.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1
for mbit in 10000 1000 250; do
  for nodes in 2 4; do
    $PY bench/emulated_cluster.py --nodes $nodes --link-mbit $mbit -- \
      bench/bench_collectives.py --sizes-mib 4 16 64 --reps 5 --kernel-mib 0
  done
done
for mbit in 1000 250; do
  $PY bench/emulated_cluster.py --nodes 2 --procs-per-node 2 --link-mbit $mbit -- bench/bench_sync_step.py --hybrid 2
done
$PY bench/emulated_cluster.py --nodes 2 --link-mbit 1000 -- bench/bench_sync_step.py
