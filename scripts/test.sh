#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
