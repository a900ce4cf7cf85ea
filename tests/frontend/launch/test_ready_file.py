"""frontend/launch/ready.py: what `pagedkv up --ready-file` writes, and how a starter waits for it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading

import pytest

from pagedkv.frontend.launch.ready import ReadyService, StackReady, wait_ready_file

READY = StackReady(
    services=(
        ReadyService("block-manager", "127.0.0.1:50051", 11),
        ReadyService("cache-host", "127.0.0.1:50052", 12),
        ReadyService("worker-0", "127.0.0.1:50053", 13),
        ReadyService("worker-1", "127.0.0.1:50054", 14),
    ),
    url="http://127.0.0.1:8000",
    state_dir="/tmp/state",
)


def test_written_whole_and_read_back(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ready.json"
    READY.write(path)
    assert StackReady.read(path) == READY
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]  # the temporary file was renamed
    assert READY.address("block-manager") == "127.0.0.1:50051"
    assert READY.workers == ["127.0.0.1:50053", "127.0.0.1:50054"]
    with pytest.raises(KeyError, match="no service 'frontend'"):
        READY.service("frontend")


def test_the_wait_ends_when_the_file_appears(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        threading.Timer(0.3, READY.write, args=(path,)).start()
        assert wait_ready_file(path, proc, timeout_s=20) == READY
    finally:
        proc.kill()
        proc.wait()


def test_the_wait_fails_when_up_exits_first_or_takes_too_long(tmp_path: pathlib.Path) -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    exited.wait()
    with pytest.raises(RuntimeError, match="exited with code 2 before it was ready"):
        wait_ready_file(tmp_path / "never.json", exited, timeout_s=5)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="not ready within 0.3 s"):
            wait_ready_file(tmp_path / "never.json", running, timeout_s=0.3)
    finally:
        running.kill()
        running.wait()
