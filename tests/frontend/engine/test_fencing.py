"""A paused worker's late writes never land in blocks that other sequences hold by then.

In-process stack, two workers on one shared cache. Worker 0 is paused just before its first step
computes (a gate in front of its model runner: the process is alive and answers pings, as one
stopped between receiving the step and writing its KV). The engine gives up on that call, runs the
step on worker 1 and goes on: request ``first`` finishes. Then ``second`` arrives; the pool is too
small for both, so it can only run in ``first``'s blocks. Worker 0 then resumes and writes
``first``'s prompt KV into ``first``'s old blocks. Without fencing those blocks were already
``second``'s and its tokens differ from transformers' greedy ones; with fencing ``first``'s Free
waits until worker 0 answers ``Fence`` with the step no longer running, so ``second`` runs only
after the late writes and gets its exact tokens."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pagedkv.frontend.clients.worker import StepTransport
from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.engine.fencing import Fences, nothing_listens
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.v1 import worker_pb2 as wpb
from tests.worker_svc.conftest import HFModel, build_hf_model

FIRST = [3, 9, 27, 81, 11, 5, 7, 2]  # 8 tokens: blocks 0 and 1 of ``first``, written by the late step
SECOND = [4, 16, 64, 2, 8, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73]
SECOND_TOKENS = 8  # 24 + 8 tokens: all 8 blocks of the pool
STEP_DEADLINE_S = 2.0  # the engine's wait for a worker step in this test (120 s by default)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("fencing-llama"), seed=13)


@pytest.fixture()
def stack(hf: HFModel) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=8,
        kernel_backend="reference", num_workers=2,
        block_manager_overrides={"enable_prefix_caching": False, "watermark_fraction": 0.0},
    )  # fmt: skip
    with LocalStack(cfg) as st:
        yield st


class PausedFirstStep:
    """A model runner whose first step waits for ``resume`` before computing (and writing KV)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.paused = threading.Event()  # the first step arrived and waits
        self.resume = threading.Event()
        self.late_done = threading.Event()  # the first step's writes are over

    def step(self, seqs: Any, ops: Any) -> Any:
        first = not self.paused.is_set()
        if first:
            self.paused.set()
            self.resume.wait(60)
        try:
            return self.runner.step(seqs, ops)
        finally:
            if first:
                self.late_done.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_paused_workers_late_step_never_writes_into_reused_blocks(
    stack: LocalStack, hf: HFModel, transport: StepTransport
) -> None:
    servicer = stack.workers[0].servicer
    real = servicer.runner
    paused = PausedFirstStep(real)
    servicer.attach(paused, servicer.info)  # type: ignore[arg-type]
    eng = stack.engine(EngineConfig(max_batch_tokens=64), step_transport=transport)
    eng.pool.timeout_s = STEP_DEADLINE_S
    try:
        assert [w.transport for w in eng.workers] == [transport, transport]
        first = eng.add_request(GenerationRequest("first", FIRST, max_tokens=2))
        while not first.finished:
            eng.step()
        assert paused.paused.is_set() and not paused.late_done.is_set()
        assert eng.pool.stats.retries >= 1, "the paused worker's step ran on the other worker"
        assert first.completions[0].token_ids == hf.greedy(FIRST, 2)

        second = eng.add_request(GenerationRequest("second", SECOND, max_tokens=SECOND_TOKENS))
        for _ in range(3):  # without fencing, second's prompt is now in the blocks first had
            eng.step()
        assert eng.pool.fences.held() == {eng.scheduler.seq_id("first", 0)}
        paused.resume.set()
        assert paused.late_done.wait(30)  # the late step wrote first's prompt KV
        t0 = time.monotonic()
        while not second.finished:
            eng.step()
            assert time.monotonic() - t0 < 30
        assert second.completions[0].token_ids == hf.greedy(SECOND, SECOND_TOKENS)
        assert eng.pool.fences.released == eng.pool.fences.fenced == 1
        channel = stack.workers[1].step_channel
        assert channel is not None and channel.connections == (1 if transport == "shm" else 0)
        eng.flush()
        stats = eng.bm.get_stats()
        assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
    finally:
        paused.resume.set()
        servicer.attach(real, servicer.info)


class FakeWorker:
    """A worker client whose Fence answers ``running``, or fails like an unreachable peer."""

    def __init__(self, target: str, running: list[str] | None) -> None:
        self.target = target
        self.running = running
        self.asked: list[list[str]] = []

    def fence(self, request_ids: list[str], *, timeout_s: float | None = None) -> wpb.FenceReply:
        self.asked.append(list(request_ids))
        if self.running is None:
            raise grpc.RpcError()
        return wpb.FenceReply(running_request_ids=[r for r in request_ids if r in self.running])


def test_fences_release_only_what_the_worker_no_longer_runs() -> None:
    fences = Fences()
    w = FakeWorker("127.0.0.1:1", running=["s1"])
    fences.note(w, "s1", ["a", "b"])  # type: ignore[arg-type]
    fences.note(w, "s2", ["c"])  # type: ignore[arg-type]
    assert fences.held() == {"a", "b", "c"}
    fences.check(w, 1.0)  # type: ignore[arg-type]
    assert w.asked == [["s1", "s2"]]
    assert fences.held() == {"a", "b"} and fences.released == 1
    w.running = []
    fences.check(w, 1.0)  # type: ignore[arg-type]
    assert fences.held() == set() and fences.clients() == []


def test_an_unanswered_fence_holds_unless_nothing_listens_at_the_address() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # alive but never answering (accepted by the kernel), as a stopped process
    alive = f"127.0.0.1:{listener.getsockname()[1]}"
    gone_sock = socket.socket()
    gone_sock.bind(("127.0.0.1", 0))
    gone = f"127.0.0.1:{gone_sock.getsockname()[1]}"
    gone_sock.close()  # nothing listens there
    try:
        assert not nothing_listens(alive, 1.0) and nothing_listens(gone, 1.0)
        assert not nothing_listens("unix:/tmp/x.sock", 1.0)
        fences = Fences()
        paused, dead = FakeWorker(alive, running=None), FakeWorker(gone, running=None)
        fences.note(paused, "p", ["a"])  # type: ignore[arg-type]
        fences.note(dead, "d", ["b"])  # type: ignore[arg-type]
        for w in (paused, dead):
            fences.check(w, 1.0)  # type: ignore[arg-type]
        assert fences.held() == {"a"}
    finally:
        listener.close()
