#!/usr/bin/env bash
# One-command GPU check of smp: `bash scripts/gpu_check.sh [--out DIR] [--only STEP] [--size tiny|1b]`.
# Writes gpu_check_report.json / .md (see docs/gpu-check.md); exit code 0 when everything that ran passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m smp.gpu_check "$@"
