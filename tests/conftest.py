"""Suite-wide test setup.

Triton reads TRITON_INTERPRET when its @triton.jit decorators run, so it must
be set before anything imports `pagedkv.kernels`. Without a GPU the Triton kernels run
in the interpreter; code that wants the fast torch reference on CPU selects it
explicitly (see kernels' backend selection).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The suite's processes share the cores: xdist's workers side by side, and beside them the stacks
# the slow tests start. GNU OpenMP (torch's runtime, and the native kernels') keeps a finished
# parallel region's threads spinning for the next one; a spinning thread holds a core another test
# process is waiting for, and the fast tier took half again as long for it. So this process's
# runtime sleeps as soon as it is idle: OMP_WAIT_POLICY=passive, read once when torch loads the
# runtime (below), then taken out of the environment again, so that the processes the tests start
# (workers, benchmarks) run with the product's own settings. A value set outside is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "passive"
    try:
        import torch  # noqa: F401 - loads the OpenMP runtime while the variable is set
    except ImportError:
        pass
    del os.environ["OMP_WAIT_POLICY"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Services log through structlog; send it to stderr like the real processes do
# (structlog's unconfigured default writes to stdout). Optional: a GPU image without the service
# dependencies (no structlog) must still collect and run tests/kernels.
try:
    import structlog  # noqa: F401
except ImportError:
    structlog = None
if structlog is not None:
    from pagedkv.logging_setup import configure_logging

    configure_logging("info", "console", cache=False)


# The fast tier (`make test-fast`, `pytest -m "not slow"`): everything but the modules below and
# tests/bench/, which start process stacks (block manager, cache host, workers, serve), kill and
# restart them, compile kernels ahead of time, or run a benchmark script. One list, here: a module
# that starts processes belongs in it. `make test` (CI) runs every test, these included.
SLOW_MODULES = frozenset(
    {
        "tests/block_manager_svc/reliability/test_faults.py",
        "tests/clients/test_instructor.py",
        "tests/clients/test_langchain.py",
        "tests/clients/test_openai_agents.py",
        "tests/frontend/engine/test_block_manager_faults.py",
        "tests/frontend/engine/test_cache_host_recovery.py",
        "tests/frontend/launch/test_cli_stack.py",
        "tests/frontend/apps/test_demo_text.py",
        "tests/frontend/launch/test_layouts.py",
        "tests/frontend/engine/test_model_families.py",
        "tests/frontend/serve/test_real_model.py",
        "tests/frontend/serve/test_gemma3_real_model.py",
        "tests/frontend/serve/test_structured_output_real.py",
        "tests/frontend/serve/test_serve_errors.py",
        "tests/frontend/serve/test_serve_faults.py",
        "tests/frontend/serve/test_serve_sampling.py",
        "tests/frontend/serve/test_speculative_real_model.py",
        "tests/frontend/engine/test_shared_block_manager.py",
        "tests/frontend/launch/test_up_supervision.py",
        "tests/frontend/engine/test_worker_faults.py",
        "tests/kernels/test_bench_smoke.py",
        "tests/kernels/test_compile_sm90.py",
        "tests/kernels/test_gpu_selection.py",
        "tests/pagedkv/test_cpu_runtime.py",
        "tests/security/test_fuzz.py",
        "tests/security/test_outbound_tls.py",
        "tests/security/test_secure_stack.py",
        "tests/test_installed_name.py",
        "tests/worker_svc/test_cache_host_loss.py",
        "tests/worker_svc/model/test_gguf.py",
        "tests/worker_svc/test_omp_spin.py",
        "tests/worker_svc/test_processes.py",
        "tests/worker_svc/test_reattach.py",
        "tests/worker_svc/cache/test_shared_weights.py",
        "tests/worker_svc/test_step_channel_processes.py",
    }
)


# The slow modules that time something against a clock (deadlines, keepalives, lease TTLs, restart
# budgets, fault schedules, bench budgets): marked `timed`. `make test` runs them in one process at
# normal priority with nothing else at that priority. The other slow modules only check results
# (with generous ready/call timeouts), so `make test` runs them beside the timed ones under
# `nice -n 19` (they take the CPU the timed ones leave), a whole module per process over TEST_JOBS
# processes (`--dist loadfile`: a module's shared stack is started once). A new slow module that
# asserts on elapsed time belongs here.
TIMED_MODULES = frozenset(
    {
        "tests/bench/test_batch1_breakdown_smoke.py",
        "tests/bench/test_kernel_bench_budget.py",
        "tests/bench/test_serve_gray_faults.py",
        "tests/block_manager_svc/reliability/test_faults.py",
        "tests/frontend/engine/test_block_manager_faults.py",
        "tests/frontend/engine/test_cache_host_recovery.py",
        "tests/frontend/engine/test_shared_block_manager.py",
        "tests/frontend/engine/test_worker_faults.py",
        "tests/frontend/launch/test_up_supervision.py",
        "tests/frontend/serve/test_serve_errors.py",
        "tests/frontend/serve/test_serve_faults.py",
        "tests/worker_svc/test_cache_host_loss.py",
        "tests/worker_svc/test_omp_spin.py",
        "tests/worker_svc/test_reattach.py",
        "tests/worker_svc/test_step_channel_processes.py",
    }
)


# The timed modules that measure CPU time itself (a runtime's spinning threads, a step's breakdown
# into its parts): a niced neighbour still takes what a spinning or yielding thread gives up, so
# `make test` runs these (marked `alone` as well) after everything else, with the machine to itself.
ALONE_MODULES = frozenset(
    {
        "tests/bench/test_batch1_breakdown_smoke.py",
        "tests/worker_svc/test_omp_spin.py",
    }
)
assert ALONE_MODULES <= TIMED_MODULES


# The results-only slow modules that only compute (no process stack, no timeout shorter than ten
# minutes that a starved process could run into): marked `early`. `make test` starts them under
# `nice -n 19` at the same time as mypy and the fast tier, to use the CPU those leave idle.
EARLY_MODULES = frozenset(
    {
        "tests/kernels/test_compile_sm90.py",
        "tests/kernels/test_gpu_selection.py",
    }
)
assert EARLY_MODULES <= SLOW_MODULES and not EARLY_MODULES & TIMED_MODULES


# The longest modules (an ahead-of-time compile of every kernel configuration, real models against
# transformers): `make test` runs them first, then the other slow modules, then the fast ones, so a
# long module never starts last while the other processes have run out of work.
LONGEST_MODULES = (
    "tests/kernels/test_compile_sm90.py",
    "tests/bench/test_gpu_check.py",
    "tests/frontend/serve/test_speculative_real_model.py",
    "tests/frontend/serve/test_gemma3_real_model.py",
    "tests/frontend/serve/test_real_model.py",
    "tests/frontend/serve/test_structured_output_real.py",
)


def pytest_configure(config: object) -> None:
    config.addinivalue_line(  # type: ignore[attr-defined]
        "markers",
        "timed: a slow test timed against a clock; `make test` runs these serially (niced work beside)",
    )
    config.addinivalue_line(  # type: ignore[attr-defined]
        "markers", "early: a results-only slow test that only computes; `make test` starts these first, niced"
    )
    config.addinivalue_line(  # type: ignore[attr-defined]
        "markers", "alone: a timed test measuring CPU time; `make test` runs these last, on an idle machine"
    )


def _module_marks(rel: str) -> dict[str, bool]:
    """The marks this file gives every test of the module at `rel` (relative to the repository)."""
    return {
        "slow": rel.startswith("tests/bench/") or rel in SLOW_MODULES,
        "timed": rel in TIMED_MODULES,
        "alone": rel in ALONE_MODULES,
        "early": rel in EARLY_MODULES,
    }


class _NotAModuleMark(Exception):
    """An ``-m`` expression names a mark this file does not give whole modules."""


def _matcher(values: dict[str, bool]) -> Callable[..., bool]:
    """An ``-m`` matcher for a module with these marks; another mark name raises _NotAModuleMark."""

    def match(name: str, /, **_: str | int | bool | None) -> bool:
        if name not in values:
            raise _NotAModuleMark(name)
        return values[name]

    return match


def pytest_ignore_collect(collection_path: pathlib.Path, config: object) -> bool | None:
    """Skip importing a test module none of whose tests the run's ``-m`` expression can select.

    Why: every run of `make test` selects by these marks, and collecting means importing: the run
    of the 3 `alone` tests would first import every other test module. Only expressions over the
    marks this file gives whole modules are judged (with pytest's own ``-m`` parser); anything
    else collects as usual."""
    from _pytest.mark.expression import Expression

    expr = config.getoption("markexpr")  # type: ignore[attr-defined]
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        marks = _module_marks(collection_path.resolve().relative_to(ROOT).as_posix())
        compiled = Expression.compile(expr)
    except Exception:  # noqa: BLE001 - outside the repository, or a bad expression pytest reports
        return None
    # A module may also mark single tests slow (it names `mark.slow`): try it both ways there.
    marked = "mark.slow" in collection_path.read_text(encoding="utf-8")
    for slow in {marks["slow"], marks["slow"] or marked}:
        try:
            if compiled.evaluate(_matcher({**marks, "slow": slow})):
                return None
        except _NotAModuleMark:
            return None
    return True


def pytest_collection_modifyitems(config: object, items: list) -> None:  # type: ignore[type-arg]
    import pytest

    rank: dict[int, int] = {}
    for item in items:
        rel = pathlib.Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
        marks = _module_marks(rel)
        for name, on in marks.items():
            if on:
                item.add_marker(getattr(pytest.mark, name))
        longest = LONGEST_MODULES.index(rel) if rel in LONGEST_MODULES else len(LONGEST_MODULES)
        rank[id(item)] = longest if marks["slow"] else longest + 1
    items.sort(key=lambda item: rank[id(item)])  # stable: a module's tests keep their order
