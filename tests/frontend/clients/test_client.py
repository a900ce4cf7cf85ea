"""The block manager clients against an in-process server.

A fault-injecting server interceptor makes the first N calls of a method fail
with UNAVAILABLE (retries) or sleep (deadlines), and counts what reached it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedkv.block_manager_svc.server import build_core
from pagedkv.block_manager_svc.servicer import BlockManagerServicer
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import (
    AsyncBlockManagerClient,
    BlockManagerClient,
    new_blocks_by_sequence,
    step_decode_request,
)
from pagedkv.ports import free_port
from pagedkv.retry import RetryPolicy
from pagedkv.v1 import block_manager_pb2_grpc

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


class FaultInjector(grpc.ServerInterceptor):
    """Fails the next ``fail[method]`` calls with UNAVAILABLE; sleeps ``delay[method]`` s first."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        name = handler_call_details.method.rsplit("/", 1)[-1]
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            failing = self.fail.get(name, 0) > 0
            if failing:
                self.fail[name] -= 1
        delay = self.delay.get(name, 0.0)
        if delay:
            time.sleep(delay)
        if failing:

            def _unavailable(request, context):  # type: ignore[no-untyped-def]
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault")

            return grpc.unary_unary_rpc_method_handler(_unavailable)
        return continuation(handler_call_details)


@pytest.fixture()
def server():  # type: ignore[no-untyped-def]
    faults = FaultInjector()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[faults])
    settings = BlockManagerSettings(port=0, num_gpu_blocks=256, block_size=16)
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(build_core(settings)), srv)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", faults
    srv.stop(None).wait()


def test_round_trip_of_every_rpc(server) -> None:  # type: ignore[no-untyped-def]
    target, _ = server
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        bm.wait_ready(5)
        assert bm.health() == health_pb2.HealthCheckResponse.SERVING
        cfg = bm.get_config()
        assert (cfg.block_size, cfg.num_gpu_blocks) == (16, 256)
        assert len(bm.allocate("a", 20).block_ids) == 2
        assert bm.append("a", 12).new_block_ids == []  # 32 tokens fill 2 blocks
        assert len(bm.append("a", 1).new_block_ids) == 1
        assert list(bm.fork("a", "b").block_ids) == list(bm.get_block_table("a").block_ids)
        bm.allocate("c", 16)
        resp = bm.step_decode(["a", "c"], token_ids=[7, 8], frees=["b"])
        assert not resp.errors
        per_seq = new_blocks_by_sequence(resp, 2)
        assert per_seq[0] == [] and len(per_seq[1]) == 1  # "c" crossed a block boundary
        assert bm.get_block_table("c").num_tokens == 17
        stats = bm.get_stats()
        assert stats.num_sequences == 2
        bm.free("a")
        bm.free("c")
        assert bm.get_stats().num_used_blocks == 0


def test_server_errors_surface_as_status_codes_without_retry(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        with pytest.raises(grpc.RpcError) as info:
            bm.free("nope", request_id="r1")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert faults.calls["Free"] == 1  # only UNAVAILABLE is retried


def test_on_call_times_every_rpc_of_the_client_retries_included(server) -> None:  # type: ignore[no-untyped-def]
    """The timing hook (what a benchmark uses instead of wrapping the client's methods): one call per
    RPC with its wall time and response, retries inside one call, None when the RPC raised."""
    target, faults = server
    seen: list[tuple[float, object]] = []
    faults.fail["GetStats"] = 2
    faults.delay["GetConfig"] = 0.05
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        bm.on_call = lambda seconds, response: seen.append((seconds, response))
        stats = bm.get_stats()
        config = bm.get_config()
        with pytest.raises(grpc.RpcError):
            bm.free("nope")
        bm.on_call = None
        bm.get_stats()
    assert faults.calls["GetStats"] == 4  # two failed attempts, the retry, the untimed call
    assert [r for _, r in seen] == [stats, config, None]
    assert seen[1][0] >= 0.05 and all(t > 0 for t, _ in seen)


def test_reads_retry_on_unavailable(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    faults.fail["GetStats"] = 2
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        assert bm.get_stats().num_gpu_blocks == 256
    assert faults.calls["GetStats"] == 3


def test_mutation_without_request_id_is_not_retried(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    faults.fail["Allocate"] = 1
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        with pytest.raises(grpc.RpcError) as info:
            bm.allocate("s", 4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert faults.calls["Allocate"] == 1
        faults.fail["Step"] = 1
        with pytest.raises(grpc.RpcError):
            bm.step_decode(["s"])
        assert faults.calls["Step"] == 1


def test_mutation_with_request_id_is_retried(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    faults.fail["Allocate"] = 2
    faults.fail["Step"] = 1
    with BlockManagerClient(target, retry=FAST_RETRY) as bm:
        assert len(bm.allocate("s", 4, request_id="req-1").block_ids) == 1
        assert faults.calls["Allocate"] == 3
        assert not bm.step_decode(["s"], request_id="req-2").errors
        assert faults.calls["Step"] == 2


def test_attempts_are_bounded(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    faults.fail["GetConfig"] = 100
    bm = BlockManagerClient(target, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01))
    with bm, pytest.raises(grpc.RpcError) as info:
        bm.get_config()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert faults.calls["GetConfig"] == 3


def test_deadline_applies_to_each_call(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server
    faults.delay["GetStats"] = 1.0
    with BlockManagerClient(target, default_timeout_s=0.2, retry=FAST_RETRY) as bm:
        bm.get_config()  # connect first, so the clock below measures the call only
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            bm.get_stats()
        elapsed = time.monotonic() - start
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert elapsed < 0.8
        assert faults.calls["GetStats"] == 1  # DEADLINE_EXCEEDED is not retried
        # a per-call timeout overrides the default
        faults.delay["GetStats"] = 0.3
        assert bm.get_stats(timeout_s=3.0).num_gpu_blocks == 256


def test_deadline_covers_retries_against_a_dead_target() -> None:
    port = free_port()  # nothing listens there
    slow_retry = RetryPolicy(max_attempts=50, initial_backoff_s=0.05, max_backoff_s=0.2)
    with BlockManagerClient(f"127.0.0.1:{port}", default_timeout_s=0.5, retry=slow_retry) as bm:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            bm.get_stats()
        elapsed = time.monotonic() - start
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < 1.5


def test_backoff_is_bounded_full_jitter() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5, multiplier=2.0)
    rng = random.Random(0)
    for failed, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (10, 0.5)]:
        samples = [policy.backoff_s(failed, rng) for _ in range(200)]
        assert 0 <= min(samples) and max(samples) <= cap
        assert max(samples) > cap * 0.8  # jitter spans the range
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        BlockManagerClient("127.0.0.1:1", default_timeout_s=0)


def test_step_decode_request_validates_token_ids() -> None:
    with pytest.raises(ValueError):
        step_decode_request(["a", "b"], token_ids=[1])
    req = step_decode_request(["a", "b"], frees=["c"], request_id="r")
    assert list(req.append_seq_ids) == ["a", "b"] and list(req.free_seq_ids) == ["c"]
    assert not req.append_num_tokens  # empty means one token each


def test_async_client_round_trip_retry_and_deadline(server) -> None:  # type: ignore[no-untyped-def]
    target, faults = server

    async def scenario() -> None:
        async with AsyncBlockManagerClient(target, retry=FAST_RETRY) as bm:
            await bm.wait_ready(5)
            assert await bm.health() == health_pb2.HealthCheckResponse.SERVING
            assert len((await bm.allocate("x", 17)).block_ids) == 2
            await bm.fork("x", "y")
            resp = await bm.step_decode(["x", "y"], frees=())
            assert not resp.errors
            assert len(resp.ops.copies) == 1  # "y" wrote into a shared block: copy-on-write
            faults.fail["GetBlockTable"] = 2
            assert (await bm.get_block_table("x")).num_tokens == 18
            assert faults.calls["GetBlockTable"] == 3
            faults.fail["Free"] = 1
            with pytest.raises(grpc.RpcError) as info:
                await bm.free("x")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            await bm.free("x", request_id="free-x")
            await bm.free("y")
            assert (await bm.get_stats()).num_sequences == 0
            bs = (await bm.get_config()).block_size
            await bm.allocate("z", 2 * bs, list(range(2 * bs)))
            await bm.commit("z", 2 * bs)
            await bm.free("z")
            reset = await bm.reset_prefix_cache(request_id="reset-1")  # the sync client's methods, awaitable
            assert (reset.num_blocks_cleared, reset.num_blocks_freed) == (2, 2)
            faults.delay["GetConfig"] = 1.0
            with pytest.raises(grpc.RpcError) as info:
                await bm.get_config(timeout_s=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())


def test_leases_preempt_swap_in_and_request_id_dedupe_on_the_real_server() -> None:
    from pagedkv.block_manager_svc.server import start_server

    running = start_server(
        BlockManagerSettings(port=0, num_gpu_blocks=256, num_cpu_blocks=64, log_level="warning")
    )
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}", retry=FAST_RETRY) as bm:
            assert bm.keep_alive("lease-1", ttl_ms=60_000).ttl_ms > 0
            first = bm.allocate("p", 20, lease_id="lease-1", request_id="alloc-p")
            # what a retry after a lost reply does: the server answers from its dedupe table
            again = bm.allocate("p", 20, lease_id="lease-1", request_id="alloc-p")
            assert list(again.block_ids) == list(first.block_ids)
            bm.fork("p", "q", lease_id="lease-1")
            try:
                resp = bm.preempt("p", "swap", request_id="pre-p")
            except grpc.RpcError as e:  # the server may refuse by its policy; the RPC itself exists
                assert e.code() != grpc.StatusCode.UNIMPLEMENTED
            else:
                assert "p" in {p.seq_id for p in resp.preempted}
            with pytest.raises(grpc.RpcError) as info:
                bm.swap_in("never-allocated")
            assert info.value.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE)
    finally:
        running.stop(None)
