"""Log lines about a request carry its id: the request_id field, else x-request-id metadata."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.logging_setup import configure_logging
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


@contextlib.contextmanager
def running_until_done(running: BlockManagerServer) -> Iterator[None]:
    try:
        yield
    finally:
        running.stop(0)


def test_rejections_are_logged_with_the_request_id() -> None:
    # At info, as the suite starts: an in-process main (generate, demo) run earlier in this test
    # process may have left the level at warning, which drops these events before any capture.
    configure_logging("info", "console", cache=False)
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=8))
    with capture_logs() as logs, running_until_done(running):
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            with pytest.raises(grpc.RpcError):
                stub.Free(pb.FreeRequest(seq_id="ghost", request_id="req-field-42"), timeout=5)
            with pytest.raises(grpc.RpcError):
                stub.Free(
                    pb.FreeRequest(seq_id="ghost2"), metadata=[("x-request-id", "req-meta-7")], timeout=5
                )
            with pytest.raises(grpc.RpcError):
                stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="ghost3"), timeout=5)
    rejected = {e["seq_id"]: e["request_id"] for e in logs if e["event"] == "request_rejected"}
    assert rejected == {"ghost": "req-field-42", "ghost2": "req-meta-7", "ghost3": ""}
