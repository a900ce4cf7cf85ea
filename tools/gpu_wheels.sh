#!/usr/bin/env bash
# Build the offline wheelhouse bench/gpu_check.sh installs on the GPU machine's image.
#
#   bash tools/gpu_wheels.sh [DIR]             # default DIR: .gpu_wheels (git-ignored); cp312 manylinux x86_64
#   bash tools/gpu_wheels.sh --native [DIR]    # for THIS interpreter's platform: the CPU rehearsal
#
# Why: the GPU image (python 3.12, torch/triton/cupy/numpy/grpcio/protobuf preinstalled) has no
# network and lacks what the services import (structlog, pydantic, pydantic-settings,
# grpcio-health-checking, grpcio-reflection, prometheus-client, tqdm, pyzmq, msgspec), and its
# grpcio/protobuf may be older than the generated code in pagedkv/v1 needs. This downloads wheels of
# exactly those, at the versions this checkout runs with, plus their dependencies, and writes
# DIR/requirements.txt. The versions are read from the project's venv (.venv/bin/python; PYTHON
# overrides), never from the first python on PATH, which may be another environment's. gpu_check.sh
# then runs, in seconds and offline:
#   python3 -m pip install --no-index --find-links DIR --target .gpu_pydeps -r DIR/requirements.txt
# and fails its wheels section (full mode) when DIR is missing or anything the sections import is
# still missing afterwards (bench/gpu_imports.py, in a clean interpreter). Ship DIR with the
# checkout (docs/gpu.md: the device tool's `carry`). Never torch/triton/numpy/cupy (the image's own
# builds match its CUDA) nor pytest or its plugins (they would shadow the image's pytest-xdist's
# pytest; the `timeout` marker is declared in pyproject.toml, so tests collect without pytest-timeout).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NATIVE=0
if [ "${1:-}" = "--native" ]; then NATIVE=1; shift; fi
DIR="${1:-.gpu_wheels}"
PY="${PYTHON:-.venv/bin/python}"
if ! [ -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "no $PY: run 'make install' first (the wheel versions are read from the project's venv), or set PYTHON" >&2
  exit 2
fi
PKGS=(protobuf grpcio grpcio-health-checking grpcio-reflection structlog pydantic pydantic-settings
      prometheus-client tqdm pyzmq msgspec)

mkdir -p "$DIR"
"$PY" - "$DIR/requirements.txt" "${PKGS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

out, names = sys.argv[1], sys.argv[2:]
lines = []
for n in names:
    try:
        lines.append(f"{n}=={version(n)}")
    except PackageNotFoundError:
        sys.exit(f"{n} is not installed in {sys.executable}: install the project (make install) first")
open(out, "w").write("\n".join(lines) + "\n")
print(f"versions from {sys.executable}:")
print("\n".join(lines))
EOF
if [ "$NATIVE" = 1 ]; then
  "$PY" -m pip download --disable-pip-version-check --dest "$DIR" --only-binary=:all: -r "$DIR/requirements.txt"
else
  "$PY" -m pip download --disable-pip-version-check --dest "$DIR" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -r "$DIR/requirements.txt"
fi
echo "wheelhouse: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"
