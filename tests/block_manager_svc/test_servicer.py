"""The gRPC API end to end: every RPC, every status code, state unchanged on error."""

from __future__ import annotations

import threading

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def call_error(fn, request) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=5)
    return info.value


def stats(stub) -> pb.Stats:  # type: ignore[no-untyped-def]
    return stub.GetStats(pb.GetStatsRequest(), timeout=5)


def test_allocate_prefix_hit_and_stats(stub) -> None:  # type: ignore[no-untyped-def]
    a = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=10, token_ids=list(range(10))))
    stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=10))
    b = stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=10, token_ids=list(range(10))))
    assert len(a.block_ids) == 3 and a.num_cached_tokens == 0
    assert b.num_cached_tokens == 8 and list(b.block_ids[:2]) == list(a.block_ids[:2])
    s = stats(stub)
    assert (s.block_size, s.num_gpu_blocks, s.num_sequences) == (4, 16, 2)
    assert s.prefix_query_tokens == 20 and s.prefix_hit_tokens == 8
    assert s.num_used_blocks == 4 and s.num_free_blocks == 12 and s.num_cached_blocks == 0


def test_a_step_allocation_may_skip_prefix_hits(stub) -> None:  # type: ignore[no-untyped-def]
    """alloc_skip_prefix_hits (prompt logprobs): the flagged item gets no hit, the other one does."""
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=10, token_ids=list(range(10))))
    stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=10))
    r = stub.Step(
        pb.StepRequest(
            alloc_seq_ids=["skip", "hit"],
            alloc_num_tokens=[10, 10],
            alloc_token_ids=list(range(10)) * 2,
            alloc_skip_prefix_hits=[True, False],
        )
    )
    assert not r.errors and list(r.alloc_num_cached_tokens) == [0, 8]


def test_a_step_fork_may_come_before_its_appends(stub) -> None:  # type: ignore[no-untyped-def]
    """fork_before_appends (beam search): the child forks from the parent's table before the
    Step's appends, so both append their own token and the shared tail is copied on write."""
    stub.Allocate(pb.AllocateRequest(seq_id="p", num_tokens=6, token_ids=list(range(6))))
    r = stub.Step(
        pb.StepRequest(
            append_seq_ids=["p", "c"],
            append_token_ids=[40, 41],
            fork_parent_seq_ids=["p"],
            fork_child_seq_ids=["c"],
            fork_before_appends=[True],
        )
    )
    assert not r.errors and len(r.ops.copies) == 1
    tables = [stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)) for s in ("p", "c")]
    assert [t.num_tokens for t in tables] == [7, 7]
    (p0, p1), (c0, c1) = (list(t.block_ids) for t in tables)
    assert p0 == c0 and len({p1, c1}) == 2  # the full block shared, the tail copied


def test_contract_only_committed_blocks_are_hits_and_stats_agree_with_events(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Prefix hits are committed blocks: Allocate A; B with the same prefix gets 0 hits; Commit A;
    C gets the hits; GetStats and WatchEvents agree (BlockStored only at commit)."""
    server = server_factory(num_gpu_blocks=32, block_size=4, enable_kv_events=True)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        stream = stub.WatchEvents(pb.WatchEventsRequest(), timeout=20)
        assert next(stream).WhichOneof("event") == "all_blocks_cleared"
        a = stub.Allocate(pb.AllocateRequest(seq_id="A", num_tokens=14, token_ids=prompt), timeout=5)
        b = stub.Allocate(pb.AllocateRequest(seq_id="B", num_tokens=14, token_ids=prompt), timeout=5)
        assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # A's blocks are not committed
        assert set(a.block_ids).isdisjoint(b.block_ids)
        s = stats(stub)
        assert s.num_hashed_blocks == 0 and s.num_committed_blocks == 0 and s.prefix_hit_tokens == 0
        # A partial commit enters only the full blocks it covers.
        assert (
            stub.Commit(pb.CommitRequest(seq_id="A", num_computed_tokens=9), timeout=5).num_committed_blocks
            == 2
        )
        assert (
            stub.Commit(pb.CommitRequest(seq_id="A", num_computed_tokens=14), timeout=5).num_committed_blocks
            == 3
        )
        assert (
            stub.Commit(pb.CommitRequest(seq_id="A", num_computed_tokens=5), timeout=5).num_committed_blocks
            == 3
        )
        c = stub.Allocate(pb.AllocateRequest(seq_id="C", num_tokens=14, token_ids=prompt), timeout=5)
        assert c.num_cached_tokens == 12 and list(c.block_ids[:3]) == list(a.block_ids[:3])
        s = stats(stub)
        assert s.num_hashed_blocks == 3 and s.num_committed_blocks == 3
        assert s.prefix_query_tokens == 42 and s.prefix_hit_tokens == 12
        events = [next(stream), next(stream)]
        stream.cancel()
    stored = [
        (list(e.block_stored.block_ids), [bytes(h) for h in e.block_stored.block_hashes]) for e in events
    ]
    assert all(e.WhichOneof("event") == "block_stored" for e in events)
    assert [b for ids, _ in stored for b in ids] == list(a.block_ids[:3])  # A's blocks, at its commits
    assert len({h for _, hs in stored for h in hs}) == s.num_hashed_blocks


def test_fork_append_copy_on_write_and_block_table(stub) -> None:  # type: ignore[no-untyped-def]
    a = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=6))
    f = stub.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="b"))
    assert list(f.block_ids) == list(a.block_ids)
    r = stub.Append(pb.AppendRequest(seq_id="a", num_tokens=3))
    assert r.replaced_last_block
    assert [(c.src, c.dst) for c in r.ops.copies] == [(a.block_ids[1], r.new_block_ids[0])]
    assert len(r.new_block_ids) == 2  # the copy + one block past the boundary
    t = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="a"))
    assert t.num_tokens == 9 and list(t.block_ids) == [a.block_ids[0], *r.new_block_ids]
    tb = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="b"))
    assert list(tb.block_ids) == list(a.block_ids) and tb.num_tokens == 6


def test_free_releases_and_cached_blocks_stay_findable(stub) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, token_ids=list(range(9))))
    stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=9))
    assert stub.Free(pb.FreeRequest(seq_id="a")).num_blocks_released == 3
    s = stats(stub)
    assert s.num_cached_blocks == 2 and s.num_free_blocks == 14 and s.num_sequences == 0
    again = stub.Allocate(pb.AllocateRequest(seq_id="a2", num_tokens=9, token_ids=list(range(9))))
    assert again.num_cached_tokens == 8


@pytest.mark.parametrize(
    "method, request_, code, fragment",
    [
        ("Allocate", pb.AllocateRequest(seq_id="", num_tokens=1), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (
            "Allocate",
            pb.AllocateRequest(seq_id="z", num_tokens=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_tokens",
        ),
        (
            "Allocate",
            pb.AllocateRequest(seq_id="z", num_tokens=3, token_ids=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids has 2",
        ),
        (
            "Allocate",
            pb.AllocateRequest(seq_id="z", num_tokens=65),
            grpc.StatusCode.INVALID_ARGUMENT,
            "whole pool",
        ),
        ("Allocate", pb.AllocateRequest(seq_id="live", num_tokens=1), grpc.StatusCode.ALREADY_EXISTS, "live"),
        (
            "Allocate",
            pb.AllocateRequest(seq_id="z", num_tokens=60),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "needs 15 blocks",
        ),
        ("Append", pb.AppendRequest(seq_id="nope", num_tokens=1), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            "Append",
            pb.AppendRequest(seq_id="live", num_tokens=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_tokens",
        ),
        (
            "Append",
            pb.AppendRequest(seq_id="live", num_tokens=1, token_ids=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids",
        ),
        (
            "Append",
            pb.AppendRequest(seq_id="live", num_tokens=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "whole pool",
        ),
        ("Fork", pb.ForkRequest(parent_seq_id="nope", child_seq_id="c"), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            "Fork",
            pb.ForkRequest(parent_seq_id="live", child_seq_id="live"),
            grpc.StatusCode.ALREADY_EXISTS,
            "live",
        ),
        (
            "Fork",
            pb.ForkRequest(parent_seq_id="live", child_seq_id=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "child",
        ),
        ("Free", pb.FreeRequest(seq_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        ("Free", pb.FreeRequest(seq_id=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ("GetBlockTable", pb.GetBlockTableRequest(seq_id="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            "Step",
            pb.StepRequest(append_seq_ids=["live"], append_num_tokens=[1, 1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "append_num_tokens",
        ),
        (
            "Commit",
            pb.CommitRequest(seq_id="live", num_computed_tokens=6),
            grpc.StatusCode.INVALID_ARGUMENT,
            "more than the 5 tokens",
        ),
        ("Commit", pb.CommitRequest(seq_id="nope", num_computed_tokens=1), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            "Commit",
            pb.CommitRequest(seq_id="", num_computed_tokens=1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "empty",
        ),
        (
            "Step",
            pb.StepRequest(commit_seq_ids=["live"], commit_num_computed_tokens=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "commit_num_computed_tokens",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x", "y"], alloc_num_tokens=[1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_num_tokens",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x"], alloc_num_tokens=[2], alloc_token_ids=[1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_token_ids",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x"], alloc_num_tokens=[2], alloc_lease_ids=["l", "m"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_lease_ids",
        ),
        (
            "Step",
            pb.StepRequest(fork_parent_seq_ids=["live"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "fork_child",
        ),
        # Wire shapes are the handler's to check (the core takes a well-formed StepBatch).
        (
            "Step",
            pb.StepRequest(append_seq_ids=["live"], append_num_tokens=[2], append_token_ids=[1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "append_token_ids has 1 entries but the counts add up to 2",
        ),
        (
            "Step",
            pb.StepRequest(append_seq_ids=["live"], append_token_ids=[1, 2], free_seq_ids=["live"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "append_token_ids has 2 entries",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x"], alloc_num_tokens=[2], alloc_priorities=[1, 2]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_priorities has 2 entries for 1 allocations",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x"], alloc_num_tokens=[2], alloc_cache_salts=["a", "b"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_cache_salts has 2 entries",
        ),
        (
            "Step",
            pb.StepRequest(alloc_seq_ids=["x"], alloc_num_tokens=[2], alloc_skip_prefix_hits=[True, False]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "alloc_skip_prefix_hits has 2 entries",
        ),
        (
            "Step",
            pb.StepRequest(
                fork_parent_seq_ids=["live"], fork_child_seq_ids=["x"], fork_before_appends=[True, True]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "fork_before_appends has 2 entries for 1 forks",
        ),
    ],
)
def test_bad_requests_get_precise_status_and_change_nothing(stub, method, request_, code, fragment) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(pb.AllocateRequest(seq_id="live", num_tokens=5, token_ids=[1, 2, 3, 4, 5]))
    before = (stats(stub), stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="live")))
    err = call_error(getattr(stub, method), request_)
    assert err.code() == code
    assert fragment in err.details()
    after = (stats(stub), stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="live")))
    assert after == before


def test_append_without_room_is_resource_exhausted(stub) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(pb.AllocateRequest(seq_id="big", num_tokens=56))  # 14 of 16 blocks
    stub.Allocate(pb.AllocateRequest(seq_id="small", num_tokens=4))
    before = stats(stub)
    err = call_error(stub.Append, pb.AppendRequest(seq_id="small", num_tokens=9))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 3 blocks but only 1 are available" in err.details()
    assert stats(stub) == before


def test_step_packed_form_returns_only_deltas(stub) -> None:  # type: ignore[no-untyped-def]
    ids = [f"s{i}" for i in range(3)]
    for sid in ids:
        stub.Allocate(pb.AllocateRequest(seq_id=sid, num_tokens=3))
    stub.Allocate(pb.AllocateRequest(seq_id="done", num_tokens=4))
    r = stub.Step(pb.StepRequest(append_seq_ids=ids, free_seq_ids=["done"]))
    assert not r.errors and not r.packed_new_block_ids and r.num_blocks_released == 1
    r = stub.Step(pb.StepRequest(append_seq_ids=ids + ["ghost"], append_token_ids=[7, 7, 7, 7]))
    assert list(r.packed_new_block_index) == [0, 1, 2] and len(r.packed_new_block_ids) == 3
    assert [(e.kind, e.index, e.seq_id, e.code) for e in r.errors] == [
        (pb.StepItemError.PACKED_APPEND, 3, "ghost", grpc.StatusCode.NOT_FOUND.value[0])
    ]
    assert r.num_available_blocks == stats(stub).num_free_blocks


def test_a_block_granted_ahead_is_the_one_the_sequence_grows_into(stub) -> None:  # type: ignore[no-untyped-def]
    """Grant: the block is held now (used blocks count it), a second grant returns the same id, the
    append that crosses the boundary reports that block, a refused grant changes nothing, and a
    free returns it to the pool."""
    a = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=3, token_ids=[1, 2, 3]))
    used = stats(stub).num_used_blocks
    r = stub.Step(pb.StepRequest(grant_seq_ids=["a", "ghost"]))
    assert list(r.packed_grant_index) == [0] and len(r.packed_grant_block_ids) == 1
    ahead = r.packed_grant_block_ids[0]
    assert ahead not in a.block_ids and stats(stub).num_used_blocks == used + 1
    assert [(e.kind, e.index, e.seq_id, e.code) for e in r.errors] == [
        (pb.StepItemError.GRANT, 1, "ghost", grpc.StatusCode.NOT_FOUND.value[0])
    ]
    again = stub.Step(pb.StepRequest(grant_seq_ids=["a"]))
    assert list(again.packed_grant_block_ids) == [ahead] and stats(stub).num_used_blocks == used + 1
    # Five tokens: one fills the last block, four go into the block granted ahead.
    r = stub.Step(
        pb.StepRequest(append_seq_ids=["a"], append_num_tokens=[5], append_token_ids=[4, 5, 6, 7, 8])
    )
    assert not r.errors and list(r.packed_new_block_ids) == [ahead]
    assert list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="a")).block_ids) == [*a.block_ids, ahead]
    assert stats(stub).num_used_blocks == used + 1
    stub.Step(pb.StepRequest(grant_seq_ids=["a"]))
    assert stats(stub).num_used_blocks == used + 2
    stub.Free(pb.FreeRequest(seq_id="a"))
    assert stats(stub).num_used_blocks == 0


def test_a_grant_never_takes_the_last_blocks_or_preempts(server_factory) -> None:  # type: ignore[no-untyped-def]
    bm = server_factory(num_gpu_blocks=4, block_size=4)
    with grpc.insecure_channel(f"127.0.0.1:{bm.port}") as channel:
        stub = pb_grpc.BlockManagerStub(channel)
        stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=12))
        stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=1))
        before = stats(stub)
        r = stub.Step(pb.StepRequest(grant_seq_ids=["b"]))
        assert not r.packed_grant_block_ids and not r.preempted
        assert [(e.kind, e.code) for e in r.errors] == [
            (pb.StepItemError.GRANT, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        ]
        assert "granting" in r.errors[0].message
        assert stats(stub) == before


def test_step_submessage_form_has_one_result_per_item(stub) -> None:  # type: ignore[no-untyped-def]
    a = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=2))
    stub.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="b"))
    stub.Allocate(pb.AllocateRequest(seq_id="x", num_tokens=1))
    r = stub.Step(
        pb.StepRequest(
            appends=[
                pb.AppendRequest(seq_id="a", num_tokens=1),
                pb.AppendRequest(seq_id="nope", num_tokens=1),
            ],
            frees=[pb.FreeRequest(seq_id="x"), pb.FreeRequest(seq_id="nope")],
        )
    )
    assert len(r.appends) == 2 and len(r.frees) == 2
    assert r.appends[0].replaced_last_block
    assert [(c.src, c.dst) for c in r.ops.copies] == [(a.block_ids[0], r.appends[0].new_block_ids[0])]
    assert r.frees[0].num_blocks_released == 1 and r.frees[1].num_blocks_released == 0
    kinds = sorted((e.kind, e.index) for e in r.errors)
    assert kinds == [(pb.StepItemError.APPEND, 1), (pb.StepItemError.FREE, 1)]


def test_step_carries_a_whole_iteration_in_the_documented_order(stub) -> None:  # type: ignore[no-untyped-def]
    """Commits, frees, appends, allocations and forks in one Step: the commit applies before
    the allocation in the same Step (so it already hits), forks see the allocation."""
    prompt = list(range(1, 10))  # 2 full blocks of 4 + 1
    stub.Allocate(pb.AllocateRequest(seq_id="run", num_tokens=9, token_ids=prompt))
    stub.Allocate(pb.AllocateRequest(seq_id="done", num_tokens=2))
    r = stub.Step(
        pb.StepRequest(
            commit_seq_ids=["run", "ghost"],
            commit_num_computed_tokens=[9, 1],
            free_seq_ids=["done"],
            append_seq_ids=["run"],
            append_token_ids=[50],
            alloc_seq_ids=["new", "dup", "bad"],
            alloc_num_tokens=[9, 1, 0],
            alloc_token_ids=prompt + [7],
            alloc_priorities=[1, 0, 0],
            fork_parent_seq_ids=["new", "nope"],
            fork_child_seq_ids=["new/1", "c"],
        )
    )
    kinds = sorted((e.kind, e.index, e.seq_id) for e in r.errors)
    assert kinds == [
        (pb.StepItemError.COMMIT, 1, "ghost"),
        (pb.StepItemError.ALLOCATE, 2, "bad"),
        (pb.StepItemError.FORK, 1, "c"),
    ]
    assert list(r.alloc_num_cached_tokens) == [8, 0, 0]
    tables: dict[int, list[int]] = {}
    for i, b in zip(r.packed_alloc_block_index, r.packed_alloc_block_ids, strict=False):
        tables.setdefault(i, []).append(b)
    run = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="run"))
    assert tables[0][:2] == list(run.block_ids[:2]) and len(tables[0]) == 3 and len(tables[1]) == 1
    assert list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="new/1")).block_ids) == tables[0]
    assert r.num_blocks_released == 1 and run.num_tokens == 10
    # Mixed sub-message + packed appends: sub-messages first, results mapped back to each form.
    r = stub.Step(
        pb.StepRequest(
            appends=[
                pb.AppendRequest(seq_id="new/1", num_tokens=1, token_ids=[5]),
                pb.AppendRequest(seq_id="dup", num_tokens=2, token_ids=[1]),
            ],
            append_seq_ids=["new", "ghost"],
        )
    )
    assert [(e.kind, e.index) for e in r.errors] == [
        (pb.StepItemError.APPEND, 1),
        (pb.StepItemError.PACKED_APPEND, 1),
    ]
    assert r.appends[0].replaced_last_block and len(r.appends) == 2 and not r.appends[1].new_block_ids
    assert list(r.packed_replaced_index) == [] and list(r.packed_new_block_index) == []  # "new" owns it now
    assert len(r.ops.copies) == 1


def test_get_config_reports_geometry(stub) -> None:  # type: ignore[no-untyped-def]
    cfg = stub.GetConfig(pb.GetConfigRequest())
    assert (cfg.block_size, cfg.num_gpu_blocks) == (4, 16)


def test_concurrent_clients_never_share_a_block(server_factory) -> None:  # type: ignore[no-untyped-def]
    running = server_factory(num_gpu_blocks=4096, block_size=4, max_workers=8)
    from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

    tables: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                s = pb_grpc.BlockManagerStub(ch)
                for i in range(40):
                    sid = f"w{worker}-{i}"
                    r = s.Allocate(pb.AllocateRequest(seq_id=sid, num_tokens=5), timeout=10)
                    blocks = list(r.block_ids)
                    for _ in range(4):
                        blocks += list(
                            s.Append(pb.AppendRequest(seq_id=sid, num_tokens=3), timeout=10).new_block_ids
                        )
                    if i % 3 == 0:
                        s.Free(pb.FreeRequest(seq_id=sid), timeout=10)
                    else:
                        tables[sid] = blocks
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    owned = [b for blocks in tables.values() for b in blocks]
    assert len(owned) == len(set(owned)), "a block was handed to two live sequences"
    core = running.servicer._core  # noqa: SLF001 - white-box check of the final state
    core.check_invariants()
    assert {k: list(v.block_ids) for k, v in core.seqs.items()} == tables


def test_step_reply_counts_prefix_cache_drops(stub) -> None:  # type: ignore[no-untyped-def]
    """StepResponse.prefix_cache_drops moves exactly when registered blocks leave the prefix cache
    (an eviction or a ResetPrefixCache): the engine trusts its finished sequences' prefixes only
    while it has not moved."""

    def drops() -> int:
        return stub.Step(pb.StepRequest(), timeout=5).prefix_cache_drops

    start = drops()
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=12, token_ids=list(range(12))))
    stub.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=12))
    stub.Free(pb.FreeRequest(seq_id="a"))  # 3 registered blocks, now cached
    assert drops() == start  # cached, nothing dropped
    assert stats(stub).num_cached_blocks == 3
    # 16 blocks: 13 free + 3 cached; asking for 15 evicts two cached blocks.
    stub.Allocate(pb.AllocateRequest(seq_id="big", num_tokens=60))
    assert drops() == start + 2
    stub.Free(pb.FreeRequest(seq_id="big"))
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=5)
    assert drops() == start + 3


def _error_info(err: grpc.RpcError) -> tuple[object, object]:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(err)  # what grpcurl and other ecosystem clients decode
    assert status is not None and status.code == err.code().value[0] and status.message == err.details()
    info = error_details_pb2.ErrorInfo()
    assert len(status.details) == 1 and status.details[0].Unpack(info)
    return status, info


def test_errors_carry_the_standard_rich_status_with_a_reason(stub) -> None:  # type: ignore[no-untyped-def]
    err = call_error(stub.Append, pb.AppendRequest(seq_id="nope", num_tokens=1))
    _, info = _error_info(err)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "SEQUENCE_NOT_FOUND",
        "pagedkv.block_manager",
        {"seq_id": "nope"},
    )
    stub.Allocate(pb.AllocateRequest(seq_id="big", num_tokens=60))
    err = call_error(stub.Allocate, pb.AllocateRequest(seq_id="more", num_tokens=16))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _error_info(err)[1].reason == "POOL_EXHAUSTED"
    err = call_error(stub.Allocate, pb.AllocateRequest(seq_id="big", num_tokens=1))
    assert _error_info(err)[1].reason == "SEQUENCE_EXISTS"
    err = call_error(stub.Step, pb.StepRequest(append_seq_ids=["big"], append_num_tokens=[1, 1]))
    assert _error_info(err)[1].reason == "INVALID_ARGUMENT"


def test_the_tenant_namespace_is_taken_off_the_rich_status_too() -> None:
    from google.rpc import error_details_pb2, status_pb2

    from pagedkv.block_manager_svc.handlers import rich_status
    from pagedkv.block_manager_svc.tenancy import _ScopedContext

    class Ctx:
        got: object = None

        def abort_with_status(self, status: object) -> None:
            self.got = status

    ctx = Ctx()
    prefix = "alice\x1f"
    _ScopedContext(ctx, prefix).abort_with_status(
        rich_status(
            grpc.StatusCode.NOT_FOUND,
            f"sequence {prefix + 's1'!r} does not exist",
            "SEQUENCE_NOT_FOUND",
            prefix + "s1",
        )
    )
    got = ctx.got
    assert got.code == grpc.StatusCode.NOT_FOUND and got.details == "sequence 's1' does not exist"  # type: ignore[attr-defined]
    ((key, value),) = got.trailing_metadata  # type: ignore[attr-defined]
    status = status_pb2.Status.FromString(value)
    info = error_details_pb2.ErrorInfo()
    assert key == "grpc-status-details-bin" and status.details[0].Unpack(info)
    assert status.message == "sequence 's1' does not exist" and dict(info.metadata) == {"seq_id": "s1"}
    assert "alice" not in repr(value)
