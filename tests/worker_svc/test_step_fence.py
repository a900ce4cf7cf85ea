"""The worker's half of fencing (worker_svc/step_fence.py through the Worker service): ``Fence``
lists the named steps still running, and a fenced step never starts afterwards."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.v1 import worker_pb2_grpc as wpb_grpc
from pagedkv.worker_svc.servicer import WorkerServicer
from pagedkv.worker_svc.step_fence import StepFence


class GatedRunner:
    """Holds every step until ``go`` is set; counts the steps that ran."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.ran = 0

    def step(self, seqs: Any, ops: Any) -> Any:
        self.entered.set()
        assert self.go.wait(30)
        self.ran += 1
        return SimpleNamespace(num_tokens=0, cache_ops_ms=0.0, forward_ms=0.0, outputs=[])


@pytest.fixture()
def served() -> Iterator[tuple[GatedRunner, WorkerClient]]:
    runner = GatedRunner()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    wpb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, wpb.WorkerInfo()), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = WorkerClient(f"127.0.0.1:{port}", default_timeout_s=10)
    try:
        yield runner, client
    finally:
        client.close()
        server.stop(0)


def test_fence_reports_running_steps_and_refuses_fenced_ones(
    served: tuple[GatedRunner, WorkerClient],
) -> None:
    runner, client = served
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.step, wpb.WorkerStepRequest(request_id="s1"))
        assert runner.entered.wait(10)
        assert list(client.fence(["s1", "s2"]).running_request_ids) == ["s1"]
        assert list(client.fence(["s1"]).running_request_ids) == ["s1"]  # asking again changes nothing
        runner.go.set()
        running.result(timeout=10)  # a step that began before its fence finishes
    assert list(client.fence(["s1", "s2"]).running_request_ids) == []
    with pytest.raises(grpc.RpcError) as e:
        client.step(wpb.WorkerStepRequest(request_id="s2"))  # fenced before it arrived: never runs
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert "'s2' was fenced" in (e.value.details() or "")
    assert runner.ran == 1
    client.step(wpb.WorkerStepRequest(request_id="s3"))  # other steps run as before
    assert runner.ran == 2


def test_step_fence_forgets_the_oldest_fenced_ids_past_its_bound() -> None:
    fence = StepFence(remember=2)
    assert fence.begin("a")
    assert fence.fence(["a", "b", ""]) == ["a"]
    fence.end("a")
    assert fence.running() == []
    assert not fence.begin("b")
    fence.fence(["c", "d"])  # "a" and "b" are the oldest: forgotten
    assert fence.begin("b") and not fence.begin("c")
