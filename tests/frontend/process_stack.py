"""One tiny process stack for the fault tests: block manager, cache host and one worker as real
processes (``frontend/launch/processes.py``), on a random tiny Llama, with the environment the test asks
for set while it runs and restored after, and the shared memory of SIGKILLed roles removed at the end."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.processes import Stack
from pagedkv.ports import free_ports


@contextlib.contextmanager
def tiny_process_stack(
    model: str, tmp_path_factory: pytest.TempPathFactory, env: dict[str, str], **options: Any
) -> Iterator[Stack]:
    """Started and healthy on yield; ``options`` override the StackConfig below (e.g. ``state_dir``)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    bm, ch, w = free_ports(3)
    fields: dict[str, Any] = {
        "block_manager_port": bm,
        "cache_host_port": ch,
        "worker_port": w,
        "num_workers": 1,
        "num_gpu_blocks": 128,
        "num_cpu_blocks": 0,
        "block_size": 4,
        "model": model,
        "device": "cpu",
        "dtype": "float32",
        "log_dir": str(tmp_path_factory.mktemp("logs")),
        "ready_timeout_s": 90,
    }
    fields.update(options)
    s = Stack(StackConfig(**fields), out=open(os.devnull, "w"))  # noqa: SIM115
    try:
        s.start()
        yield s
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name in s.stop():  # a SIGKILLed role could not unlink its segments
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
