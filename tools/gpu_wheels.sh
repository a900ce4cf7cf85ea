#!/usr/bin/env bash
# Build the offline wheelhouse bench/gpu_check.sh installs on the GPU machine's image.
#
#   bash tools/gpu_wheels.sh [DIR]             # default DIR: .gpu_wheels (git-ignored); cp312 manylinux x86_64
#   bash tools/gpu_wheels.sh --native [DIR]    # for THIS interpreter's platform: the CPU rehearsal
#                                              # (default DIR then: .gpu_wheels_native)
#
# Why: the GPU image (python 3.12 with torch, triton, numpy, cupy) has no network and lacks what the
# sections import. Which distributions those are is not kept by hand: `python -m bench.gpu.imports
# --distributions` reads every section's entry modules, follows the project's imports and maps each
# outside module to the distribution this venv has it from (minus the image's torch, triton, numpy,
# cupy), at this venv's version; pytest, pytest-xdist and pytest-timeout are among them (the pytest
# section's runner and plugins). This writes DIR/requirements.txt and downloads those wheels plus
# their dependencies with a plain `pip download`. The versions are read from the project's venv
# (.venv/bin/python; PYTHON overrides), never from the first python on PATH. gpu_check.sh's preflight
# then installs them in seconds, offline:
#   python3 -m pip install --no-compile --no-index --find-links DIR --target .gpu_pydeps -r DIR/requirements.txt
# Ship DIR with the checkout (docs/gpu.md: the device tool's `carry`); it must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NATIVE=0
if [ "${1:-}" = "--native" ]; then NATIVE=1; shift; fi
if [ "$NATIVE" = 1 ]; then DIR="${1:-.gpu_wheels_native}"; else DIR="${1:-.gpu_wheels}"; fi
PY="${PYTHON:-.venv/bin/python}"
if ! [ -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "no $PY: run 'make install' first (the wheel versions are read from the project's venv), or set PYTHON" >&2
  exit 2
fi
mkdir -p "$DIR"
PYTHONPATH="$PWD" "$PY" -m bench.gpu.imports --distributions > "$DIR/requirements.txt"
echo "versions from $("$PY" -c 'import sys; print(sys.executable)'):"
cat "$DIR/requirements.txt"
if [ "$NATIVE" = 1 ]; then
  "$PY" -m pip download --disable-pip-version-check --dest "$DIR" --only-binary=:all: -r "$DIR/requirements.txt"
else
  "$PY" -m pip download --disable-pip-version-check --dest "$DIR" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -r "$DIR/requirements.txt"
fi
MIB=$(du -sm "$DIR" | cut -f1)
echo "wheelhouse: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels, ${MIB} MiB)"
if [ "$MIB" -ge 64 ]; then
  echo "the wheelhouse is ${MIB} MiB: what the device tool carries is at most 64 MiB" >&2
  exit 1
fi
