"""WorkerClient's step transport (frontend/clients/worker.py): auto takes the worker's step channel
when it names one this process can reach and falls back to gRPC otherwise, grpc never uses it, shm
insists on it, and a restarted worker's new channel is learnt from its WorkerInfo."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pagedkv.frontend.clients.worker import StepChannelMissing, WorkerClient
from pagedkv.step_channel import base_dir
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.v1 import worker_pb2_grpc as wpb_grpc
from pagedkv.worker_svc.servicer import WorkerServicer
from pagedkv.worker_svc.step_channel import StepChannelServer


class CountingRunner:
    """Answers each sequence with its token count; counts steps."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, seqs: Any, ops: Any) -> Any:
        from pagedkv.worker_svc.model_runner import SequenceResult

        self.steps += 1
        outs = [SequenceResult(seq_id=s.seq_id, token_id=len(s.token_ids), logprob=0.0) for s in seqs]
        return SimpleNamespace(num_tokens=len(seqs), cache_ops_ms=0.0, forward_ms=0.0, outputs=outs)


@dataclass
class Worker:
    servicer: WorkerServicer
    channel: StepChannelServer
    target: str
    base: Path

    def restart_channel(self) -> None:
        """A new channel (as a restarted worker's), named in its WorkerInfo."""
        self.channel.close()
        self.channel = StepChannelServer(self.servicer.run_step, base=self.base)
        self.servicer.info.step_channel = self.channel.path


@pytest.fixture()
def worker() -> Iterator[Worker]:
    base = Path(tempfile.mkdtemp(prefix="wc-", dir=base_dir()))
    servicer = WorkerServicer(CountingRunner(), wpb.WorkerInfo())  # type: ignore[arg-type]
    channel = StepChannelServer(servicer.run_step, base=base)
    servicer.info.step_channel = channel.path
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    wpb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    w = Worker(servicer, channel, f"127.0.0.1:{port}", base)
    try:
        yield w
    finally:
        server.stop(0)
        w.channel.close()
        shutil.rmtree(base, ignore_errors=True)


def step(n: int) -> wpb.WorkerStepRequest:
    req = wpb.WorkerStepRequest(request_id=f"r{n}")
    req.sequences.add(seq_id="s", token_ids=list(range(n)))
    return req


def test_auto_takes_the_channel_and_grpc_never_does(worker: Worker) -> None:
    with (
        WorkerClient(worker.target, default_timeout_s=10) as auto,
        WorkerClient(worker.target, default_timeout_s=10, step_transport="grpc") as plain,
    ):
        assert auto.step(step(3)).outputs[0].token_id == 3  # learns the channel before its first step
        assert auto.transport == "shm" and worker.channel.connections == 1
        assert plain.step(step(4)).outputs[0].token_id == 4
        plain.get_info()
        assert plain.transport == "grpc" and worker.channel.connections == 1
        auto.close()
        plain.close()


def test_auto_falls_back_to_grpc_and_learns_a_restarted_workers_channel(worker: Worker) -> None:
    client = WorkerClient(worker.target, default_timeout_s=10)
    try:
        assert client.step(step(2)).outputs[0].token_id == 2 and client.transport == "shm"
        old = worker.channel.path
        worker.restart_channel()
        # The old connection ends (UNAVAILABLE, retried), the old socket refuses: gRPC for this step.
        assert client.step(step(5)).outputs[0].token_id == 5
        assert client.transport == "grpc" and worker.servicer.info.step_channel != old
        client.get_info()  # what the pool's probe or the next step asks: the new channel
        assert client.transport == "shm"
        assert client.step(step(6)).outputs[0].token_id == 6 and worker.channel.connections == 1
    finally:
        client.close()


def test_a_channel_on_another_host_is_not_used(worker: Worker) -> None:
    worker.servicer.info.step_channel = "/nonexistent/pagedkv-step-0-1-x/sock"  # not on this host
    client = WorkerClient(worker.target, default_timeout_s=10)
    try:
        assert client.step(step(7)).outputs[0].token_id == 7
        assert client.transport == "grpc" and worker.channel.connections == 0
    finally:
        client.close()


def test_shm_insists(worker: Worker) -> None:
    gone = worker.channel.path
    worker.channel.close()
    worker.servicer.info.step_channel = gone  # advertised, nothing listens: the worker is gone
    client = WorkerClient(worker.target, default_timeout_s=10, step_transport="shm")
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.step(step(1))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        worker.servicer.info.step_channel = ""  # a worker started with --no-step-channel
        with pytest.raises(StepChannelMissing):
            client.step(step(1))
    finally:
        client.close()
    with pytest.raises(ValueError, match="step_transport"):
        WorkerClient(worker.target, step_transport="udp")
