#!/usr/bin/env bash
# Create .venv with the pinned CPU build of torch and smp installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-ci.txt
