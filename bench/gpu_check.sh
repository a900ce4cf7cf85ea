#!/usr/bin/env bash
# The one-call GPU check's entry point (the check itself and its modules live in bench/gpu/).
#   bash bench/gpu_check.sh [--rehearse]      # docs/gpu.md
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu/check.sh" "$@"
