"""Rejections a client can cause at will are logged at a bounded rate, with the dropped count."""

from __future__ import annotations

import json

import grpc
from structlog.testing import capture_logs

from pagedkv.auth import hash_token
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.log_limit import LogLimiter
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **kw: object) -> None:
        self.lines.append((event, kw))


def test_burst_per_window_then_the_suppressed_count() -> None:
    clock, sink = Clock(), Sink()
    lim = LogLimiter(burst=3, window_s=10.0, clock=clock)
    for i in range(10):
        lim.info(sink, "rejected", i=i)
    lim.info(sink, "other")  # events are limited separately
    assert [kw["i"] for e, kw in sink.lines if e == "rejected"] == [0, 1, 2]
    clock.t = 10.0
    lim.info(sink, "rejected", i=10)
    assert sink.lines[-1] == ("rejected", {"i": 10, "suppressed": 7})
    lim.info(sink, "rejected", i=11)
    assert sink.lines[-1] == ("rejected", {"i": 11})


def test_a_flood_of_unauthenticated_and_rejected_calls_logs_a_bounded_number_of_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps({"tenants": [{"name": "a", "token_sha256": hash_token("tok-a-0123456789")}]})
    )
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=8, auth_tokens_file=str(tokens)))
    try:
        with capture_logs() as logs, grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            for md in ((), (("authorization", "Bearer tok-a-0123456789"),)):
                for _ in range(100):
                    try:
                        stub.Free(pb.FreeRequest(seq_id="ghost"), metadata=md, timeout=5)
                    except grpc.RpcError:
                        pass
    finally:
        running.stop(0)
    for event in ("unauthenticated", "request_rejected"):
        lines = [x for x in logs if x["event"] == event]
        assert 1 <= len(lines) <= LogLimiter().burst, (event, len(lines))
