#!/usr/bin/env bash
# Create .venv with the pinned CPU build of torch and smp installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Bytecode is compiled at install (not --no-compile, though that halves the install): with
# PYTHONDONTWRITEBYTECODE set, as on this project's machines, no import would write it later and
# every fresh interpreter would compile torch again (`smp check`: ~2 -> 12 CPU seconds).
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-ci.txt
