"""The faster CPU runtime libraries a CPU worker process is started with: tcmalloc and Intel OpenMP.

Why: a CPU forward pass allocates and frees many short-lived tensors and runs hundreds of small
parallel regions per step. glibc's allocator and torch's GNU OpenMP are the slow choice for both;
vLLM's CPU docs ask for ``LD_PRELOAD`` of tcmalloc and ``libiomp5``. Each library shortens a
workload's wall time on its own and the two together most (``bench/vs_vllm.py`` workload A;
docs/worker.md, "CPU placement", has the figures).

A preload must be in the environment when the process starts, so the launcher (``pagedkv up``,
``frontend/launch/processes.py``) sets it for the worker processes it starts on a CPU; one started by hand, in
compose or in Kubernetes gets the same through its environment (docs/worker.md). Only libraries
that exist are named, so a machine without them runs as before: tcmalloc from the system (Debian's
``libtcmalloc-minimal4``), ``libiomp5.so`` from the ``intel-openmp`` wheel in this Python's prefix
(the ``worker`` extra installs it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pagedkv import envs

TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def intel_openmp() -> Path | None:
    """The ``intel-openmp`` wheel's ``libiomp5.so`` in this Python's prefix, if installed."""
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    return iomp if iomp.is_file() else None


def runtime_libraries() -> list[str]:
    """The tcmalloc and Intel OpenMP libraries present on this machine, in preload order."""
    found = [next((p for p in TCMALLOC_CANDIDATES if Path(p).is_file()), None)]
    iomp = intel_openmp()
    found.append(str(iomp) if iomp else None)
    return [p for p in found if p]


def preload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` naming the runtime libraries ahead of any preload already in ``base``
    (default: this process's environment); empty when none is present or all are there already.
    A library counts as there when a file of the same name is preloaded from anywhere (two copies
    of the OpenMP runtime in one process abort it)."""
    current = envs.get_str("LD_PRELOAD", base)
    have = [p for p in current.replace(" ", ":").split(":") if p]
    names = {Path(p).name for p in have}
    add = [p for p in runtime_libraries() if Path(p).name not in names]
    return {"LD_PRELOAD": ":".join(add + have)} if add else {}


def remove_openmp_registration(pid: int, shm_dir: Path = Path("/dev/shm")) -> Path | None:
    """Remove the file Intel's OpenMP runtime registered in /dev/shm for process ``pid``, which has
    exited; return it, or None when there was none (or ``pid`` runs again).

    Why: the runtime names each process that loads it in ``__KMP_REGISTERED_LIB_<pid>_<uid>`` and
    removes the file when the process exits; a process killed (SIGKILL: a fault, or a stop past its
    grace period) leaves it behind for good. The launcher calls this for each worker it reaped."""
    path = shm_dir / f"__KMP_REGISTERED_LIB_{pid}_{os.getuid()}"
    try:
        os.kill(pid, 0)
        return None  # the pid was reused: that process's file, if any, is its own
    except ProcessLookupError:
        pass
    except PermissionError:
        return None
    try:
        path.unlink()
    except OSError:
        return None
    return path
