"""Leases (KeepAlive, lease ids on Allocate/Fork, expiry by the sweeper), backpressure and deadlines."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers


def wait_for(pred, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_expired_lease_frees_its_sequences_only(servers: Servers) -> None:
    _, stub = servers.start(lease_ttl_s=0.3, lease_sweep_interval_s=0.05)
    stub.Allocate(pb.AllocateRequest(seq_id="mine", num_tokens=8, lease_id="L"))
    stub.Fork(pb.ForkRequest(parent_seq_id="mine", child_seq_id="child"))  # inherits L
    stub.Allocate(pb.AllocateRequest(seq_id="other", num_tokens=8, lease_id="M"))
    stub.Fork(pb.ForkRequest(parent_seq_id="other", child_seq_id="moved", lease_id="L"))
    stub.Allocate(pb.AllocateRequest(seq_id="free-standing", num_tokens=8))
    ka = stub.KeepAlive(pb.KeepAliveRequest(lease_id="M", ttl_ms=60_000))
    assert (ka.ttl_ms, ka.num_sequences, ka.created) == (60_000, 1, False)
    took = wait_for(lambda: stub.GetStats(pb.GetStatsRequest()).num_leases_expired == 1)
    assert took < 0.3 + 0.05 + 0.5
    s = stub.GetStats(pb.GetStatsRequest())
    assert (s.num_sequences, s.num_lease_expired_sequences, s.num_leases) == (2, 3, 1)
    for gone in ("mine", "child", "moved"):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=gone))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_keepalive_renews_and_attaches(servers: Servers) -> None:
    _, stub = servers.start(lease_ttl_s=0.3, lease_sweep_interval_s=0.05)
    r = stub.KeepAlive(pb.KeepAliveRequest(lease_id="K"))
    assert r.created and r.ttl_ms == 300
    stub.Allocate(pb.AllocateRequest(seq_id="x", num_tokens=3))
    assert stub.KeepAlive(pb.KeepAliveRequest(lease_id="K", attach_seq_ids=["x"])).num_sequences == 1
    for _ in range(8):  # 0.8 s > TTL, renewed every 0.1 s
        time.sleep(0.1)
        stub.KeepAlive(pb.KeepAliveRequest(lease_id="K"))
    assert stub.GetStats(pb.GetStatsRequest()).num_sequences == 1
    stub.Free(pb.FreeRequest(seq_id="x"))  # a freed sequence leaves its lease
    assert stub.KeepAlive(pb.KeepAliveRequest(lease_id="K")).num_sequences == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.KeepAlive(pb.KeepAliveRequest(lease_id="K", attach_seq_ids=["nope"]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.KeepAlive(pb.KeepAliveRequest(lease_id=""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_step_frees_leave_the_lease(servers: Servers) -> None:
    running, stub = servers.start(lease_ttl_s=30)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=3, lease_id="L"))
    stub.Step(pb.StepRequest(free_seq_ids=["a"]))
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=3))  # same id, no lease now
    assert running.servicer.reliable.leases.lease_of == {}
    running.servicer.reliable.leases.leases["L"].deadline = 0  # force expiry
    running.servicer.reliable.sweep_leases()
    assert stub.GetStats(pb.GetStatsRequest()).num_sequences == 1


def test_beyond_max_concurrent_rpcs_is_resource_exhausted(servers: Servers) -> None:
    running, stub = servers.start(max_concurrent_rpcs=2, max_workers=4)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=1))
    running.servicer._lock.acquire()  # two calls park inside; the third must not queue
    try:
        parked = [stub.Append.future(pb.AppendRequest(seq_id="a", num_tokens=1)) for _ in range(2)]
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Append(pb.AppendRequest(seq_id="a", num_tokens=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 1.0  # refused at once, not queued
    finally:
        running.servicer._lock.release()
    for f in parked:
        f.result(5)
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 3


def test_request_past_its_deadline_changes_nothing(servers: Servers) -> None:
    running, stub = servers.start()
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=1))
    running.servicer._lock.acquire()
    try:
        f = stub.Append.future(pb.AppendRequest(seq_id="a", num_tokens=1), timeout=0.2)
        time.sleep(0.1)
        g = stub.Append.future(pb.AppendRequest(seq_id="a", num_tokens=1), timeout=0.1)
        time.sleep(0.4)  # both deadlines pass while they wait
    finally:
        running.servicer._lock.release()
    for fut in (f, g):
        with pytest.raises(grpc.RpcError) as e:
            fut.result(5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.2)

    class Expired:
        def time_remaining(self) -> float:
            return 0.0

        def abort(self, code, details):
            raise RuntimeError(code)

    with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):
        running.servicer.Append(pb.AppendRequest(seq_id="a", num_tokens=1), Expired())
    assert running.servicer.reliable.num_deadline_skipped >= 1
