"""Fixtures for the reliability tests: servers with a state dir, and an in-process 'crash'."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def crash(running: BlockManagerServer) -> None:
    """Stop like a SIGKILL would: no final snapshot, journal files dropped unsynced, lock released."""
    rel = running.reliability
    assert rel is not None
    running.reliability = None
    rel._stop.set()
    rel.servicer._snapshot_wanted.set()
    for t in rel._threads:
        t.join()
    running.server.stop(0).wait()
    if rel.servicer.journal is not None:
        rel.servicer.journal.abandon()
    os.close(rel._lock_fd)


class Servers:
    def __init__(self) -> None:
        self.running: list[BlockManagerServer] = []
        self.channels: list[grpc.Channel] = []

    def start(self, **overrides: Any) -> tuple[BlockManagerServer, pb_grpc.BlockManagerStub]:
        overrides.setdefault("num_gpu_blocks", 64)
        overrides.setdefault("block_size", 4)
        running = start_server(BlockManagerSettings(port=0, **overrides))
        self.running.append(running)
        ch = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        self.channels.append(ch)
        return running, pb_grpc.BlockManagerStub(ch)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for r in self.running:
            if r.reliability is not None or r.server is not None:
                with contextlib.suppress(Exception):  # already crashed/stopped
                    r.stop(0)


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


@pytest.fixture
def state_dir(tmp_path: Path) -> str:
    return str(tmp_path / "state")
