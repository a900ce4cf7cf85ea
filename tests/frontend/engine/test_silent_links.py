"""Silent links between the engine and the block manager (in-process stack,
bench/fault_scenarios/link_proxy.py in between): a black-holed link (a partition: nothing answered,
nothing refused) and a half-open one (the connection silently dead). Requests complete with
transformers' greedy tokens once the link is back, by deadline and retry with the same request ids,
and a half-open connection is found by keepalive, not waited on forever."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from bench.fault_scenarios.link_proxy import LinkProxy
from pagedkv.frontend.clients.block_manager import BlockManagerClient, channel_options
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model

PROMPTS = [[3, 9, 27, 81, 11, 5, 7], [4, 16, 64, 2, 8], [7, 7, 1, 2, 3, 4, 5, 6, 9]]
MAX_TOKENS = 16
BLACKHOLE_S = 3.0  # several per-call deadlines (bench/faults.py serve runs 10 s)
KEEPALIVE_S = 1.0


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("silent-links-llama"), seed=8)


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=128,
        kernel_backend="reference",
    )  # fmt: skip
    with LocalStack(cfg) as st:
        yield st


@pytest.fixture
def proxy(stack: LocalStack) -> Iterator[LinkProxy]:
    with LinkProxy(stack.block_manager_target) as p:
        yield p


def _engine(stack: LocalStack, proxy: LinkProxy, config: EngineConfig) -> Engine:
    options = channel_options(keepalive_time_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S)
    bm = BlockManagerClient(proxy.address, options=options)
    return Engine(bm, [WorkerClient(t) for t in stack.worker_targets], config)


def _run_through(engine: Engine, hf: HFModel, fault: Callable[[], None]) -> float:
    """Generate, with `fault` after a few steps; the seconds from the fault to the end."""
    outs = [
        engine.add_request(GenerationRequest(f"r{i}-{time.monotonic_ns()}", p, max_tokens=MAX_TOKENS))
        for i, p in enumerate(PROMPTS)
    ]
    for _ in range(4):
        engine.step()
    assert not all(o.finished for o in outs)
    t0 = time.monotonic()
    fault()
    for _ in engine.stream(max_steps=10_000):
        pass
    took = time.monotonic() - t0
    for o, p in zip(outs, PROMPTS, strict=True):
        assert o.completions[0].token_ids == hf.greedy(p, MAX_TOKENS), o.request_id
    stats = engine.bm.get_stats()
    assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
    return took


def test_requests_through_a_black_holed_block_manager_link_complete_when_it_returns(
    stack: LocalStack, proxy: LinkProxy, hf: HFModel
) -> None:
    eng = _engine(stack, proxy, EngineConfig(block_manager_timeout_s=1.0, block_manager_outage_s=30))
    healer = threading.Timer(BLACKHOLE_S, proxy.heal)

    def blackhole() -> None:
        proxy.blackhole()
        healer.start()

    try:
        took = _run_through(eng, hf, blackhole)
    finally:
        healer.cancel()
        proxy.heal()
        eng.close()
    assert BLACKHOLE_S * 0.9 <= took < BLACKHOLE_S + 5  # it waited for the link, not for much more
    assert eng.stats.bm_retries >= 2  # deadlines passed and the same requests went again
    assert eng.stats.bm_resyncs == 0 and eng.stats.recomputed_tokens == 0


def test_a_half_open_block_manager_connection_is_found_by_keepalive(
    stack: LocalStack, proxy: LinkProxy, hf: HFModel
) -> None:
    # A deadline far past keepalive's bound: only keepalive can free the call in time.
    eng = _engine(stack, proxy, EngineConfig(block_manager_timeout_s=20.0, block_manager_outage_s=30))
    try:
        connections = proxy.connections
        took = _run_through(eng, hf, proxy.halfopen)
    finally:
        eng.close()
    assert took < 2 * KEEPALIVE_S + 3.0  # ping unanswered -> connection closed -> retried on a new one
    assert proxy.connections > connections
    assert eng.stats.bm_resyncs == 0  # (the client's own retry, same request id, went on a new connection)
