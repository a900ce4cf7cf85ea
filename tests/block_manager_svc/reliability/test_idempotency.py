"""request_id: a retry returns the original reply and changes nothing; misuse is refused;
in-flight retries wait; the window is bounded; entries survive a restart."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pagedkv.block_manager_svc.idempotency import DedupeTable, RequestIdReused
from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers, crash


def stats(stub) -> pb.Stats:
    return stub.GetStats(pb.GetStatsRequest())


def test_every_mutation_is_applied_once(servers: Servers) -> None:
    _, stub = servers.start()
    calls = [
        ("Allocate", pb.AllocateRequest(seq_id="a", num_tokens=6, token_ids=list(range(6)), request_id="1")),
        ("Append", pb.AppendRequest(seq_id="a", num_tokens=3, request_id="2")),
        ("Fork", pb.ForkRequest(parent_seq_id="a", child_seq_id="b", request_id="3")),
        ("Step", pb.StepRequest(append_seq_ids=["a", "b"], append_num_tokens=[4, 4], request_id="4")),
        ("Free", pb.FreeRequest(seq_id="b", request_id="5")),
        ("Preempt", pb.PreemptRequest(seq_id="a", mode="recompute", request_id="6")),
    ]
    for method, req in calls:
        first = getattr(stub, method)(req)
        before = stats(stub)
        for _ in range(3):
            assert getattr(stub, method)(req) == first
        after = stats(stub)
        assert after.num_dedupe_hits == before.num_dedupe_hits + 3
        after.ClearField("num_dedupe_hits")
        before.ClearField("num_dedupe_hits")
        assert after == before  # nothing changed
    assert stats(stub).num_sequences == 0  # b freed, a preempted (recompute forgets it), each once


def test_reused_id_with_another_request_is_invalid_argument(servers: Servers) -> None:
    _, stub = servers.start()
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=4, request_id="x"))
    for bad in (pb.AllocateRequest(seq_id="a", num_tokens=5, request_id="x"),):
        with pytest.raises(grpc.RpcError) as e:
            stub.Allocate(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already used for a different request body" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Free(pb.FreeRequest(seq_id="a", request_id="x"))
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "another method (Allocate)" in e.value.details()
    )
    assert stats(stub).num_sequences == 1


def test_failed_request_is_reevaluated_on_retry(servers: Servers) -> None:
    _, stub = servers.start(num_gpu_blocks=4)
    stub.Allocate(pb.AllocateRequest(seq_id="big", num_tokens=16))
    req = pb.AllocateRequest(seq_id="a", num_tokens=4, request_id="y")
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(req)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stub.Free(pb.FreeRequest(seq_id="big"))
    assert list(stub.Allocate(req).block_ids)  # the retry now succeeds...
    assert stub.Allocate(req) == stub.Allocate(req)  # ...once


def test_retry_while_original_in_flight_waits_for_it(servers: Servers) -> None:
    running, stub = servers.start()
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=1))
    req = pb.AppendRequest(seq_id="a", num_tokens=4, request_id="z")
    running.servicer._lock.acquire()  # the original will block inside the critical section
    try:
        f1 = stub.Append.future(req)
        time.sleep(0.2)
        f2 = stub.Append.future(req)  # a retry (e.g. after a client-side timeout)
        time.sleep(0.2)
        assert not f2.done()
    finally:
        running.servicer._lock.release()
    assert f1.result(5) == f2.result(5)
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 5


def test_in_flight_wait_honours_the_retry_deadline(servers: Servers) -> None:
    running, stub = servers.start()
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=1))
    req = pb.AppendRequest(seq_id="a", num_tokens=1, request_id="w")
    running.servicer._lock.acquire()
    try:
        f1 = stub.Append.future(req)
        time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as e:
            stub.Append(req, timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        running.servicer._lock.release()
    f1.result(5)
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 2


def test_window_is_bounded_by_count_and_age() -> None:
    t = DedupeTable(max_entries=3, ttl_s=100.0)
    now = time.time()
    for i in range(5):
        assert t.begin(f"r{i}", "Free", b"d", None) is None
        t.put(f"r{i}", "Free", b"d", b"reply", now)
        t.end(f"r{i}")
    assert len(t) == 3
    assert t.begin("r0", "Free", b"d", None) is None  # forgotten: treated as new
    t.end("r0")
    assert t.begin("r4", "Free", b"d", None) == b"reply"
    with pytest.raises(RequestIdReused):
        t.begin("r4", "Free", b"other", None)
    t.put("old", "Free", b"d", b"reply", now - 200)  # older than the TTL
    assert t.begin("old", "Free", b"d", None) is None
    t.end("old")


def test_dedupe_window_survives_restart(servers: Servers, state_dir: str) -> None:
    running, stub = servers.start(state_dir=state_dir)
    first = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, request_id="k"))
    step = stub.Step(pb.StepRequest(append_seq_ids=["a"], request_id="s"))
    crash(running)
    _, stub2 = servers.start(state_dir=state_dir)
    assert stub2.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, request_id="k")) == first
    assert stub2.Step(pb.StepRequest(append_seq_ids=["a"], request_id="s")) == step
    assert stub2.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).num_tokens == 10


def test_concurrent_duplicates_never_double_allocate(servers: Servers) -> None:
    _, stub = servers.start(num_gpu_blocks=256)
    errors: list[str] = []

    def hammer(k: int) -> None:
        for i in range(30):
            try:
                stub.Append(pb.AppendRequest(seq_id=f"s{i % 3}", num_tokens=4, request_id=f"id{i}"))
            except grpc.RpcError as e:
                errors.append(e.details())

    for i in range(3):
        stub.Allocate(pb.AllocateRequest(seq_id=f"s{i}", num_tokens=4))
    ts = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert [stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=f"s{i}")).num_tokens for i in range(3)] == [
        44
    ] * 3
