#!/usr/bin/env bash
# One-call GPU check for the kernels: tests on CUDA (incl. bf16), then the benchmark.
#
#   bash bench/gpu_check.sh            # from the repo root, on a machine with a GPU
#
# Designed for a borrowed GPU machine with torch/triton preinstalled and the repo as cwd: it never
# installs torch, runs each section under its own timeout, keeps going past a failing section, and
# prints a status table plus the benchmark's results table LAST. Everything also lands in $OUT
# (default results/gpu_check): env.txt, pytest.txt, junit.xml, bench.txt, results.md, results.json,
# status.md. Total wall time stays under ~6 minutes on one H200 with the default timeouts.
#
# Extending (worker team): add a section with `run_section NAME TIMEOUT_S command...` below; its
# output goes to $OUT/NAME.txt and its status into the table.
#
# Knobs (env): PYTEST_TIMEOUT_S (150), BENCH_TIMEOUT_S (180), WORKER_TIMEOUT_S (120), BENCH_BUDGET_S (120: the bench stops
# starting new cases after it), BENCH_ARGS (extra kernel_bench.py args), PAGEDKV_PYDEPS (a folder
# with pure-Python test deps, e.g. `pip install --target .gpu_pydeps pytest`, put on PYTHONPATH when
# the machine lacks pytest).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
PYDEPS="${PAGEDKV_PYDEPS:-.gpu_pydeps}"
export PYTHONPATH=".${PYDEPS:+:$PYDEPS}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python}"

declare -a STATUS=()

# run_section NAME TIMEOUT_S cmd... : run with a timeout, tee to $OUT/NAME.txt, record the outcome.
run_section() {
  local name="$1" limit="$2"
  shift 2
  local start rc
  start=$(date +%s)
  echo "=== [$name] (timeout ${limit}s): $*"
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  rc=${PIPESTATUS[0]}
  set -e
  local took=$(( $(date +%s) - start ))
  local verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"; elif [ "$rc" -ne 0 ]; then verdict="FAILED (rc=$rc)"; fi
  STATUS+=("| $name | $verdict | ${took}s |")
  echo "=== [$name] $verdict in ${took}s"
}

# --- section: environment ------------------------------------------------------------------------
run_section env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true; \
  $PY -c 'import sys, torch, triton; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda, \"device\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'; \
  $PY -c 'import pytest; print(\"pytest\", pytest.__version__)' || echo 'pytest missing: set PAGEDKV_PYDEPS to a folder with pytest (pip install --target)'"

# --- section: kernel tests on CUDA (bf16 included: only runs on a GPU) ----------------------------
if $PY -c "import pytest" >/dev/null 2>&1; then
  run_section pytest "${PYTEST_TIMEOUT_S:-150}" "$PY" -m pytest tests/kernels -q -ra -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" -o console_output_style=classic
else
  STATUS+=("| pytest | SKIPPED (pytest not importable) | 0s |")
fi

# --- section: benchmark ---------------------------------------------------------------------------
# shellcheck disable=SC2086
run_section bench "${BENCH_TIMEOUT_S:-180}" "$PY" bench/kernel_bench.py --out "$OUT" \
  --time-budget "${BENCH_BUDGET_S:-120}" ${BENCH_ARGS:-}

# --- section: worker over CUDA IPC (cache host + two workers as processes) + decode throughput ------
run_section worker "${WORKER_TIMEOUT_S:-120}" "$PY" bench/gpu_worker_check.py --out "$OUT"

# --- section: worker layouts (mixed x1, mixed x2, prefill+decode) on one cache (bench/gpu_pd_check.py) --
run_section layouts "${LAYOUTS_TIMEOUT_S:-420}" "$PY" bench/gpu_pd_check.py --json "$OUT/layouts.json"

# --- summary (printed last) -----------------------------------------------------------------------
{
  echo "# gpu_check status"
  echo
  echo "| section | result | time |"
  echo "|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  if [ -f "$OUT/pytest.txt" ]; then
    echo "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.txt" | tail -n 1 || true)"
    echo
  fi
} > "$OUT/status.md"
cat "$OUT/status.md"
if [ -f "$OUT/results.md" ]; then
  cat "$OUT/results.md"
else
  echo "(no benchmark results: see $OUT/bench.txt)"
fi
# Exit non-zero when any section failed, after everything has run and been reported.
if printf '%s\n' "${STATUS[@]}" | grep -qE 'FAILED|TIMEOUT'; then exit 1; fi
