"""Malformed request bytes: INVALID_ARGUMENT with a message and a log line, at all three servers."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from structlog.testing import capture_logs

from pagedkv.block_manager_svc.server import start_server as start_block_manager
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.grpc_server import start_server
from pagedkv.v1 import block_manager_pb2 as bm_pb
from pagedkv.v1 import worker_pb2_grpc
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import serve_cache
from pagedkv.worker_svc.cache.layout import CacheGeometry

GARBAGE = b"\x0a\xff\xff\xff\xff"  # a length-delimited field whose length runs past the end


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    bm = start_block_manager(BlockManagerSettings(port=0, num_gpu_blocks=8))
    cache = cache_memory.create(
        CacheGeometry(1, 1, 8, 4, 4, 0), torch.float32, torch.device("cpu"), shm_prefix="pagedkv-malformed"
    )
    host = serve_cache(cache, "tiny")
    # The worker's server plumbing (pagedkv.grpc_server.start_server), with the unimplemented base servicer:
    # a well-formed Step is UNIMPLEMENTED, a malformed one must be refused before any handler.
    worker = start_server(
        "127.0.0.1",
        0,
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(worker_pb2_grpc.WorkerServicer(), s),
        "pagedkv.v1.Worker",
    )
    try:
        yield {
            "/pagedkv.v1.BlockManager/Allocate": bm.port,
            "/pagedkv.v1.CacheHost/GetCacheInfo": host.port,
            "/pagedkv.v1.Worker/Step": worker.port,
        }
    finally:
        worker.stop(0)
        host.stop(0)
        cache.close()
        bm.stop(0)


def test_malformed_bytes_are_invalid_argument_and_logged_everywhere(servers: dict[str, int]) -> None:
    for method, port in servers.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            raw = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            with capture_logs() as logs, pytest.raises(grpc.RpcError) as e:
                raw(GARBAGE, timeout=5)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
            assert e.value.details().startswith("malformed request: cannot parse pagedkv.v1."), (
                e.value.details()
            )
            assert [(x["event"], x["method"], x["size"]) for x in logs] == [("malformed_request", method, 5)]
            if "Worker" in method:  # well-formed bytes still reach the handler
                with pytest.raises(grpc.RpcError) as e:
                    raw(b"", timeout=5)
                assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED


def test_block_manager_state_is_untouched_and_it_keeps_serving(servers: dict[str, int]) -> None:
    port = servers["/pagedkv.v1.BlockManager/Allocate"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        raw = ch.unary_unary(
            "/pagedkv.v1.BlockManager/Allocate", request_serializer=None, response_deserializer=None
        )
        for _ in range(3):
            with pytest.raises(grpc.RpcError):
                raw(GARBAGE, timeout=5)
        ok = raw(bm_pb.AllocateRequest(seq_id="a", num_tokens=5).SerializeToString(), timeout=5)
        assert len(bm_pb.AllocateResponse.FromString(ok).block_ids) == 1
