#!/usr/bin/env bash
# One-call GPU check: every GPU number pagedkv needs, in one shot of at most 7 minutes.
#
#   bash bench/gpu_check.sh              # from anywhere, on the GPU machine (repo = this checkout)
#   bash bench/gpu_check.sh --rehearse   # plumbing rehearsal: no GPU is fine (sections say "no GPU")
#
# Built for a borrowed machine (docs/gpu.md): python3 with torch/triton/cupy preinstalled, no
# network, at most 8 files brought back from $OUT. So:
# - one global deadline (DEADLINE_S, default 420 s): each section's timeout is clamped to what is
#   left (minus RESERVE_S for packing); a section with no time left is SKIPPED (deadline);
# - $OUT only ever holds three plain files, rewritten after EVERY section (a run cut short still
#   brings back what finished): status.md (the status table + versions), results.md (every result
#   table so far) and gpu_check.tar.gz (all raw logs, junit, JSON);
# - service dependencies the image lacks come from a wheelhouse (tools/gpu_wheels.sh) installed
#   offline into $PYDEPS (put on PYTHONPATH), never from the network;
# - the GPU sections (kernel tests, CUDA IPC round trip, kernel bench, worker check) need a CUDA
#   device; without one they report "no GPU" (and the script exits 1 unless --rehearse).
#
# Sections and their default timeouts (env knobs, seconds; their sum fits the 420 s deadline):
#   wheels 40 (WHEELS_TIMEOUT_S), env 20 (ENV_TIMEOUT_S), pytest 110 (PYTEST_TIMEOUT_S),
#   ipc 40 (IPC_TIMEOUT_S), bench 70 (BENCH_TIMEOUT_S; BENCH_BUDGET_S 50 stops starting cases),
#   worker 50 (WORKER_TIMEOUT_S), pd 85 (PD_TIMEOUT_S: the worker layouts of bench/gpu_pd_check.py).
# Other knobs: PYTHON (python3), OUT (results/gpu_check), WHEELHOUSE (.gpu_wheels), PYDEPS
# (.gpu_pydeps), PYTEST_WORKERS (4, when pytest-xdist is importable), BENCH_ARGS, WORKER_ARGS, PD_ARGS.
set -uo pipefail

REHEARSE=0
for a in "$@"; do
  case "$a" in
    --rehearse) REHEARSE=1 ;;
    *) echo "usage: $0 [--rehearse]" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT="$PWD"
T0=$(date +%s)
DEADLINE_S="${DEADLINE_S:-420}"
RESERVE_S="${RESERVE_S:-5}"
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-python3}"
WHEELHOUSE="${WHEELHOUSE:-.gpu_wheels}"
PYDEPS="${PYDEPS:-.gpu_pydeps}"
export PYTHONPATH="$ROOT:$ROOT/$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$WORK/triton-cache"   # a fresh cache: every compile is really done here
unset TRITON_INTERPRET PAGEDKV_KERNEL_BACKEND

declare -a STATUS=()
HAS_GPU=0  # nvidia-smi first (instant when there is no driver), then what torch sees
if nvidia-smi -L >/dev/null 2>&1 && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  HAS_GPU=1
fi

remaining() { echo $(( DEADLINE_S - ($(date +%s) - T0) - RESERVE_S )); }

# publish: rewrite status.md, results.md and the tarball in $OUT from what exists so far.
publish() {
  {
    echo "# gpu_check status"
    echo
    echo "mode: $([ "$REHEARSE" = 1 ] && echo rehearsal || echo full); GPU: $([ "$HAS_GPU" = 1 ] && echo yes || echo 'no GPU');" \
      "elapsed $(( $(date +%s) - T0 )) s of a ${DEADLINE_S} s deadline"
    echo
    echo "| section | result | time | timeout |"
    echo "|---|---|---:|---:|"
    printf '%s\n' "${STATUS[@]}"
    echo
    if grep -qE '[0-9]+ (passed|failed|error)' "$WORK/pytest.txt" 2>/dev/null; then
      echo "pytest: $(grep -E '[0-9]+ (passed|failed|error)' "$WORK/pytest.txt" | tail -n 1)"
    fi
    if [ -f "$WORK/versions.txt" ]; then
      echo
      echo '```'
      cat "$WORK/versions.txt"
      echo '```'
    fi
  } > "$WORK/status.md"
  {
    echo "# gpu_check results"
    for f in results.md worker_bench.md; do
      if [ -f "$WORK/$f" ]; then echo; cat "$WORK/$f"; fi
    done
    if grep -q '^| layout' "$WORK/pd.txt" 2>/dev/null; then
      echo; echo "## worker layouts on one GPU (bench/gpu_pd_check.py)"; echo
      grep -E '^(model|\|)' "$WORK/pd.txt"
    fi
  } > "$WORK/results_all.md"
  cp "$WORK/status.md" "$OUT/status.md.tmp" && mv "$OUT/status.md.tmp" "$OUT/status.md"
  cp "$WORK/results_all.md" "$OUT/results.md.tmp" && mv "$OUT/results.md.tmp" "$OUT/results.md"
  tar -C "$WORK" --exclude=triton-cache -czf "$OUT/gpu_check.tar.gz.tmp" . && mv "$OUT/gpu_check.tar.gz.tmp" "$OUT/gpu_check.tar.gz"
}

# run_section NAME TIMEOUT_S NEEDS_GPU cmd... : run under min(TIMEOUT_S, time left), log to
# $WORK/NAME.txt, record the outcome, publish.
run_section() {
  local name="$1" want="$2" needs_gpu="$3"
  shift 3
  local left limit start rc took verdict
  left=$(remaining)
  limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 1 ]; then
    STATUS+=("| $name | SKIPPED (deadline) | 0s | ${want}s |")
    publish
    return
  fi
  if [ "$needs_gpu" = 1 ] && [ "$HAS_GPU" = 0 ]; then
    echo "no GPU: section skipped" > "$WORK/$name.txt"
    STATUS+=("| $name | no GPU | 0s | ${limit}s |")
    publish
    return
  fi
  echo "=== [$name] (timeout ${limit}s): $*"
  start=$(date +%s)
  # timeout signals its whole process group (TERM, then KILL): nothing the section started outlives it.
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"; elif [ "$rc" -ne 0 ]; then verdict="FAILED (rc=$rc)"; fi
  tail -n 15 "$WORK/$name.txt"
  echo "=== [$name] $verdict in ${took}s"
  STATUS+=("| $name | $verdict | ${took}s | ${limit}s |")
  publish
}

# --- env: versions of everything that matters ---------------------------------------------------
env_section() {
  {
    echo "kernel $(uname -r)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null \
      || echo "nvidia-smi: not available"
    # Versions from package metadata (no imports: fast), as the sections will see them (PYTHONPATH).
    "$PY" - <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
print("python", sys.version.split()[0])
for label, dists in (("torch", ["torch"]), ("triton", ["triton"]), ("cupy", ["cupy-cuda13x", "cupy-cuda12x", "cupy"]),
                     ("numpy", ["numpy"]), ("grpcio", ["grpcio"]), ("protobuf", ["protobuf"]), ("pytest", ["pytest"]),
                     ("pytest-xdist", ["pytest-xdist"]), ("structlog", ["structlog"]), ("pydantic", ["pydantic"]),
                     ("pydantic-settings", ["pydantic-settings"]), ("grpcio-health-checking", ["grpcio-health-checking"]),
                     ("grpcio-reflection", ["grpcio-reflection"])):
    found = "MISSING"
    for d in dists:
        try:
            found = f"{version(d)} ({d})" if d != label else version(d)
            break
        except PackageNotFoundError:
            pass
    print(label, found)
EOF
    if [ "$HAS_GPU" = 1 ]; then
      "$PY" -c 'import torch; print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0), "sms", torch.cuda.get_device_properties(0).multi_processor_count)'
    else
      echo "cuda: no GPU"
    fi
  } > "$WORK/versions.txt" 2>&1
  cat "$WORK/versions.txt"
}

# --- wheels: the services' dependencies, offline, into $PYDEPS -----------------------------------
wheels_section() {
  if [ ! -d "$WHEELHOUSE" ]; then
    echo "no wheelhouse at $WHEELHOUSE (tools/gpu_wheels.sh builds it): using what the image has"
    return 0
  fi
  "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELHOUSE" \
    --target "$PYDEPS" --upgrade -r "$WHEELHOUSE/requirements.txt"
}

export -f env_section wheels_section
export PY WORK WHEELHOUSE PYDEPS HAS_GPU
# wheels first, so that env records the versions the sections will really import
run_section wheels "${WHEELS_TIMEOUT_S:-40}" 0 bash -c wheels_section
run_section env "${ENV_TIMEOUT_S:-20}" 0 bash -c env_section

# --- pytest: the kernel tests compiled on CUDA (bf16 included) -----------------------------------
# test_compile_sm90 is deselected: here every test compiles for the real device anyway (it runs in
# CPU CI); the interpreter smoke test skips itself on CUDA.
XDIST=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then XDIST=(-n "${PYTEST_WORKERS:-4}"); fi
run_section pytest "${PYTEST_TIMEOUT_S:-110}" 1 "$PY" -m pytest tests/kernels -q -ra -p no:cacheprovider \
  "${XDIST[@]}" -k "not compile_sm90" --junitxml="$WORK/junit.xml" -o console_output_style=classic

# --- ipc: one cache shared by two processes over CUDA IPC -----------------------------------------
run_section ipc "${IPC_TIMEOUT_S:-40}" 1 "$PY" -m pytest -q -ra -p no:cacheprovider \
  "tests/worker_svc/test_cache_memory.py::test_cuda_ipc_round_trip_across_processes"

# --- bench: kernels vs contiguous SDPA and copy bandwidth ----------------------------------------
# shellcheck disable=SC2086
run_section bench "${BENCH_TIMEOUT_S:-70}" 1 "$PY" bench/kernel_bench.py --out "$WORK" \
  --time-budget "${BENCH_BUDGET_S:-50}" ${BENCH_ARGS:-}

# --- worker: cache host + two workers over CUDA IPC, tokens vs one process; decode throughput -----
WORKER_LIMIT="${WORKER_TIMEOUT_S:-50}"
# shellcheck disable=SC2086
run_section worker "$WORKER_LIMIT" 1 "$PY" bench/gpu_worker_check.py --out "$WORK" \
  --deadline-s "$(( WORKER_LIMIT - 5 ))" ${WORKER_ARGS:-}

# --- pd: the worker layouts (mixed x1, mixed x2, prefill + decode) on one GPU, one cache ---------
# Short run (fewer decode tokens and long prompts than gpu_pd_check's defaults) to fit the deadline.
# shellcheck disable=SC2086
run_section pd "${PD_TIMEOUT_S:-85}" 1 "$PY" bench/gpu_pd_check.py --decode-tokens 64 --long 4 ${PD_ARGS:-}

publish
cat "$OUT/status.md"
cat "$OUT/results.md"
if printf '%s\n' "${STATUS[@]}" | grep -qE 'FAILED|TIMEOUT|deadline'; then exit 1; fi
if [ "$HAS_GPU" = 0 ] && [ "$REHEARSE" = 0 ]; then echo "no GPU: nothing was measured" >&2; exit 1; fi
exit 0
