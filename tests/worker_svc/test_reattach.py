"""A worker that stays up while its cache host is SIGKILLed and restarted re-attaches by itself.

Real processes on the CPU backend (docs/worker.md, "Cache host loss"): the same worker process, after
the restart, reports the new cache instance (ATTACHED, health SERVING), refuses a step for the old
instance, generates transformers' greedy tokens on the new cache (through the host's new shared
weights), and keeps nothing of the dead instance mapped; a clean stop then leaves /dev/shm empty.
"""

from __future__ import annotations

import pathlib
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv import errors
from pagedkv.ports import free_port
from pagedkv.v1 import worker_pb2, worker_pb2_grpc
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.generation import Scheduler, grpc_step
from tests.worker_svc.test_processes import (
    BLOCK,
    GPU_BLOCKS,
    PROMPT,
    Proc,
    procs,
    start_cache_host,
    start_worker,
)

__all__ = ["procs"]  # the fixture, re-used

PREFIX = "pagedkv-reattach-test"


def _health(stub: health_pb2_grpc.HealthStub) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service="pagedkv.v1.Worker"), timeout=2).status


def _segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in pathlib.Path("/dev/shm").iterdir() if p.name.startswith(f"{PREFIX}-{pid}-"))


def _mapped(pid: int, needle: str) -> list[str]:
    return [line for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines() if needle in line]


def test_worker_reattaches_to_a_restarted_cache_host(hf_llama: HFModel, procs: list[Proc]) -> None:
    port = free_port()
    host, ready = start_cache_host(hf_llama.path, port=port, prefix=PREFIX)
    procs.append(host)
    w = start_worker(
        hf_llama.path, port, "--cache-host-check-interval-s", "0.2", "--cache-lost-exit-after-s", "60"
    )
    procs.append(w)
    w_ready = w.wait_event("worker_ready")
    assert w_ready["cache_instance_id"] == ready["instance_id"] and w_ready["shared_weights"]
    old_pid = host.p.pid
    assert _mapped(w.p.pid, f"{PREFIX}-{old_pid}-")  # the old cache and weights are mapped
    expected = hf_llama.greedy(PROMPT, 5)
    with grpc.insecure_channel(f"127.0.0.1:{w_ready['port']}") as ch:
        stub, health = worker_pb2_grpc.WorkerStub(ch), health_pb2_grpc.HealthStub(ch)
        sched = Scheduler(grpc_step(stub), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK)
        sched.add("before", PROMPT)
        sched.generate(["before"], 5)
        assert sched.seqs["before"].generated == expected

        assert host.stop(signal.SIGKILL) == -signal.SIGKILL
        lost = w.wait_event("cache_host_lost", timeout=15)
        assert ready["instance_id"] in lost["instance_id"]
        assert _health(health) == health_pb2.HealthCheckResponse.NOT_SERVING
        # Alive and recovering: the overall health (a liveness probe's) stays SERVING.
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            == health_pb2.HealthCheckResponse.SERVING
        )

        host2, ready2 = start_cache_host(hf_llama.path, port=port, prefix=PREFIX)
        procs.insert(0, host2)
        again = w.wait_event("cache_host_reattached", timeout=20)
        assert (
            again["old_instance_id"] == ready["instance_id"] and again["instance_id"] == ready2["instance_id"]
        )
        assert w.p.poll() is None  # the same worker process, not a restarted one
        info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
        assert (
            info.cache_instance_id == ready2["instance_id"]
            and info.cache_state == worker_pb2.CACHE_STATE_ATTACHED
        )
        assert info.shared_weights and not info.cache_lost_reason
        # SERVING is set just after the re-attach logs its event: give it a moment on a loaded machine.
        deadline = time.monotonic() + 5
        while _health(health) != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _health(health) == health_pb2.HealthCheckResponse.SERVING

        # A step for the dead instance is refused; the engine's next step names the new one.
        stale = worker_pb2.WorkerStepRequest(
            cache_instance_id=ready["instance_id"],
            sequences=[worker_pb2.SequenceInput(seq_id="x", token_ids=PROMPT, block_ids=[0, 1, 2])],
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Step(stale, timeout=10)
        assert errors.reason_of(e.value) == errors.CACHE_HOST_LOST
        fresh = Scheduler(
            grpc_step(stub), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK
        )  # the KV is gone: re-prefill
        fresh.add("after", PROMPT)
        fresh.generate(["after"], 5)
        assert fresh.seqs["after"].generated == expected

        # Nothing of the dead instance stays mapped in the worker (its memory is really released)...
        assert _mapped(w.p.pid, f"{PREFIX}-{old_pid}-") == []
        assert _mapped(w.p.pid, f"{PREFIX}-{host2.p.pid}-")
    # ... and a clean stop leaves nothing in /dev/shm, the dead host's segments included.
    assert w.stop() == 0
    assert host2.stop() == 0
    deadline = time.monotonic() + 5
    while (_segments_of(old_pid) or _segments_of(host2.p.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _segments_of(old_pid) == [] and _segments_of(host2.p.pid) == []
