"""/metrics scraped over HTTP, and the WatchEvents stream (with and without tenants)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import pytest

from pagedkv.auth import hash_token
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.ports import free_port
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_metrics_are_scraped_with_rpc_and_pool_numbers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps({"tenants": [{"name": "acme", "token_sha256": hash_token("t-acme")}]}))
    mport = free_port()
    r = start_server(
        BlockManagerSettings(
            port=0, num_gpu_blocks=32, block_size=4, metrics_port=mport, auth_tokens_file=str(tokens)
        )
    )
    try:
        md = (("authorization", "Bearer t-acme"),)
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stub.Allocate(
                pb.AllocateRequest(seq_id="a", num_tokens=10, token_ids=list(range(10))), metadata=md
            )
            stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=10), metadata=md)
            stub.Allocate(
                pb.AllocateRequest(seq_id="b", num_tokens=10, token_ids=list(range(10))), metadata=md
            )
            with pytest.raises(grpc.RpcError):
                stub.Free(pb.FreeRequest(seq_id="nope"), metadata=md)
            with pytest.raises(grpc.RpcError):
                stub.GetStats(pb.GetStatsRequest())  # no token
        text = scrape(mport)
    finally:
        r.stop(0)
    assert 'pagedkv_gpu_blocks{state="used"} 4.0' in text
    assert 'pagedkv_gpu_blocks{state="free"} 28.0' in text
    assert 'pagedkv_sequences{state="running"} 2.0' in text
    assert "pagedkv_prefix_query_tokens_total 20.0" in text
    assert "pagedkv_prefix_hit_tokens_total 8.0" in text
    assert 'pagedkv_preemptions_total{kind="swap"} 0.0' in text
    assert 'pagedkv_swapped_blocks_total{direction="out"} 0.0' in text
    assert "pagedkv_evicted_blocks_total 0.0" in text
    assert 'pagedkv_rpc_requests_total{code="OK",method="Allocate",tenant="acme"} 2.0' in text
    assert 'pagedkv_rpc_requests_total{code="NOT_FOUND",method="Free",tenant="acme"} 1.0' in text
    assert 'pagedkv_rpc_requests_total{code="UNAUTHENTICATED",method="GetStats",tenant=""} 1.0' in text
    assert 'pagedkv_rpc_duration_seconds_count{method="Allocate"} 2.0' in text
    assert 'pagedkv_tenant_gpu_blocks{tenant="acme"} 4.0' in text
    assert 'pagedkv_tenant_prefix_hit_tokens_total{tenant="acme"} 8.0' in text


def test_metrics_are_off_by_default(server_factory_plain) -> None:  # type: ignore[no-untyped-def]
    assert server_factory_plain.metrics is None


@pytest.fixture
def server_factory_plain():  # type: ignore[no-untyped-def]
    r = start_server(BlockManagerSettings(port=0, num_gpu_blocks=8))
    yield r
    r.stop(0)


def _collect(stream, n: int, out: list, done: threading.Event) -> None:  # type: ignore[no-untyped-def]
    try:
        for ev in stream:
            out.append(ev)
            if len(out) >= n:
                break
    except grpc.RpcError as e:
        out.append(e)
    done.set()


def test_watch_events_snapshot_then_stored_and_removed() -> None:
    r = start_server(BlockManagerSettings(port=0, num_gpu_blocks=4, block_size=4, watermark_fraction=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stub.Allocate(pb.AllocateRequest(seq_id="old", num_tokens=9, token_ids=list(range(9))))
            stub.Commit(pb.CommitRequest(seq_id="old", num_computed_tokens=9))  # 2 hashed
            stream = stub.WatchEvents(pb.WatchEventsRequest(), timeout=20)
            events: list = []
            first = [next(stream) for _ in range(3)]
            assert first[0].WhichOneof("event") == "all_blocks_cleared"
            snap = {bytes(e.block_stored.block_hashes[0]) for e in first[1:]}
            assert len(snap) == 2
            done = threading.Event()
            t = threading.Thread(target=_collect, args=(stream, 2, events, done), daemon=True)
            t.start()
            stub.Free(pb.FreeRequest(seq_id="old"))  # cached, evictable
            # 16 new tokens need all 4 blocks: the 2 cached ones are evicted (removed), 4 stored at commit.
            stub.Allocate(pb.AllocateRequest(seq_id="new", num_tokens=16, token_ids=list(range(100, 116))))
            stub.Commit(pb.CommitRequest(seq_id="new", num_computed_tokens=16))
            assert done.wait(10)
            stream.cancel()
        kinds = [e.WhichOneof("event") for e in events]
        removed = [
            h
            for e in events
            if e.WhichOneof("event") == "block_removed"
            for h in e.block_removed.block_hashes
        ]
        stored = [e for e in events if e.WhichOneof("event") == "block_stored"]
        assert set(removed) == snap, kinds
        assert len(stored) == 1 and len(stored[0].block_stored.block_hashes) == 4  # one chain, one event
        assert stored[0].version > first[0].version
        # Detached once the watcher left: the server notices the cancelled stream asynchronously.
        deadline = time.monotonic() + 10
        while r.servicer._core.pool.events is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.servicer._core.pool.events is None
    finally:
        r.stop(0)


def test_watchers_see_only_their_tenant_and_slow_ones_are_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = tmp_path / "t.json"
    tokens.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "a", "token_sha256": hash_token("ta")},
                    {"name": "b", "token_sha256": hash_token("tb")},
                    {"name": "root", "token_sha256": hash_token("tr"), "admin": True},
                ]
            }
        )
    )
    r = start_server(
        BlockManagerSettings(
            port=0,
            num_gpu_blocks=256,
            block_size=4,
            auth_tokens_file=str(tokens),
            event_queue_size=16,
            max_event_watchers=2,
        )
    )
    md = {k: (("authorization", f"Bearer {v}"),) for k, v in (("a", "ta"), ("b", "tb"), ("root", "tr"))}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            sb = stub.WatchEvents(pb.WatchEventsRequest(), metadata=md["b"], timeout=20)
            sroot = stub.WatchEvents(pb.WatchEventsRequest(all_tenants=True), metadata=md["root"], timeout=20)
            assert next(sb).WhichOneof("event") == "all_blocks_cleared"
            assert next(sroot).WhichOneof("event") == "all_blocks_cleared"
            third = stub.WatchEvents(pb.WatchEventsRequest(), metadata=md["a"], timeout=5)
            with pytest.raises(grpc.RpcError) as e:
                next(third)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # watcher cap
            for t in ("a", "b"):
                stub.Allocate(pb.AllocateRequest(seq_id="s", num_tokens=8, token_ids=[1] * 8), metadata=md[t])
                stub.Commit(pb.CommitRequest(seq_id="s", num_computed_tokens=8), metadata=md[t])
            ev = next(sb)
            assert ev.tenant == "b" and len(ev.block_stored.block_hashes) == 2
            ev_root = next(sroot)
            assert ev_root.tenant == "a"
            assert set(ev.block_stored.block_hashes).isdisjoint(ev_root.block_stored.block_hashes)  # salted
            sb.cancel()
            sroot.cancel()
    finally:
        r.stop(0)


def test_a_slow_watcher_is_dropped_and_never_blocks_the_producer() -> None:
    from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
    from pagedkv.block_manager_svc.events import _END, EventHub, _Subscriber

    hub = EventHub(threading.RLock(), max_watchers=1, queue_size=16)
    core = BlockManager(CoreConfig(num_gpu_blocks=64, block_size=4, preemption_mode="off"))
    hub.attach(core)
    assert core.pool.events is None  # no watcher, no tenancy: the core pays nothing
    sub = _Subscriber(None, 16)
    hub.subs.append(sub)
    core.enable_events(True)
    for i in range(40):  # 40 stored events into a 16-slot queue nobody reads
        core.allocate(f"s{i}", 4, [i] * 4)
        core.commit(f"s{i}", 4)
        hub.publish(core.take_events(), None)  # what the servicer does after every call
    assert sub.dropped and hub.num_dropped == 1 and not hub.subs
    assert core.pool.events is None and hub.version == 17
    items = []
    while not sub.q.empty():
        items.append(sub.q.get_nowait())
    assert items[-1] is _END and len(items) == 16
