"""ResetPrefixCache: forget every prefix-cache hash when the KV it named is gone (a new cache host).

Core (pure, atomic, invariants hold, sequences untouched), the gRPC RPC, request-id dedupe and
journal replay, the AllBlocksCleared KV event, and the admin-only rule with tenants.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.kv_events import AllBlocksCleared, BlockStored
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def _core(**kw: object) -> BlockManager:
    return BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, **{"preemption_mode": "off", **kw}))  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_core_reset_frees_cached_unhashes_referenced_keeps_sequences(policy: str) -> None:
    bm = _core(eviction_policy=policy)
    bm.allocate("a", 9, list(range(9)))  # 2 full hashed blocks + 1 partial
    bm.commit("a", 9)
    bm.allocate("b", 8, list(range(100, 108)))
    bm.commit("b", 8)
    bm.free("b")  # its 2 hashed blocks are cached (evictable)
    tables = {s: list(q.block_ids) for s, q in bm.seqs.items()}
    before = bm.stats()
    assert before.num_cached_blocks == 2 and before.num_hashed_blocks == 4
    cleared, freed = bm.reset_prefix_cache()
    assert (cleared, freed) == (4, 2)
    bm.check_invariants()
    after = bm.stats()
    assert after.num_hashed_blocks == 0 and after.num_cached_blocks == 0
    assert after.num_free_blocks == before.num_free_blocks + 2
    assert after.num_used_blocks == before.num_used_blocks
    assert after.num_prefix_cache_resets == 1
    assert {s: list(q.block_ids) for s, q in bm.seqs.items()} == tables
    # No hit any more, for either prompt; the referenced blocks are freed (not cached) later.
    assert bm.allocate("a2", 9, list(range(9))).num_cached_tokens == 0
    assert bm.allocate("b2", 8, list(range(100, 108))).num_cached_tokens == 0
    bm.commit("a2", 9)
    bm.free("a")
    bm.check_invariants()
    # The cache works again: new registrations hit as before.
    assert bm.allocate("a3", 9, list(range(9))).num_cached_tokens == 8
    # `a` grows past its next boundary after the reset: still consistent.
    bm.append("a2", 3, [9, 10, 11])
    bm.check_invariants()
    bm.reset_prefix_cache()
    bm.check_invariants()
    for s in list(bm.seqs):
        bm.free(s)
    bm.check_invariants()
    assert bm.stats().num_free_blocks == 16


def test_core_reset_on_empty_pool_and_with_swapped_and_tenants() -> None:
    from pagedkv.block_manager_svc.core.tenants import TenantLedger

    bm = _core(num_cpu_blocks=8, preemption_mode="swap")
    assert bm.reset_prefix_cache() == (0, 0)
    bm.enable_tenancy(TenantLedger())
    bm.allocate("t.x", 8, list(range(8)), tenant="t")
    bm.commit("t.x", 8)
    assert bm.allocate("t.y", 8, list(range(8)), tenant="t").num_cached_tokens == 4  # hits x's block
    bm.commit("t.y", 8)
    bm.preempt("t.y", "swap")
    assert bm.ledger.of("t").cpu_blocks == 2 and bm.ledger.of("t").sequences == 2
    bm.reset_prefix_cache()
    bm.check_invariants()
    bm.swap_in("t.y")
    bm.check_invariants()


def test_core_events_get_all_blocks_cleared() -> None:
    bm = _core()
    assert bm.take_events() == []  # off by default: nothing recorded
    bm.enable_events(True)
    bm.allocate("a", 8, list(range(8)))
    bm.commit("a", 8)
    stored = bm.take_events()
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [e.block for e in stored] == bm.seqs["a"].block_ids[:2] and bm.take_events() == []
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert list(stored[1].token_ids or ()) == [4, 5, 6, 7]
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]


def _server(**kw: object):  # type: ignore[no-untyped-def]
    return start_server(BlockManagerSettings(port=0, num_gpu_blocks=16, block_size=4, **kw))  # type: ignore[arg-type]


def test_grpc_reset_dedupe_stats_and_event(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = _server(state_dir=str(tmp_path / "state"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, token_ids=list(range(9))))
            stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=4, token_ids=[7, 7, 7, 7]))
            stub.Step(pb.StepRequest(commit_seq_ids=["a", "b"], commit_num_computed_tokens=[9, 4]))
            stub.Free(pb.FreeRequest(seq_id="b"))
            stream = stub.WatchEvents(pb.WatchEventsRequest(), timeout=20)
            head = [next(stream) for _ in range(4)]  # cleared + 3 stored (snapshot)
            assert head[0].WhichOneof("event") == "all_blocks_cleared"
            got: list = []
            t = threading.Thread(target=lambda: got.append(next(stream)), daemon=True)
            t.start()
            resp = stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id="reset-1"))
            assert (resp.num_blocks_cleared, resp.num_blocks_freed) == (3, 1)
            t.join(10)
            stream.cancel()
            assert got and got[0].WhichOneof("event") == "all_blocks_cleared"
            assert got[0].version > head[0].version
            # A retry with the same id is answered from the dedupe window: nothing runs again.
            again = stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id="reset-1"))
            assert again == resp
            stats = stub.GetStats(pb.GetStatsRequest())
            assert stats.num_prefix_cache_resets == 1 and stats.num_hashed_blocks == 0
            assert stats.num_dedupe_hits == 1
            stub.Allocate(pb.AllocateRequest(seq_id="c", num_tokens=8, token_ids=list(range(8))))
            stub.Commit(pb.CommitRequest(seq_id="c", num_computed_tokens=8))  # re-hashed
        r.servicer._core.check_invariants()
        table_a = list(r.servicer._core.seqs["a"].block_ids)
        index = dict(r.servicer._core.pool.index)
    finally:
        r.stop(0)
    # Restart from the journal/snapshot: the reset is part of the recovered state.
    r2 = _server(state_dir=str(tmp_path / "state"))
    try:
        core = r2.servicer._core
        core.check_invariants()
        assert list(core.seqs["a"].block_ids) == table_a
        assert dict(core.pool.index) == index
        assert core.stats().num_prefix_cache_resets == 1
        with grpc.insecure_channel(f"127.0.0.1:{r2.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            # The remembered reply survives the restart too.
            again = stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id="reset-1"))
            assert (again.num_blocks_cleared, again.num_blocks_freed) == (3, 1)
            assert stub.GetStats(pb.GetStatsRequest()).num_prefix_cache_resets == 1
    finally:
        r2.stop(0)


def test_journal_replay_of_reset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Replay (no final snapshot: a crash) reproduces a reset between other mutations exactly."""
    from tests.block_manager_svc.reliability.conftest import crash

    state = str(tmp_path / "state")
    r = _server(state_dir=state, snapshot_every_ops=0, snapshot_interval_s=0)
    with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=8, token_ids=list(range(8))))
        stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=8))
        stub.Free(pb.FreeRequest(seq_id="a"))
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
        stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=8, token_ids=list(range(8))))
        stub.Commit(pb.CommitRequest(seq_id="b", num_computed_tokens=8))
    live = r.servicer._core
    want = (list(live.seqs["b"].block_ids), sorted(live.pool.free_list), dict(live.pool.index))
    crash(r)
    r2 = _server(state_dir=state)
    try:
        assert r2.reliability is not None and r2.servicer.reliable.recovery.replayed >= 6
        core = r2.servicer._core
        assert (list(core.seqs["b"].block_ids), sorted(core.pool.free_list), dict(core.pool.index)) == want
        assert core.num_prefix_cache_resets == 1
    finally:
        r2.stop(0)


def test_tenants_reset_is_admin_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.security.conftest import TOKENS, write_tokens

    r = _server(auth_tokens_file=write_tokens(tmp_path / "tokens.json"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            stub = pb_grpc.BlockManagerStub(ch)
            alice = (("authorization", f"Bearer {TOKENS['alice']}"),)
            root = (("authorization", f"Bearer {TOKENS['root']}"),)
            stub.Allocate(
                pb.AllocateRequest(seq_id="s", num_tokens=8, token_ids=list(range(8))), metadata=alice
            )
            stub.Commit(pb.CommitRequest(seq_id="s", num_computed_tokens=8), metadata=alice)
            with pytest.raises(grpc.RpcError) as e:
                stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id="x"), metadata=alice)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "admin" in e.value.details()
            assert r.servicer._core.stats().num_hashed_blocks == 2
            resp = stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(request_id="x"), metadata=root)
            assert resp.num_blocks_cleared == 2
            r.servicer._core.check_invariants()
            hit = stub.Allocate(
                pb.AllocateRequest(seq_id="t", num_tokens=8, token_ids=list(range(8))), metadata=alice
            )
            assert hit.num_cached_tokens == 0
    finally:
        r.stop(0)
