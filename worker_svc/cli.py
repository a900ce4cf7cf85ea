"""``pagedkv cache-host`` and ``pagedkv worker``: flags -> settings -> run.

Flags and environment variables come from the settings classes (pagedkv/settings_cli.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pagedkv.settings_cli import load_settings
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings


def cache_host_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pagedkv cache-host``."""
    from pagedkv.worker_svc.server import run_cache_host

    settings = load_settings(
        CacheHostSettings,
        sys.argv[1:] if argv is None else argv,
        "pagedkv cache-host",
        "Allocate the shared KV cache (all layers + CPU swap pool) once and export it to workers "
        "(CUDA IPC on a GPU, POSIX shared memory on CPU).",
    )
    return run_cache_host(settings)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pagedkv worker``."""
    from pagedkv.worker_svc.server import run_worker

    settings = load_settings(
        WorkerSettings,
        sys.argv[1:] if argv is None else argv,
        "pagedkv worker",
        "Attach to the cache host's KV cache and serve the Worker API (cache ops + forward pass).",
    )
    return run_worker(settings)
