#!/usr/bin/env bash
# Build the offline wheelhouse bench/gpu_check.sh installs on the GPU machine's image.
#
#   bash tools/gpu_wheels.sh [DIR]      # default DIR: .gpu_wheels (git-ignored)
#
# Why: the GPU image (python 3.12, torch/triton/cupy/numpy/grpcio/protobuf preinstalled) has no
# network and lacks what the services import (structlog, pydantic, pydantic-settings,
# grpcio-health-checking, grpcio-reflection, prometheus-client, tqdm, pyzmq, msgspec), and its
# grpcio/protobuf may
# be older than the generated code in pagedkv/v1 needs. This downloads cp312 manylinux x86_64
# wheels of exactly those, at the versions this checkout runs with (read from the current Python
# environment, so CPU CI and the GPU run use the same ones), plus their dependencies, and writes
# DIR/requirements.txt. gpu_check.sh then runs, in seconds and offline:
#   python3 -m pip install --no-index --find-links DIR --target .gpu_pydeps -r DIR/requirements.txt
# Ship DIR with the checkout (docs/gpu.md: the device tool's `carry`). Never torch/triton/numpy/cupy
# (the image's own builds match its CUDA) nor pytest or its plugins (they would shadow the image's
# pytest-xdist's pytest; the `timeout` marker is declared in pyproject.toml, so tests collect without
# pytest-timeout).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-.gpu_wheels}"
PY="${PYTHON:-python}"
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
        sys.exit(f"{n} is not installed here: install the project (pip install -e .) first")
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
"$PY" -m pip download --disable-pip-version-check --dest "$DIR" --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -r "$DIR/requirements.txt"
echo "wheelhouse: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1))"
