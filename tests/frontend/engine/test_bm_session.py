"""The engine's block-manager session keeps a Step's identity across its own retries.

The case that matters: the manager applied the Step, the reply was lost, the link stayed down until
the client's own retries were spent, and the retry comes from the session. The manager must see the
same request id (a dedupe hit) and apply nothing twice. A client interceptor plays the link; the
manager is a real in-process server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import BlockManagerClient, channel_options
from pagedkv.frontend.engine.bm_session import BlockManagerSession, StepPlan
from pagedkv.frontend.engine.types import EngineConfig, EngineStats
from pagedkv.retry import RetryPolicy

CLIENT_ATTEMPTS = RetryPolicy().max_attempts


class _Unavailable(grpc.RpcError):
    def __init__(self, what: str) -> None:
        self.what = what

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.what


class _LinkDownAfterApply(grpc.UnaryUnaryClientInterceptor):
    """For the next Step: let the manager apply it, lose the reply, then fail the client's remaining
    attempts without sending them, so the client gives up and the session has to retry."""

    def __init__(self) -> None:
        self.armed = False
        self.attempts: list[str] = []  # request ids of every attempt of the armed Step
        self.refused = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not (self.armed and details.method.endswith("/Step")):
            return continuation(details, request)
        self.attempts.append(request.request_id)
        if len(self.attempts) == 1:
            continuation(details, request).result()  # applied by the manager...
            raise _Unavailable("the reply was lost (injected)")  # ...and the reply never came back
        if self.refused < CLIENT_ATTEMPTS - 1:
            self.refused += 1
            raise _Unavailable("the link is down (injected)")
        self.armed = False  # the session's retry goes through
        return continuation(details, request)


@pytest.fixture
def manager() -> Iterator[BlockManagerServer]:
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=32, block_size=4))
    yield running
    running.stop(0)


def test_a_session_retry_after_the_client_gave_up_keeps_the_step_id(manager: BlockManagerServer) -> None:
    link = _LinkDownAfterApply()
    channel = grpc.intercept_channel(
        grpc.insecure_channel(f"127.0.0.1:{manager.port}", options=channel_options()), link
    )
    bm = BlockManagerClient(f"127.0.0.1:{manager.port}", channel=channel)
    stats = EngineStats()
    session = BlockManagerSession(bm, "lease-a", EngineConfig(block_manager_outage_s=10), stats)
    try:
        hits = bm.get_stats().num_dedupe_hits
        # An allocation applied twice would come back ALREADY_EXISTS; an append applied twice would
        # leave the manager a token ahead of the engine.
        link.armed = True
        delta = session.step(StepPlan(allocs=[("s", [1, 2, 3, 4, 5], 0)]))
        assert delta.errors == [] and len(delta.alloc_tables[0]) == 2
        link.__init__()  # type: ignore[misc]
        link.armed = True
        delta = session.step(StepPlan(appends=[("s", 6)]))
        assert delta.errors == []
        assert link.attempts[0] and len(link.attempts) == CLIENT_ATTEMPTS + 1
        assert set(link.attempts) == {link.attempts[0]}, "every attempt must carry the Step's one id"
        assert stats.bm_retries == 2  # one session-level retry per Step: the client had given up
        assert bm.get_stats().num_dedupe_hits - hits == 2
        assert bm.get_block_table("s").num_tokens == 6
    finally:
        session.stop_renewal()
        bm.close()
