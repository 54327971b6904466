#!/usr/bin/env bash
# Rehearse, on CPU, the GPU check as it runs on the GPU machine image: a venv with the image's
# Python and versions (torch 2.11, transformers 5.17, accelerate 1.15, peft; no pydantic), the
# wheels from scripts/fetch_gpu_wheels.sh, then scripts/gpu_check.sh end to end (the CUDA steps
# report skipped). Extra arguments go to gpu_check.sh.
#
#   SMP_COMPAT_CACHE        the venv goes to $SMP_COMPAT_CACHE/gpu-image (default ~/.cache/smp-compat),
#                           reused when its .complete marker is there
#   SMP_GPU_IMAGE_PYTHON    the CPython 3.12 to build it with (default: python3.12, else pyenv's 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${SMP_COMPAT_CACHE:-$HOME/.cache/smp-compat}
VENV=$CACHE/gpu-image
# The image's versions (docs/gpu-check.md); typer pulls pydantic in, which the image does not have.
PACKAGES="torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 xxhash PyYAML peft numpy pytest hypothesis"

if ! { [ -f "$VENV/.complete" ] && [ "$(cat "$VENV/.complete")" = "$PACKAGES" ]; }; then
  base=${SMP_GPU_IMAGE_PYTHON:-}
  if [ -z "$base" ]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3; do
      if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then base=$candidate; break; fi
    done
  fi
  if [ -z "$base" ]; then
    echo "rehearse_gpu_check: no CPython 3.12 found; set SMP_GPU_IMAGE_PYTHON" >&2
    exit 2
  fi
  echo "== building $VENV with $base"
  mkdir -p "$CACHE"
  [ -x "$VENV/bin/python" ] || "$base" -m venv "$VENV"
  # shellcheck disable=SC2086  # a list of requirement specifiers
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $PACKAGES
  "$VENV/bin/python" -m pip uninstall -q -y pydantic pydantic_core annotated-types typing-inspection
  echo "$PACKAGES" > "$VENV/.complete"
fi

if "$VENV/bin/python" -c 'import pydantic' 2>/dev/null; then
  echo "rehearse_gpu_check: $VENV has pydantic, which the GPU image lacks: rm -r it and rerun" >&2
  exit 2
fi
bash scripts/fetch_gpu_wheels.sh --python-version 3.12 >/dev/null
out=$(mktemp -d)
# A fresh site folder: the wheels are installed each time, as on a fresh GPU machine.
SMP_GPU_SITE=$out/site PATH=/usr/bin:/bin bash scripts/gpu_check.sh --python "$VENV/bin/python" --out "$out" "$@"
echo "rehearsal passed: report in $out"
