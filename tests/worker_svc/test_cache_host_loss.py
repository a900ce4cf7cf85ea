"""A worker notices when its cache host dies or is replaced, and says so (docs/worker.md, "Cache host loss").

In-process cache host(s) + a worker on the built-in tiny model, polling every 0.2 s: stopping the
host turns the worker's health NOT_SERVING within a few intervals and Step into FAILED_PRECONDITION
naming the address; a new host (new instance id) on the same address is detected as a
replacement; a step that expects another cache instance is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from pagedkv import errors
from pagedkv.v1 import worker_pb2, worker_pb2_grpc
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import serve_cache
from pagedkv.worker_svc.cache.layout import CacheGeometry
from pagedkv.worker_svc.cache_watch import CACHE_LOST_PREFIX
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.server import start_worker
from pagedkv.worker_svc.settings import WorkerSettings

INTERVAL = 0.2


class Host:
    def __init__(self, port: int = 0, num_gpu_blocks: int = 32) -> None:
        cfg = load_model_config(None)
        geometry = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, num_gpu_blocks, 0)
        self.cache = cache_memory.create(
            geometry, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-test-loss"
        )
        self.running = serve_cache(self.cache, cfg.name, port=port)
        self.port = self.running.port
        self.instance_id = self.cache.descriptor.instance_id
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.running.stop(0)


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    made: list[Host] = []
    yield made
    for h in made:
        h.stop()
    for h in made:
        h.cache.close()


def _worker(port: int, failures: int = 2, reattach: bool = True):  # type: ignore[no-untyped-def]
    return start_worker(
        WorkerSettings(
            port=0,
            cache_host=f"127.0.0.1:{port}",
            device="cpu",
            kernel_backend="reference",
            cache_host_check_interval_s=INTERVAL,
            cache_host_failures=failures,
            connect_timeout_s=10,
            cache_host_reattach=reattach,
        )
    )


def _health(ch: grpc.Channel) -> int:
    return (
        health_pb2_grpc.HealthStub(ch)
        .Check(health_pb2.HealthCheckRequest(service="pagedkv.v1.Worker"), timeout=2)
        .status
    )


def _wait_not_serving(ch: grpc.Channel, within_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"worker still SERVING {within_s} s after its cache host went away")


STEP = worker_pb2.WorkerStepRequest(
    sequences=[worker_pb2.SequenceInput(seq_id="s", token_ids=[1, 2, 3], block_ids=[0])]
)


def test_dead_cache_host_is_detected_and_reported(hosts: list[Host]) -> None:
    host = Host()
    hosts.append(host)
    proc = _worker(host.port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert stub.Step(STEP, timeout=30).outputs
            info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
            assert (
                info.cache_state == worker_pb2.CACHE_STATE_ATTACHED
                and info.cache_instance_id == host.instance_id
            )
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
            host.stop()
            # 2 failed checks at 0.2 s; allow for slow shared CI cores.
            took = _wait_not_serving(ch, within_s=5.0)
            assert took < 5.0
            with pytest.raises(grpc.RpcError) as e:
                stub.Step(STEP, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            msg = e.value.details()
            assert msg.startswith(CACHE_LOST_PREFIX), msg
            assert errors.reason_of(e.value) == errors.CACHE_HOST_LOST  # what clients act on, not the text
            assert f"the cache host at 127.0.0.1:{host.port} is gone" in msg and "re-prefilled" in msg
            info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
            assert info.cache_state == worker_pb2.CACHE_STATE_LOST and "is gone" in info.cache_lost_reason
    finally:
        proc.close()


def test_replaced_cache_host_is_detected(hosts: list[Host]) -> None:
    old = Host()
    hosts.append(old)
    # Only a new instance id can trip it; no re-attach, so the refusal stays observable
    # (re-attaching: tests/worker_svc/test_reattach.py).
    proc = _worker(old.port, failures=1000, reattach=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            old.stop()
            new = Host(old.port)
            hosts.append(new)
            assert new.instance_id != old.instance_id
            _wait_not_serving(ch, within_s=5.0)
            with pytest.raises(grpc.RpcError) as e:
                stub.Step(STEP, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            msg = e.value.details()
            assert "was replaced" in msg and old.instance_id in msg and new.instance_id in msg, msg
    finally:
        proc.close()


def test_step_for_another_cache_instance_is_refused(hosts: list[Host]) -> None:
    host = Host()
    hosts.append(host)
    proc = _worker(host.port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            ok = worker_pb2.WorkerStepRequest(cache_instance_id=host.instance_id)
            ok.sequences.extend(STEP.sequences)
            assert stub.Step(ok, timeout=30).outputs
            bad = worker_pb2.WorkerStepRequest(cache_instance_id="someone-else")
            with pytest.raises(grpc.RpcError) as e:
                stub.Step(bad, timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(CACHE_LOST_PREFIX) and "someone-else" in e.value.details()
            info = errors.error_info(e.value)
            assert info is not None and info.reason == errors.CACHE_HOST_LOST
            assert info.metadata["cache_instance_id"] == host.instance_id
            # The standard rich error model, as grpcurl and every ecosystem client decode it.
            status = rpc_status.from_call(e.value)
            assert status is not None and status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            detail = error_details_pb2.ErrorInfo()
            assert len(status.details) == 1 and status.details[0].Unpack(detail)
            assert (detail.reason, detail.domain) == ("CACHE_HOST_LOST", "pagedkv.worker")
            assert detail.metadata["cache_instance_id"] == host.instance_id
            assert "pagedkv-error-bin" not in dict(e.value.trailing_metadata())  # no custom trailer
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING  # the worker itself is fine
    finally:
        proc.close()


def test_a_new_host_that_cannot_be_attached_makes_the_worker_exit(hosts: list[Host]) -> None:
    """Re-attaching checks the new instance: another geometry is refused (the worker's model and
    steps were sized for the old one), the worker stays NOT_SERVING and asks to exit (code 3) at once."""
    old = Host()
    hosts.append(old)
    proc = _worker(old.port, failures=1000)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            old.stop()
            new = Host(old.port, num_gpu_blocks=48)
            hosts.append(new)
            deadline = time.monotonic() + 10
            while not proc.reattach_failed:
                assert time.monotonic() < deadline, "the mismatching host was not refused"
                time.sleep(0.05)
            info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
            assert (
                info.cache_state == worker_pb2.CACHE_STATE_LOST and info.cache_instance_id == old.instance_id
            )
            assert _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert proc.cache.descriptor.instance_id == old.instance_id  # nothing of the new one was kept
    finally:
        proc.close()
