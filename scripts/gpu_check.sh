#!/usr/bin/env bash
# One-command GPU check of smp: `bash scripts/gpu_check.sh [--python PY] [--out DIR] [--only STEP] [--size tiny|1b]`.
# Writes gpu_check_report.json / .md (see docs/gpu-check.md); exit code 0 when everything that ran passed.
#
# The interpreter: --python PY, else $PYTHON, else .venv/bin/python when there is one, else the
# first python3 / python on PATH that imports torch (on the GPU machine image: its python3).
# What that interpreter lacks of smp's needs (pydantic on the image) is installed from
# wheels/gpu/ (scripts/fetch_gpu_wheels.sh, run where the index is) with --no-index into
# $SMP_GPU_SITE (default /tmp/smp-gpu-site), never into the interpreter's own environment.
# smp itself runs from this checkout (PYTHONPATH), so no install of smp is needed.
set -euo pipefail

args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYTHON=$2; shift 2 ;;
    --python=*) PYTHON=${1#--python=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
# A path given relative to the caller's directory stays valid after the cd below.
case "${PYTHON:-}" in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac
cd "$(dirname "$0")/.."
REPO=$PWD

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then
    PYTHON=$REPO/.venv/bin/python
  else
    for candidate in python3 python; do
      if command -v "$candidate" >/dev/null && "$candidate" -c 'import torch' 2>/dev/null; then
        PYTHON=$(command -v "$candidate"); break
      fi
    done
  fi
fi
if [ -z "${PYTHON:-}" ] || ! "$PYTHON" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: no Python that imports torch (tried ${PYTHON:-.venv/bin/python, python3, python}); pass --python PATH" >&2
  exit 2
fi

WHEELS=${SMP_GPU_WHEELS:-$REPO/wheels/gpu}
SITE=${SMP_GPU_SITE:-/tmp/smp-gpu-site}
# pydantic is needed (smp's config); torchao only by the fp8 step, which is skipped without it.
missing() { for m in pydantic torchao; do PYTHONPATH=${1:+$1:}${PYTHONPATH:-} "$PYTHON" -c "import $m" 2>/dev/null || echo "$m"; done; }
if [ -n "$(missing)" ]; then
  if [ -n "$(missing "$SITE")" ]; then
    if [ -f "$WHEELS/requirements.txt" ]; then
      echo "gpu_check: installing $(tr '\n' ' ' < "$WHEELS/requirements.txt")from $WHEELS into $SITE (no index)"
      "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" \
        --no-compile --upgrade --target "$SITE" -r "$WHEELS/requirements.txt"
    fi
    if missing "$SITE" | grep -qx pydantic; then
      echo "gpu_check: $PYTHON has no pydantic and $WHEELS holds no wheels of it. Where the package index is," >&2
      echo "  run: bash scripts/fetch_gpu_wheels.sh --python-version $("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" >&2
      echo "  and bring wheels/gpu/ along (it is ignored by git; the device tool carries it with carry: [\"wheels\"])." >&2
      exit 2
    fi
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO:$REPO/kernels${PYTHONPATH:+:$PYTHONPATH}

echo "gpu_check: $PYTHON ($("$PYTHON" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)'))"
exec "$PYTHON" -m smp.gpu_check ${args[@]+"${args[@]}"}
