"""Hung is not dead, for the engine (in-process stack, bench/fault_scenarios/link_proxy.py in front
of a worker):

- a worker that stops answering (its link black-holed: connection open, nothing answered, as a
  paused process) is benched once keepalive finds it, its share runs on the other worker, and it is
  taken back once it answers again; every request finishes with transformers' greedy tokens;
- after a cache-host loss, a worker attached again to the SAME instance is a resumption (recovery
  keeps the prefix cache), a new instance a replacement."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from bench.fault_scenarios.link_proxy import LinkProxy
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import KEEPALIVE_S, WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.engine.recovery import attached_instance
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.v1 import worker_pb2 as wpb
from tests.worker_svc.conftest import HFModel, build_hf_model

PROMPTS = [[3, 9, 27, 81, 11, 5, 7], [4, 16, 64, 2, 8], [7, 7, 1, 2, 3, 4, 5, 6, 9], [2, 4, 6, 8, 10]]
MAX_TOKENS = 24
HUNG_S = 3 * KEEPALIVE_S  # past keepalive's time + timeout


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("hung-peers-llama"), seed=9)


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=128,
        kernel_backend="reference", num_workers=2,
    )  # fmt: skip
    with LocalStack(cfg) as st:
        yield st


def test_a_hung_worker_leaves_the_pool_and_comes_back_when_it_answers(stack: LocalStack, hf: HFModel) -> None:
    direct, hung = stack.worker_targets
    with LinkProxy(hung) as proxy:
        eng = Engine(
            BlockManagerClient(stack.block_manager_target),
            [WorkerClient(direct), WorkerClient(proxy.address, step_transport="grpc")],  # the link under test
            EngineConfig(max_batch_tokens=64),
        )
        try:
            outs = [
                eng.add_request(GenerationRequest(f"h{i}", p, max_tokens=MAX_TOKENS))
                for i, p in enumerate(PROMPTS)
            ]
            for _ in range(3):
                eng.step()
            slot = eng.pool.slots[1]
            assert slot.steps > 0, "both workers share the batch before the fault"
            proxy.blackhole()
            threading.Timer(HUNG_S, proxy.heal).start()
            t0 = time.monotonic()
            benched = False
            while not all(o.finished for o in outs):
                eng.step()
                benched = benched or slot.benched
            took = time.monotonic() - t0
            for o, p in zip(outs, PROMPTS, strict=True):
                assert o.completions[0].token_ids == hf.greedy(p, MAX_TOKENS), o.request_id
            assert benched and eng.pool.stats.retries >= 1
            assert took < HUNG_S + 10
            # Taken back once it answers: it runs steps again.
            deadline = time.monotonic() + 10
            while slot.benched and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not slot.benched
            before = slot.steps
            eng.generate([GenerationRequest(f"after{i}", p, max_tokens=4) for i, p in enumerate(PROMPTS)])
            assert slot.steps > before
            stats = eng.bm.get_stats()
            assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
        finally:
            eng.close()


class _Worker:
    def __init__(self, *infos: wpb.WorkerInfo) -> None:
        self._infos = iter(infos)

    def get_info(self, *, timeout_s: float) -> wpb.WorkerInfo:
        return next(self._infos)


def test_recovery_tells_a_resumed_cache_host_from_a_new_one() -> None:
    lost = wpb.WorkerInfo(cache_instance_id="A", cache_state=wpb.CACHE_STATE_LOST)
    same = wpb.WorkerInfo(cache_instance_id="A", cache_state=wpb.CACHE_STATE_ATTACHED)
    new = wpb.WorkerInfo(cache_instance_id="B", cache_state=wpb.CACHE_STATE_ATTACHED)
    assert attached_instance([_Worker(lost, same)], "A", timeout_s=5) == "A"  # type: ignore[list-item]
    assert attached_instance([_Worker(lost, lost, new)], "A", timeout_s=5) == "B"  # type: ignore[list-item]
