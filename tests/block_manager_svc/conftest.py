"""Fixtures: a real block manager server on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


@pytest.fixture
def server_factory() -> Iterator[object]:
    started: list[BlockManagerServer] = []

    def make(**overrides: object) -> BlockManagerServer:
        settings = BlockManagerSettings(port=0, **overrides)  # type: ignore[arg-type]
        running = start_server(settings)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop(0)


@pytest.fixture
def bm_server(server_factory) -> BlockManagerServer:  # type: ignore[no-untyped-def]
    return server_factory(num_gpu_blocks=16, block_size=4)


@pytest.fixture
def stub(bm_server: BlockManagerServer) -> Iterator[pb_grpc.BlockManagerStub]:
    with grpc.insecure_channel(f"127.0.0.1:{bm_server.port}") as channel:
        yield pb_grpc.BlockManagerStub(channel)
