#!/usr/bin/env bash
# Create .venv with the pinned CPU build of torch and smp installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# --no-compile: the first import writes the bytecode of the modules it uses; compiling every
# installed file up front (torch, transformers) took as long as the install itself.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -r requirements-ci.txt
