#!/usr/bin/env bash
# One-call GPU check: every GPU number pagedkv needs, in one shot of at most 8 minutes.
#
#   bash bench/gpu_check.sh              # from anywhere, on the GPU machine (repo = this checkout)
#   bash bench/gpu_check.sh --rehearse   # rehearsal on CPU: every section's CPU form, same budgets
#
# Built for a borrowed machine (docs/gpu.md): python3 with torch/triton/cupy preinstalled, no
# network, at most 8 files brought back from $OUT. So:
# - one global deadline (DEADLINE_S, default 460 s): each section's timeout is clamped to what is
#   left (minus RESERVE_S for packing); a section with no time left is SKIPPED (deadline);
# - $OUT only ever holds three plain files, rewritten after EVERY section (a run cut short still
#   brings back what finished): status.md (the status table + versions), results.md (every result
#   table so far) and gpu_check.tar.gz (all raw logs, junit, JSON);
# - service dependencies the image lacks come from a wheelhouse (tools/gpu_wheels.sh) installed
#   offline into $PYDEPS (put on PYTHONPATH), never from the network;
# - full mode needs the wheelhouse: without it, or with a module the sections import still missing
#   after installing it (bench/gpu_imports.py in a clean interpreter), the wheels section FAILS;
# - the GPU sections (kernel tests, CUDA IPC round trip, kernel bench, worker check, CUDA graphs, pd) need a CUDA
#   device; without one they report "no GPU" and the script exits 1, unless --rehearse;
#
# - --rehearse without a GPU runs every GPU section's CPU form under the SAME timeout: pytest and ipc
#   collect their exact selection (same flags), bench runs kernel_bench --smoke with the same budget,
#   worker runs gpu_worker_check --device cpu, graphs runs cuda_graph_bench --device cpu, pd runs the
#   short form on CPU; so what would fail on
#   the GPU (a selection, an import, the wheelhouse, a budget, cleanup) fails here first;
# - every section runs in its own process group with PAGEDKV_GPU_CHECK_TAG=<run>-<section> in its
#   environment; when it ends (done, timed out, or gpu_check itself is stopped) every process still
#   carrying the tag gets SIGTERM, then SIGKILL after 5 s: services that started sessions of their
#   own (frontend/launch/processes.py) cannot outlive their section and keep holding GPU memory.
#
# Sections and their default timeouts (env knobs, seconds; their sum fits the 460 s deadline):
#   wheels 40 (WHEELS_TIMEOUT_S), env 20 (ENV_TIMEOUT_S), pytest 110 (PYTEST_TIMEOUT_S),
#   ipc 40 (IPC_TIMEOUT_S), bench 70 (BENCH_TIMEOUT_S; BENCH_BUDGET_S 50 shared by its sections),
#   worker 50 (WORKER_TIMEOUT_S), graphs 40 (GRAPHS_TIMEOUT_S: bench/cuda_graph_bench.py), pd 85
#   (PD_TIMEOUT_S: bench/gpu_pd_check.py --short).
# Other knobs: PYTHON (python3), OUT (results/gpu_check), WHEELHOUSE (.gpu_wheels), PYDEPS
# (.gpu_pydeps), PYTEST_WORKERS (4, when pytest-xdist is importable), BENCH_ARGS, WORKER_ARGS, GRAPHS_ARGS, PD_ARGS,
# GPU_CHECK_ONLY (comma-separated sections to run; the others read "not selected"),
# GPU_CHECK_RUN_ID (the tag's run part; default this script's PID), REHEARSAL_SLACK (whole number,
# default 1: under --rehearse, every timeout and the deadline are multiplied by it; only for a CPU
# shared with other work, e.g. CI on 2 loaded cores; the status says so when it is not 1).
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
DEADLINE_S="${DEADLINE_S:-460}"
SLACK=1
if [ "$REHEARSE" = 1 ]; then SLACK="${REHEARSAL_SLACK:-1}"; fi
DEADLINE_S=$(( DEADLINE_S * SLACK ))
RESERVE_S="${RESERVE_S:-5}"
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
PY="${PYTHON:-python3}"
WHEELHOUSE="${WHEELHOUSE:-.gpu_wheels}"
PYDEPS="${PYDEPS:-.gpu_pydeps}"
case "$WHEELHOUSE" in /*) ;; *) WHEELHOUSE="$ROOT/$WHEELHOUSE" ;; esac
case "$PYDEPS" in /*) ;; *) PYDEPS="$ROOT/$PYDEPS" ;; esac
RUN_ID="${GPU_CHECK_RUN_ID:-$$}"
ONLY="${GPU_CHECK_ONLY:-}"
export PYTHONPATH="$ROOT:$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
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
      "elapsed $(( $(date +%s) - T0 )) s of a ${DEADLINE_S} s deadline$([ "$SLACK" != 1 ] && echo "; every budget x$SLACK (REHEARSAL_SLACK)")"
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
    for f in results.md worker_bench.md cuda_graphs.md; do
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

# sweep TAG: end every process whose environment carries PAGEDKV_GPU_CHECK_TAG=TAG (a section's
# whole tree, sessions it started included): SIGTERM, up to 5 s for them to stop, then SIGKILL.
# Prints how many it found. /proc/PID/environ is the environment each process was started with.
tagged() {
  grep -lzxF "PAGEDKV_GPU_CHECK_TAG=$1" /proc/[0-9]*/environ 2>/dev/null | sed -e 's#^/proc/##' -e 's#/environ$##' \
    | grep -vx "$$"
}
alive() {  # those of the given PIDs that still run (a zombie holds no memory: it counts as gone)
  local pid st
  for pid in "$@"; do
    st=$(sed -e 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
    if [ -n "$st" ] && [ "$st" != Z ]; then echo "$pid"; fi
  done
}
sweep() {
  local tag="$1" pids live n i
  pids=$(tagged "$tag" | tr '\n' ' ')
  n=$(echo "$pids" | wc -w)
  if [ "$n" -eq 0 ]; then echo 0; return; fi
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null
  for i in $(seq 1 50); do
    # shellcheck disable=SC2046,SC2086
    live=$(alive $pids $(tagged "$tag") | sort -u | tr '\n' ' ')
    [ -z "${live// /}" ] && break
    sleep 0.1
  done
  if [ -n "${live// /}" ]; then
    # shellcheck disable=SC2086
    kill -KILL $live 2>/dev/null
    for i in $(seq 1 50); do  # until they are really gone (their memory, GPU memory included, freed)
      # shellcheck disable=SC2086
      [ -z "$(alive $live)" ] && break
      sleep 0.1
    done
  fi
  echo "$n"
}

CURRENT_TAG="" CURRENT_NAME="" CURRENT_LIMIT=0
on_signal() {  # gpu_check itself stopped (the device tool's timeout, Ctrl-C): stop the section first
  if [ -n "$CURRENT_TAG" ]; then
    sweep "$CURRENT_TAG" >/dev/null
    STATUS+=("| $CURRENT_NAME | KILLED (gpu_check stopped) | - | ${CURRENT_LIMIT}s |")
  fi
  publish
  exit 143
}
trap on_signal TERM INT

selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# run_section NAME TIMEOUT_S NEEDS_GPU FUNCTION: run FUNCTION (or, for a GPU section without a GPU
# under --rehearse, FUNCTION_rehearse) in its own process group under min(TIMEOUT_S, time left), log
# to $WORK/NAME.txt, sweep what it left running, record the outcome, publish.
run_section() {
  local name="$1" want=$(( $2 * SLACK )) needs_gpu="$3" fn="$4"
  local left limit start rc took verdict tag leftover mode=""
  if ! selected "$name"; then
    STATUS+=("| $name | not selected | 0s | ${want}s |")
    publish
    return
  fi
  left=$(remaining)
  limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 1 ]; then
    STATUS+=("| $name | SKIPPED (deadline) | 0s | ${want}s |")
    publish
    return
  fi
  if [ "$needs_gpu" = 1 ] && [ "$HAS_GPU" = 0 ]; then
    if [ "$REHEARSE" = 0 ]; then
      echo "no GPU: section skipped" > "$WORK/$name.txt"
      STATUS+=("| $name | no GPU | 0s | ${limit}s |")
      publish
      return
    fi
    fn="${fn}_rehearse" mode=" (CPU rehearsal)"
  fi
  echo "=== [$name] (timeout ${limit}s)$mode: $fn"
  tag="$RUN_ID-$name"
  CURRENT_TAG="$tag" CURRENT_NAME="$name" CURRENT_LIMIT="$limit"
  export CURRENT_LIMIT
  start=$(date +%s)
  # timeout runs the section in a process group of its own (TERM at the limit, KILL 5 s later);
  # in the background so that a signal to gpu_check is handled at once (on_signal).
  PAGEDKV_GPU_CHECK_TAG="$tag" timeout --kill-after=5 "$limit" bash -c "$fn" > "$WORK/$name.txt" 2>&1 &
  wait $!
  rc=$?
  leftover=$(sweep "$tag")
  CURRENT_TAG=""
  took=$(( $(date +%s) - start ))
  if [ "$leftover" -gt 0 ]; then echo "gpu_check: stopped $leftover process(es) the section left running" >> "$WORK/$name.txt"; fi
  verdict="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"; elif [ "$rc" -ne 0 ]; then verdict="FAILED (rc=$rc)"; fi
  tail -n 15 "$WORK/$name.txt"
  echo "=== [$name] $verdict in ${took}s"
  STATUS+=("| $name | $verdict$mode | ${took}s | ${limit}s |")
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
print("python", sys.version.split()[0], sys.executable)
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
# What is really imported (the wheelhouse's copy or the image's): version and file.
try:
    import google.protobuf
    print("google.protobuf.__version__", google.protobuf.__version__, "from", google.protobuf.__file__)
except ImportError as e:
    print("google.protobuf: not importable:", e)
try:
    import grpc
    print("grpc", grpc.__version__, "from", grpc.__file__)
except ImportError as e:
    print("grpc: not importable:", e)
EOF
    if [ "$HAS_GPU" = 1 ]; then
      "$PY" -c 'import torch; print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0), "sms", torch.cuda.get_device_properties(0).multi_processor_count)'
    else
      echo "cuda: no GPU"
    fi
  } > "$WORK/versions.txt" 2>&1
  cat "$WORK/versions.txt"
}

# --- wheels: the services' dependencies, offline, into $PYDEPS; then every import, clean -----------
wheels_section() {
  if [ ! -f "$WHEELHOUSE/requirements.txt" ]; then
    echo "no wheelhouse at $WHEELHOUSE (tools/gpu_wheels.sh builds it; docs/gpu.md: carry it)"
    if [ "$REHEARSE" = 0 ]; then
      echo "full mode: the image lacks the services' dependencies, so the wheelhouse is required"
      return 1
    fi
    echo "rehearsal: checking the imports with what $PY has"
  else
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELHOUSE" \
      --target "$PYDEPS" --upgrade -r "$WHEELHOUSE/requirements.txt" || return 1
  fi
  # A clean interpreter: no user site, no inherited PYTHON* variables, PYTHONPATH = the checkout +
  # $PYDEPS only; PATH and the library path pass through (the image's CUDA libraries, not packages).
  local gpu_flag=""
  [ "$HAS_GPU" = 1 ] && gpu_flag="--gpu"
  # shellcheck disable=SC2086
  env -i PATH="$PATH" HOME="${HOME:-/tmp}" LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \
    PAGEDKV_GPU_CHECK_TAG="$PAGEDKV_GPU_CHECK_TAG" PYTHONPATH="$ROOT:$PYDEPS" "$PY" -s bench/gpu_imports.py $gpu_flag
}

# --- pytest: the kernel tests compiled on CUDA (bf16 included), and real CUDA graphs -------------
# test_compile_sm90 is deselected: here every test compiles for the real device anyway (it runs in
# CPU CI); the interpreter smoke test skips itself on CUDA. --dist loadfile: one file's tests on one
# worker, so a kernel is compiled once, not on every worker at once (a cold Triton cache).
# GRAPHS_TEST: decode steps replayed from captured CUDA graphs give the eager greedy tokens.
GRAPHS_TEST="tests/worker_svc/test_cuda_graphs.py::test_graphs_give_the_eager_greedy_tokens_on_cuda"
pytest_args() {
  local xdist=""
  if "$PY" -c "import xdist" >/dev/null 2>&1; then xdist="-n $1 --dist loadfile"; fi
  echo "tests/kernels $GRAPHS_TEST -q -ra -p no:cacheprovider $xdist -o console_output_style=classic"
}
pytest_section() {
  # shellcheck disable=SC2046
  "$PY" -m pytest $(pytest_args "${PYTEST_WORKERS:-4}") -k "not compile_sm90" --junitxml="$WORK/junit.xml"
}
pytest_section_rehearse() {  # the same selection and flags, collected (imports, -k, xdist options)
  # shellcheck disable=SC2046
  "$PY" -m pytest $(pytest_args 0) -k "not compile_sm90" --collect-only
}

# --- ipc: one cache shared by two processes over CUDA IPC -----------------------------------------
IPC_TEST="tests/worker_svc/test_cache_memory.py::test_cuda_ipc_round_trip_across_processes"
ipc_section() { "$PY" -m pytest -q -ra -p no:cacheprovider "$IPC_TEST"; }
ipc_section_rehearse() {  # the test id must still exist: exactly one test collected
  "$PY" -m pytest -q -p no:cacheprovider --collect-only "$IPC_TEST" > "$WORK/ipc_collect.txt" 2>&1
  cat "$WORK/ipc_collect.txt"
  grep -q "^1 test collected" "$WORK/ipc_collect.txt"
}

# --- bench: kernels vs contiguous SDPA and copy bandwidth ----------------------------------------
# bf16 only (the models' dtype on CUDA); the budget is shared by kernel_bench's sections, so the
# decode grid cannot starve the prefill rows.
bench_section() {
  # shellcheck disable=SC2086
  "$PY" bench/kernel_bench.py --out "$WORK" --dtypes bfloat16 --time-budget "${BENCH_BUDGET_S:-50}" ${BENCH_ARGS:-}
}
bench_section_rehearse() {
  # shellcheck disable=SC2086
  TRITON_INTERPRET=1 "$PY" bench/kernel_bench.py --smoke --out "$WORK" --dtypes float32 \
    --time-budget "${BENCH_BUDGET_S:-50}" ${BENCH_ARGS:-}
}

# --- worker: cache host + two workers over CUDA IPC, tokens vs one process; decode throughput -----
worker_section() {
  # shellcheck disable=SC2086
  "$PY" bench/gpu_worker_check.py --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${WORKER_ARGS:-}
}
worker_section_rehearse() {
  # shellcheck disable=SC2086
  "$PY" bench/gpu_worker_check.py --device cpu --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${WORKER_ARGS:-}
}

# --- graphs: decode step time, eager vs CUDA graphs, side by side -------------------------------
graphs_section() {
  # shellcheck disable=SC2086
  "$PY" bench/cuda_graph_bench.py --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${GRAPHS_ARGS:-}
}
graphs_section_rehearse() {  # the same flow on CPU, a tiny model; the "graphs" column replays eagerly
  # shellcheck disable=SC2086
  "$PY" bench/cuda_graph_bench.py --device cpu --context 64 --steps 10 --out "$WORK" \
    --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${GRAPHS_ARGS:-}
}

# --- pd: the worker layouts (mixed x1, prefill + decode) on one GPU, one cache --------------------
# The short form (bench/gpu_pd_check.py --short): a small model, two layouts, no --overlap.
# shellcheck disable=SC2086
pd_section() { "$PY" bench/gpu_pd_check.py --short ${PD_ARGS:-}; }
# The rehearsal: the same layouts and stacks on CPU with a model and workload a CPU gets through.
# shellcheck disable=SC2086
pd_section_rehearse() {
  "$PY" bench/gpu_pd_check.py --short --device cpu --dtype float32 --hidden 128 --layers 2 --vocab 1024 \
    --decoders 4 --decode-tokens 8 --long 1 --long-prompt 128 --num-gpu-blocks 256 --x1-threads all ${PD_ARGS:-}
}

export -f env_section wheels_section pytest_args pytest_section pytest_section_rehearse ipc_section \
  ipc_section_rehearse bench_section bench_section_rehearse worker_section worker_section_rehearse \
  graphs_section graphs_section_rehearse pd_section pd_section_rehearse
export PY WORK WHEELHOUSE PYDEPS HAS_GPU REHEARSE ROOT IPC_TEST GRAPHS_TEST
# wheels first, so that env records the versions the sections will really import
run_section wheels "${WHEELS_TIMEOUT_S:-40}" 0 wheels_section
run_section env "${ENV_TIMEOUT_S:-20}" 0 env_section
run_section pytest "${PYTEST_TIMEOUT_S:-110}" 1 pytest_section
run_section ipc "${IPC_TIMEOUT_S:-40}" 1 ipc_section
run_section bench "${BENCH_TIMEOUT_S:-70}" 1 bench_section
run_section worker "${WORKER_TIMEOUT_S:-50}" 1 worker_section
run_section graphs "${GRAPHS_TIMEOUT_S:-40}" 1 graphs_section
run_section pd "${PD_TIMEOUT_S:-85}" 1 pd_section

publish
cat "$OUT/status.md"
cat "$OUT/results.md"
RC=0
if printf '%s\n' "${STATUS[@]}" | grep -qE 'FAILED|TIMEOUT|deadline|KILLED'; then RC=1; fi
if [ "$HAS_GPU" = 0 ] && [ "$REHEARSE" = 0 ]; then echo "no GPU: nothing was measured" >&2; RC=1; fi
exit "$RC"
