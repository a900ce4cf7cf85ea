#!/usr/bin/env bash
# One-call GPU check: every GPU number pagedkv needs, in one shot of at most 7 minutes.
#
#   bash bench/gpu_check.sh              # on the GPU machine, from anywhere (repo = this checkout)
#   bash bench/gpu_check.sh --rehearse   # on CPU, in an interpreter holding only what the image holds
#
# Built for a borrowed machine (docs/gpu.md): python3 with torch/triton/numpy/cupy preinstalled, no
# network, at most 8 files brought back from $OUT. So:
# - preflight first (seconds): the wheelhouse (tools/gpu_wheels.sh) installs offline into $PYDEPS
#   (put on PYTHONPATH), then bench.gpu.preflight in a clean interpreter: every module the sections
#   import (bench.gpu.imports), pytest and xdist, a C compiler and Python.h, one tiny Triton kernel,
#   one IPC round trip between two processes, GPU detection. A failed preflight stops the run at once
#   with its reason: a broken environment costs seconds, not the budget;
# - one global deadline (DEADLINE_S, default 420 s): each section's timeout is clamped to what is
#   left (minus RESERVE_S for packing); a section with no time left is SKIPPED (deadline); every
#   section's timeout is at least 1.5x its measured rehearsal time (docs/gpu.md has the times);
# - $OUT only ever holds three plain files, rewritten after EVERY section (a run cut short still
#   brings back what finished): status.md (the status table + versions), results.md (every result
#   table so far) and gpu_check.tar.gz (all raw logs, junit, JSON);
# - GPU detection: nvidia-smi when it is there (instant when there is no driver), and in any case
#   torch.cuda.is_available(): an image without nvidia-smi still counts its GPU;
# - the GPU sections need a CUDA device; without one they report "no GPU" and the script exits 1,
#   unless --rehearse;
# - --rehearse runs every section for real on CPU, under the SAME timeouts, in an interpreter that
#   has what the GPU image has and nothing else (PYTHON; default .gpu_image/bin/python, made by
#   `python -m bench.gpu.image_venv` from the project venv when missing) plus the wheelhouse built
#   for it (WHEELHOUSE; default .gpu_wheels_native, made by `tools/gpu_wheels.sh --native` when
#   missing): the kernel tests and the CUDA-graph test run (interpreter; the CUDA-only ones skip),
#   ipc runs the IPC test module, bench runs kernel_bench --smoke, worker/graphs/pd/mps run their
#   --device cpu forms. A missing wheel, a broken import, a section over budget or a leftover
#   process fails here first;
# - every section runs in its own process group with PAGEDKV_GPU_CHECK_TAG=<run>-<section> in its
#   environment; when it ends (done, timed out, or gpu_check itself is stopped) every process still
#   carrying the tag gets SIGTERM, then SIGKILL after 5 s: services that started sessions of their
#   own (frontend/launch/processes.py) cannot outlive their section and keep holding GPU memory;
# - a section that exits 3 is SKIPPED with the reason its log ends with (mps where the container
#   cannot run the MPS daemon): not a failure.
#
# Sections and their default timeouts (env knobs, seconds; their sum fits the 420 s deadline):
#   preflight 20 (PREFLIGHT_TIMEOUT_S), env 5 (ENV_TIMEOUT_S), pytest 90 (PYTEST_TIMEOUT_S),
#   ipc 45 (IPC_TIMEOUT_S), bench 50 (BENCH_TIMEOUT_S; BENCH_BUDGET_S 35 shared by its sections),
#   worker 55 (WORKER_TIMEOUT_S), graphs 30 (GRAPHS_TIMEOUT_S), pd 65 (PD_TIMEOUT_S),
#   mps 40 (MPS_TIMEOUT_S): 400 s, the rest of the 420 s for gpu_check's own work between them.
# Other knobs: PYTHON (python3), OUT (results/gpu_check), WHEELHOUSE (.gpu_wheels), PYDEPS
# (.gpu_pydeps), PYTEST_WORKERS (4), BENCH_ARGS, WORKER_ARGS, GRAPHS_ARGS, PD_ARGS, MPS_ARGS,
# GPU_CHECK_ONLY (comma-separated sections to run; preflight always runs, the others read "not
# selected"), GPU_CHECK_RUN_ID (the tag's run part; default this script's PID), REHEARSAL_SLACK
# (whole number, default 1: under --rehearse, every timeout and the deadline are multiplied by it;
# only for a CPU shared with other work, e.g. CI on 2 loaded cores; the status says so when not 1).
set -uo pipefail

REHEARSE=0
for a in "$@"; do
  case "$a" in
    --rehearse) REHEARSE=1 ;;
    *) echo "usage: $0 [--rehearse]" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT="$PWD"
DEADLINE_S="${DEADLINE_S:-420}"
SLACK=1
if [ "$REHEARSE" = 1 ]; then SLACK="${REHEARSAL_SLACK:-1}"; fi
DEADLINE_S=$(( DEADLINE_S * SLACK ))
RESERVE_S="${RESERVE_S:-5}"
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
if [ "$REHEARSE" = 1 ]; then
  # The rehearsal's interpreter and wheelhouse: what the image has, plus the wheels for it.
  PY="${PYTHON:-$ROOT/.gpu_image/bin/python}"
  WHEELHOUSE="${WHEELHOUSE:-.gpu_wheels_native}"
  if [ -z "${PYTHON:-}" ] && [ ! -x "$PY" ]; then
    echo "=== building the image-like interpreter: .venv/bin/python -m bench.gpu.image_venv .gpu_image"
    "$ROOT/.venv/bin/python" -m bench.gpu.image_venv "$ROOT/.gpu_image" || exit 2
  fi
  case "$WHEELHOUSE" in /*) ;; *) WHEELHOUSE="$ROOT/$WHEELHOUSE" ;; esac
  if [ ! -f "$WHEELHOUSE/requirements.txt" ] && [ -z "${GPU_CHECK_NO_BUILD:-}" ]; then
    echo "=== building the rehearsal's wheelhouse: tools/gpu_wheels.sh --native $WHEELHOUSE"
    bash "$ROOT/tools/gpu_wheels.sh" --native "$WHEELHOUSE" || exit 2
  fi
else
  PY="${PYTHON:-python3}"
  WHEELHOUSE="${WHEELHOUSE:-.gpu_wheels}"
fi
T0=$(date +%s)
PYDEPS="${PYDEPS:-.gpu_pydeps}"
case "$WHEELHOUSE" in /*) ;; *) WHEELHOUSE="$ROOT/$WHEELHOUSE" ;; esac
case "$PYDEPS" in /*) ;; *) PYDEPS="$ROOT/$PYDEPS" ;; esac
RUN_ID="${GPU_CHECK_RUN_ID:-$$}"
ONLY="${GPU_CHECK_ONLY:-}"
# The inherited PYTHONPATH stays last: every section (and every subprocess it starts) imports the
# checkout and the installed wheelhouse first.
export PYTHONPATH="$ROOT:$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$WORK/triton-cache"   # a fresh cache: every compile is really done here
unset TRITON_INTERPRET PAGEDKV_KERNEL_BACKEND

declare -a STATUS=()
# GPU detection: nvidia-smi when the image has it (instant "no" without a driver); torch decides.
detect_gpu() {
  if command -v nvidia-smi >/dev/null 2>&1 && ! nvidia-smi -L >/dev/null 2>&1; then return 1; fi
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
HAS_GPU=0
if detect_gpu; then HAS_GPU=1; fi
STOPPED=""  # set when preflight fails: the reason every later section did not run

remaining() { echo $(( DEADLINE_S - ($(date +%s) - T0) - RESERVE_S )); }

# publish: rewrite status.md, results.md and the tarball in $OUT from what exists so far.
publish() {
  {
    echo "# gpu_check status"
    echo
    echo "mode: $([ "$REHEARSE" = 1 ] && echo rehearsal || echo full); GPU: $([ "$HAS_GPU" = 1 ] && echo yes || echo 'no GPU');" \
      "elapsed $(( $(date +%s) - T0 )) s of a ${DEADLINE_S} s deadline$([ "$SLACK" != 1 ] && echo "; every budget x$SLACK (REHEARSAL_SLACK)")"
    echo "python: $PY; wheelhouse: $WHEELHOUSE"
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
      echo; echo "## worker layouts on one GPU (bench/gpu/pd_check.py)"; echo
      grep -E '^(model|\|)' "$WORK/pd.txt"
    fi
    if grep -q '^## prefill + decode' "$WORK/mps.txt" 2>/dev/null; then
      echo; grep -E '^(## prefill \+ decode|\||MPS)' "$WORK/mps.txt"
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

selected() { [ "$1" = preflight ] || [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# run_section NAME TIMEOUT_S NEEDS_GPU FUNCTION: run FUNCTION (or, for a GPU section without a GPU
# under --rehearse, FUNCTION_rehearse) in its own process group under min(TIMEOUT_S, time left), log
# to $WORK/NAME.txt, sweep what it left running, record the outcome, publish.
run_section() {
  local name="$1" want=$(( $2 * SLACK )) needs_gpu="$3" fn="$4"
  local left limit start rc took verdict tag leftover mode=""
  if [ -n "$STOPPED" ]; then
    STATUS+=("| $name | not run ($STOPPED) | 0s | ${want}s |")
    publish
    return
  fi
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
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"
  elif [ "$rc" -eq 3 ]; then verdict="SKIPPED: $(tail -n 1 "$WORK/$name.txt" | tr '|' '/' | cut -c1-200)"
  elif [ "$rc" -ne 0 ]; then verdict="FAILED (rc=$rc)"; fi
  tail -n 15 "$WORK/$name.txt"
  echo "=== [$name] $verdict in ${took}s"
  STATUS+=("| $name | $verdict$mode | ${took}s | ${limit}s |")
  if [ "$name" = preflight ] && [ "$verdict" != ok ]; then
    STOPPED="preflight failed"
    STATUS+=("| | preflight: $(grep -E '^(preflight failed|no wheelhouse|pip)' "$WORK/$name.txt" | tail -n 1 | tr '|' '/' | cut -c1-300) | | |")
  fi
  publish
}

# A clean interpreter: no user site, no inherited PYTHON* variables, PYTHONPATH = the checkout +
# $PYDEPS only; PATH and the library path pass through (the image's CUDA libraries, not packages).
clean_python() {
  env -i PATH="$PATH" HOME="${HOME:-/tmp}" LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" ${CC:+CC="$CC"} \
    PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 TRITON_CACHE_DIR="$TRITON_CACHE_DIR" \
    PAGEDKV_GPU_CHECK_TAG="$PAGEDKV_GPU_CHECK_TAG" PYTHONPATH="$ROOT:$PYDEPS" "$PY" -s "$@"
}

# --- preflight: the wheelhouse installs offline; then every import, the compiler, Triton, IPC -----
preflight_section() {
  if [ ! -f "$WHEELHOUSE/requirements.txt" ]; then
    echo "no wheelhouse at $WHEELHOUSE: the image lacks the sections' dependencies" \
      "(tools/gpu_wheels.sh builds it; docs/gpu.md: carry it)"
    return 1
  fi
  local t0=$SECONDS
  echo "installing $(grep -c . "$WHEELHOUSE/requirements.txt") requirements from $WHEELHOUSE into $PYDEPS (offline)"
  "$PY" -m pip install --quiet --no-compile --disable-pip-version-check --no-index --find-links "$WHEELHOUSE" \
    --target "$PYDEPS" --upgrade -r "$WHEELHOUSE/requirements.txt" \
    || { echo "pip could not install the wheelhouse offline: see above"; return 1; }
  echo "ok install ($(( SECONDS - t0 ))s)"
  if [ "$HAS_GPU" = 1 ]; then clean_python -m bench.gpu.preflight --gpu; else clean_python -m bench.gpu.preflight; fi
}

# --- env: versions of everything that matters ---------------------------------------------------
env_section() {
  {
    echo "kernel $(uname -r)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null \
      || echo "nvidia-smi: not available"
    # Versions from package metadata (no imports: fast), as the sections will see them (PYTHONPATH).
    "$PY" - <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
print("python", sys.version.split()[0], sys.executable)
for label, dists in (("torch", ["torch"]), ("triton", ["triton"]), ("cupy", ["cupy-cuda13x", "cupy-cuda12x", "cupy"]),
                     ("numpy", ["numpy"]), ("grpcio", ["grpcio"]), ("protobuf", ["protobuf"]), ("pytest", ["pytest"]),
                     ("pytest-xdist", ["pytest-xdist"]), ("pytest-timeout", ["pytest-timeout"]),
                     ("structlog", ["structlog"]), ("pydantic", ["pydantic"]),
                     ("pydantic-settings", ["pydantic-settings"]), ("grpcio-status", ["grpcio-status"]),
                     ("googleapis-common-protos", ["googleapis-common-protos"]), ("safetensors", ["safetensors"])):
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
PYEOF
    if [ "$HAS_GPU" = 1 ]; then
      "$PY" -c 'import torch; print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0), "sms", torch.cuda.get_device_properties(0).multi_processor_count)'
    else
      echo "cuda: no GPU"
    fi
  } > "$WORK/versions.txt" 2>&1
  cat "$WORK/versions.txt"
}

# --- pytest: the kernel tests compiled on CUDA (bf16 included), and real CUDA graphs -------------
# test_compile_sm90 is deselected: here every test compiles for the real device anyway (it runs in
# CPU CI). --dist loadfile: one file's tests on one worker, so a kernel is compiled once, not on
# every worker at once (a cold Triton cache). GRAPHS_TEST: decode steps replayed from captured CUDA
# graphs give the eager greedy tokens (over model-dtype, int8 and fp8_e4m3 caches: all its cases). The rehearsal runs the same selection for real on CPU (the
# Triton interpreter; the CUDA-only tests skip themselves), with as many workers as there are CPUs,
# each test function once (bench/gpu/one_case.py: its first case; the interpreter's numerics for
# every case take minutes on two cores).
GRAPHS_TEST="tests/worker_svc/model/test_cuda_graphs.py::test_graphs_give_the_eager_greedy_tokens_on_cuda"
pytest_run() {
  local workers="$1"; shift
  "$PY" -m pytest tests/kernels "$GRAPHS_TEST" -q -ra -p no:cacheprovider -n "$workers" --dist loadfile \
    -o console_output_style=classic -k "not compile_sm90" --junitxml="$WORK/junit.xml" --durations=10 "$@"
}
pytest_section() { pytest_run "${PYTEST_WORKERS:-4}"; }
pytest_section_rehearse() { pytest_run "${PYTEST_WORKERS:-$(nproc)}" -p bench.gpu.one_case; }

# --- ipc: one cache shared by two processes over CUDA IPC -----------------------------------------
# The rehearsal runs the whole module (each test function once, bench/gpu/one_case.py): the CUDA
# test skips itself, the shared-memory stand-in's cross-process tests run; the CUDA test id must
# still exist (exactly one test collected).
IPC_TEST="tests/worker_svc/cache/test_memory.py::test_cuda_ipc_round_trip_across_processes"
ipc_section() { "$PY" -m pytest -q -ra -p no:cacheprovider "$IPC_TEST"; }
ipc_section_rehearse() {
  "$PY" -m pytest -q -p no:cacheprovider --collect-only "$IPC_TEST" > "$WORK/ipc_collect.txt" 2>&1
  cat "$WORK/ipc_collect.txt"
  grep -q "^1 test collected" "$WORK/ipc_collect.txt" || return 1
  "$PY" -m pytest -q -ra -p no:cacheprovider -p bench.gpu.one_case "${IPC_TEST%%::*}"
}

# --- bench: kernels vs contiguous SDPA and copy bandwidth ----------------------------------------
# bf16 only (the models' dtype on CUDA); the budget is shared by kernel_bench's sections, so the
# decode grid cannot starve the prefill rows.
bench_section() {
  # shellcheck disable=SC2086
  "$PY" -m bench.kernel_bench --out "$WORK" --dtypes bfloat16 --time-budget "${BENCH_BUDGET_S:-35}" ${BENCH_ARGS:-}
}
bench_section_rehearse() {
  # shellcheck disable=SC2086
  TRITON_INTERPRET=1 "$PY" -m bench.kernel_bench --smoke --out "$WORK" --dtypes float32 \
    --time-budget "${BENCH_BUDGET_S:-35}" ${BENCH_ARGS:-}
}

# --- worker: cache host + two workers over CUDA IPC, tokens vs one process; decode throughput -----
worker_section() {
  # shellcheck disable=SC2086
  "$PY" -m bench.gpu.worker_check --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${WORKER_ARGS:-}
}
worker_section_rehearse() {
  # shellcheck disable=SC2086
  "$PY" -m bench.gpu.worker_check --device cpu --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${WORKER_ARGS:-}
}

# --- graphs: decode step time, eager vs CUDA graphs, side by side -------------------------------
graphs_section() {
  # shellcheck disable=SC2086
  "$PY" -m bench.cuda_graph_bench --out "$WORK" --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${GRAPHS_ARGS:-}
}
graphs_section_rehearse() {  # the same flow on CPU, a tiny model; the "graphs" column replays eagerly
  # shellcheck disable=SC2086
  "$PY" -m bench.cuda_graph_bench --device cpu --context 64 --steps 10 --out "$WORK" \
    --deadline-s "$(( CURRENT_LIMIT - 5 ))" ${GRAPHS_ARGS:-}
}

# --- pd: the worker layouts (mixed x1, prefill + decode) on one GPU, one cache --------------------
# The short form (bench.gpu.pd_check --short): a small model, two layouts, no --overlap.
# shellcheck disable=SC2086
pd_section() { "$PY" -m bench.gpu.pd_check --short ${PD_ARGS:-}; }
# The rehearsal: the same layouts and stacks on CPU with a model and workload a CPU gets through.
# shellcheck disable=SC2086
pd_section_rehearse() {
  "$PY" -m bench.gpu.pd_check --short --device cpu --dtype float32 --hidden 128 --layers 2 --vocab 1024 \
    --decoders 4 --decode-tokens 8 --long 1 --long-prompt 128 --num-gpu-blocks 256 --x1-threads all ${PD_ARGS:-}
}

# --- mps: the prefill + decode layout under a private MPS control daemon ---------------------------
# Exit 3 (SKIPPED, with the reason) when the container cannot run the daemon.
# shellcheck disable=SC2086
mps_section() { "$PY" -m bench.gpu.mps ${MPS_ARGS:-}; }
# shellcheck disable=SC2086
mps_section_rehearse() {
  "$PY" -m bench.gpu.mps --device cpu --hidden 128 --layers 2 --vocab 1024 --decoders 4 --decode-tokens 8 \
    --long 1 --long-prompt 128 --num-gpu-blocks 256 ${MPS_ARGS:-}
}

export -f clean_python preflight_section env_section pytest_run pytest_section pytest_section_rehearse \
  ipc_section ipc_section_rehearse bench_section bench_section_rehearse worker_section \
  worker_section_rehearse graphs_section graphs_section_rehearse pd_section pd_section_rehearse \
  mps_section mps_section_rehearse
export PY WORK WHEELHOUSE PYDEPS HAS_GPU REHEARSE ROOT IPC_TEST GRAPHS_TEST TRITON_CACHE_DIR
# preflight first (it installs the wheelhouse), so that env records the versions the sections import
run_section preflight "${PREFLIGHT_TIMEOUT_S:-20}" 0 preflight_section
run_section env "${ENV_TIMEOUT_S:-5}" 0 env_section
run_section pytest "${PYTEST_TIMEOUT_S:-90}" 1 pytest_section
run_section ipc "${IPC_TIMEOUT_S:-45}" 1 ipc_section
run_section bench "${BENCH_TIMEOUT_S:-50}" 1 bench_section
run_section worker "${WORKER_TIMEOUT_S:-55}" 1 worker_section
run_section graphs "${GRAPHS_TIMEOUT_S:-30}" 1 graphs_section
run_section pd "${PD_TIMEOUT_S:-65}" 1 pd_section
run_section mps "${MPS_TIMEOUT_S:-40}" 1 mps_section

publish
cat "$OUT/status.md"
cat "$OUT/results.md"
RC=0
if printf '%s\n' "${STATUS[@]}" | grep -qE 'FAILED|TIMEOUT|deadline|KILLED|not run'; then RC=1; fi
if [ "$HAS_GPU" = 0 ] && [ "$REHEARSE" = 0 ]; then echo "no GPU: nothing was measured" >&2; RC=1; fi
exit "$RC"
