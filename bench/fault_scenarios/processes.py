"""Process helpers shared by the fault scenarios: a block manager as a restartable child process
(on the product's process helpers, frontend/launch/processes.py), a process's RSS, and the flags
that keep tables stable (free ports are the tree's own: pagedkv/ports.py).

Everything binds 127.0.0.1. ``FAULTS`` is the CLI module the scenarios re-run as child processes
(its ``client`` and ``vanish`` subcommands): ``python -m bench.faults``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from pagedkv.frontend.launch.processes import Service, kill, launch, terminate, wait_serving
from pagedkv.ports import free_port  # noqa: F401 - the scenarios import it from here

ROOT = Path(__file__).resolve().parents[2]
FAULTS = [sys.executable, "-m", "bench.faults"]

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --- processes --------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class ServerProcess:
    """`pagedkv block-manager` as a child process, restartable on the same port and state dir:
    started, waited for, killed and stopped the way `pagedkv up` does (frontend/launch/processes.py),
    its health asked every 10 ms so that the recovery times measure the manager, not the wait."""

    def __init__(self, port: int, args: list[str], log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.service = Service(
            name="block-manager",
            args=[
                sys.executable,
                "-m",
                "pagedkv.cli",
                "block-manager",
                "--port",
                str(port),
                "--log-format",
                "json",
                *args,
            ],
            address=f"127.0.0.1:{port}",
            health_service="pagedkv.v1.BlockManager",
        )
        self.starts = 0

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.service.process

    def start(self) -> float:
        t0 = time.perf_counter()
        launch(self.service, dict(os.environ), self.log_path)
        assert self.service.process is not None
        self.starts += 1
        wait_serving(
            self.service.address,
            self.service.health_service,
            time.monotonic() + 30.0,
            self.service.process,
            interval_s=0.01,
        )
        return time.perf_counter() - t0

    def kill(self) -> None:
        kill(self.service)

    def stop(self) -> int:
        terminate(self.service, timeout_s=20)
        return self.proc.returncode if self.proc is not None else 0

    def recoveries(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if '"state_recovered"' in line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def policy_flags() -> list[str]:
    """Flags that keep other sequences' tables stable under load (no preemption), if supported."""
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    return ["--preemption-mode", "off"] if "preemption_mode" in BlockManagerSettings.model_fields else []
