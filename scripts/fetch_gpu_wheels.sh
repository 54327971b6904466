#!/usr/bin/env bash
# On a machine with the package index: download the wheels that the GPU machine image lacks into
# wheels/gpu/ (ignored by git), for scripts/gpu_check.sh to install there with --no-index.
#
#   bash scripts/fetch_gpu_wheels.sh [--python-version 3.12] [--platform manylinux2014_x86_64] [--dest DIR]
#
# The image (Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, triton 3.6, safetensors,
# xxhash, pyyaml, peft, numpy, typing-extensions, pynvml) has every import of smp but pydantic,
# and not torchao (fp8 training, the GPU check's fp8 step); pydantic brings pydantic-core
# (compiled: hence the Python version and platform), annotated-types, typing-inspection and
# typing-extensions (fetched too, used only where the image's is too old). torchao declares no
# dependency (it uses the torch it finds).
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
DEST=wheels/gpu
PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    --platform) PLATFORMS+=("$2"); shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h|--help) sed -n 2,10p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
# pip matches a manylinux tag exactly: offer the common ones (x86-64, glibc 2.17 and later).
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64)

# The version CI pins (requirements-ci.txt), so the GPU run uses what the tests ran with.
PYDANTIC=$(grep -E '^pydantic==' requirements-ci.txt)
TORCHAO=$(grep -E '^torchao==' requirements-ci.txt)

platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
mkdir -p "$DEST"
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --implementation cp \
  --python-version "$PYVER" "${platform_args[@]}" -d "$DEST" "$PYDANTIC" "$TORCHAO"
printf '%s\n' "$PYDANTIC" "$TORCHAO" > "$DEST/requirements.txt"
ls -1 "$DEST"/*.whl
echo "wheels for Python $PYVER in $DEST; on the GPU machine: bash scripts/gpu_check.sh"
