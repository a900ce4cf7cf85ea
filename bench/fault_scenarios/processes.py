"""Process helpers shared by the fault scenarios: a block manager as a restartable child process,
a process's RSS, and the flags that keep tables stable (free ports and the health wait are the
tree's own: pagedkv/ports.py, pagedkv.healthcheck.wait_healthy).

Everything binds 127.0.0.1. ``FAULTS_PY`` is the CLI the scenarios re-run as child processes (its
``client`` and ``vanish`` subcommands)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from pagedkv.healthcheck import wait_healthy
from pagedkv.ports import free_port  # noqa: F401 - the scenarios import it from here

ROOT = Path(__file__).resolve().parents[2]
FAULTS_PY = ROOT / "bench" / "faults.py"

TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --- processes --------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class ServerProcess:
    """`pagedkv block-manager` as a child process, restartable on the same port and state dir."""

    def __init__(self, port: int, args: list[str], log_path: Path) -> None:
        self.port = port
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> float:
        t0 = time.perf_counter()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedkv.cli",
                    "block-manager",
                    "--port",
                    str(self.port),
                    "--log-format",
                    "json",
                    *self.args,
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1
        wait_healthy(
            f"127.0.0.1:{self.port}",
            "pagedkv.v1.BlockManager",
            30.0,
            proc=self.proc,
            interval_s=0.01,
            name="block manager",
        )
        return time.perf_counter() - t0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

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
    from block_manager_svc.settings import BlockManagerSettings

    return ["--preemption-mode", "off"] if "preemption_mode" in BlockManagerSettings.model_fields else []
