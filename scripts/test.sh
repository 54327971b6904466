#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow cases included (a bare `pytest` leaves
# them out: tests/conftest.py). Extra arguments go to pytest (a later -m replaces this one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "slow or not slow" "$@"
