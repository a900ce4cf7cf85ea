"""A cache host SIGKILLed mid-generation, with real processes (`pagedkv up`'s Stack, 1 worker).

Without recovery the engine raises CacheHostLost with a message saying what happened and what to
do. With EngineConfig(recover_lost_cache=True) it waits while a "supervisor" (this test) restarts
the cache host and the worker, which stayed up, re-attaches to it by itself; the engine resets the
prefix cache, re-prefills every sequence, and the outputs still equal transformers' greedy generate.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import CacheHostLost, Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.launch.processes import Stack
from pagedkv.healthcheck import wait_healthy
from tests.frontend.process_stack import tiny_process_stack
from tests.worker_svc.conftest import HFModel, build_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("tiny-llama-recovery"))


@pytest.fixture(scope="module")
def stack(hf: HFModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "PAGEDKV_KERNEL_BACKEND": "reference",
        "PAGEDKV_CACHE_HOST_CHECK_INTERVAL_S": "0.2",
        "PAGEDKV_LOG_LEVEL": "warning",
    }
    with tiny_process_stack(str(hf.path), tmp_path_factory, env, num_gpu_blocks=256) as s:
        yield s


def _svc(stack: Stack, name: str):  # type: ignore[no-untyped-def]
    return next(s for s in stack.services if s.name == name)


def _kill_cache_host(stack: Stack) -> None:
    """SIGKILL the cache host and wait until the worker noticed (else a short generation could
    finish on the dead host's still-mapped memory before the worker's next check)."""
    p = _svc(stack, "cache-host").process
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    with grpc.insecure_channel(_svc(stack, "worker-0").address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 10
        while (
            stub.Check(health_pb2.HealthCheckRequest(service="pagedkv.v1.Worker"), timeout=2).status
            != health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "the worker did not notice the dead cache host"
            time.sleep(0.05)


def _supervise(stack: Stack, errors: list[BaseException]) -> None:
    """Restart the cache host at once; the worker, which stayed up, re-attaches to it by itself
    (worker_svc/reattach.py): it must neither exit (code 3) nor need a restart."""
    try:
        worker = _svc(stack, "worker-0")
        stack.restart("cache-host")
        wait_healthy(
            worker.address, "pagedkv.v1.Worker", 30, proc=worker.process
        )  # re-attached: SERVING again
        assert worker.process.poll() is None  # the same process: it neither exited nor was restarted
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def _engine(stack: Stack, **cfg: object) -> Engine:
    bm = BlockManagerClient(_svc(stack, "block-manager").address)
    w = WorkerClient(_svc(stack, "worker-0").address)
    return Engine(bm, [w], EngineConfig(max_batch_tokens=64, **cfg))  # type: ignore[arg-type]


def held(stack: Stack) -> tuple[int, int]:
    """(sequences, referenced blocks) the block manager holds (cached, unreferenced blocks excluded)."""
    with BlockManagerClient(_svc(stack, "block-manager").address) as bm:
        s = bm.get_stats()
    return s.num_sequences, s.num_used_blocks


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [5, 6, 7, 8, 20, 21],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
]


def test_lost_cache_host_raises_then_recovers_with_reprefill(stack: Stack, hf: HFModel) -> None:
    t0 = time.monotonic()
    # 1. Default: a clear error.
    eng = _engine(stack)
    for i, p in enumerate(PROMPTS):
        eng.add_request(GenerationRequest(f"a{i}", p, max_tokens=20))
    for _ in range(4):
        eng.step()
    _kill_cache_host(stack)
    with pytest.raises(CacheHostLost) as e:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            eng.step()
            time.sleep(0.01)
    msg = str(e.value)
    assert "cache host was lost" in msg and "is gone" in msg and "recover_lost_cache=True" in msg, msg
    # The failed engine left nothing behind: its sequences and blocks were freed before it raised.
    assert held(stack) == (0, 0)
    errors: list[BaseException] = []
    _supervise(stack, errors)
    assert not errors, errors

    # 2. recover_lost_cache=True: the engine waits for the restarted worker and re-prefills.
    eng = _engine(stack, recover_lost_cache=True, cache_recovery_timeout_s=60)
    outs = [eng.add_request(GenerationRequest(f"b{i}", p, max_tokens=20)) for i, p in enumerate(PROMPTS)]
    for _ in range(5):
        eng.step()
    assert any(c.token_ids for o in outs for c in o.completions)  # mid-generation
    _kill_cache_host(stack)
    sup = threading.Thread(target=_supervise, args=(stack, errors), daemon=True)
    sup.start()
    for _ in eng.stream(max_steps=10_000):
        pass
    sup.join(60)
    assert not errors, errors
    assert eng.stats.cache_recoveries == 1
    for o, p in zip(outs, PROMPTS, strict=True):
        assert o.completions[0].token_ids == hf.greedy(p, 20), o.request_id
    stats = eng.bm.get_stats()
    # One reset by the first engine before it raised CacheHostLost (its committed blocks named dead
    # KV: the second engine's identical prompts must not hit them), one by the recovering engine,
    # and one by each cache host start (the stack's, then two restarts: worker_svc/peers.py,
    # forget_stale_prefixes).
    assert stats.num_prefix_cache_resets == 2 + 3
    eng.close()
    assert held(stack) == (0, 0)
    # A new request on the restarted cache host and worker succeeds, and leaves nothing allocated.
    eng = _engine(stack)
    out = eng.add_request(GenerationRequest("after", PROMPTS[0], max_tokens=6))
    for _ in eng.stream(max_steps=1000):
        pass
    assert out.completions[0].token_ids == hf.greedy(PROMPTS[0], 6)
    eng.close()
    assert held(stack) == (0, 0)
    assert time.monotonic() - t0 < 75
