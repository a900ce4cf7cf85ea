"""Semantics of Allocate / Append / Fork / Free / Step on the pure core."""

from __future__ import annotations

import copy
import random
from array import array

import pytest

from pagedkv.block_manager_svc.core import (
    AlreadyExists,
    BlockManager,
    CoreConfig,
    ErrorCode,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StepBatch,
)

BS = 4


def make(num_blocks: int = 16, **kw: object) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=num_blocks,
            block_size=BS,
            **{"preemption_mode": "off", "eviction_policy": "lru", **kw},
        )
    )  # type: ignore[arg-type]


def snapshot(bm: BlockManager) -> object:
    """Everything observable about the state, for 'unchanged after error' checks."""
    pool = bm.pool
    return copy.deepcopy(
        (
            {
                k: (
                    list(s.block_ids),
                    s.num_tokens,
                    None if s.pending_tokens is None else list(s.pending_tokens),
                    s.last_hash,
                    s.num_hashed_blocks,
                )
                for k, s in bm.seqs.items()
            },
            list(pool.ref_counts),
            list(pool.free_list),
            list(pool.block_hash),
            dict(pool.index),
            list(pool.eviction_policy._order),  # type: ignore[attr-defined]
            bm.stats(),
        )
    )


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# --- Allocate ------------------------------------------------------------------


def test_allocate_rounds_up_to_whole_blocks() -> None:
    bm = make()
    r = bm.allocate("a", 9)
    assert len(r.block_ids) == 3 and r.num_cached_tokens == 0
    assert bm.block_table("a").num_tokens == 9
    assert len(set(r.block_ids)) == 3
    bm.check_invariants()


def test_prefix_hit_reuses_blocks_by_reference() -> None:
    bm = make()
    a = bm.allocate("a", 10, toks(10))
    assert bm.allocate("early", 10, toks(10)).num_cached_tokens == 0  # nothing committed yet
    bm.free("early")
    assert bm.commit("a", 10) == 2
    b = bm.allocate("b", 10, toks(10))
    # 10 tokens = 2 full blocks + 2; both full blocks are hits.
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert bm.pool.ref_counts[a.block_ids[0]] == 2
    st = bm.stats()
    assert st.prefix_query_tokens == 30 and st.prefix_hit_tokens == 8
    bm.check_invariants()


def test_hit_never_covers_the_last_prompt_token() -> None:
    bm = make()
    bm.allocate("a", 8, toks(8))
    bm.commit("a", 8)
    b = bm.allocate("b", 8, toks(8))
    # Both blocks are full and cached, but the last token must be computed.
    assert b.num_cached_tokens == 4
    assert len(b.block_ids) == 2


def test_skipping_prefix_hits_gives_fresh_blocks_that_still_enter_the_cache() -> None:
    """vLLM's skip_reading_prefix_cache (prompt logprobs need every position): no hit although the
    prefix is cached, and no query counted; the fresh blocks register at Commit where the content
    is new, while content another block already holds stays that block's (first writer wins)."""
    bm = make()
    a = bm.allocate("a", 9, toks(9))
    bm.commit("a", 9)
    r = bm.step(
        StepBatch(
            alloc_seq_ids=["s", "t"],
            alloc_num_tokens=[13, 9],
            alloc_token_ids=array("I", toks(13) + toks(9)),
            alloc_skip_prefix_hits=[True, False],
        )
    )
    assert r.alloc_num_cached_tokens == [0, 8]  # "t" beside it still hits
    s_blocks = bm.block_table("s").block_ids
    assert not set(s_blocks) & set(a.block_ids)
    assert bm.stats().prefix_query_tokens == 18  # "a" and "t": "s" asked for no hit
    bm.commit("s", 13)
    assert [bm.pool.index[bm.pool.block_hash[b]] for b in a.block_ids[:2]] == a.block_ids[:2]
    assert bm.pool.block_hash[s_blocks[0]] is None  # the same content as "a"'s: not cached twice
    third = bm.pool.block_hash[s_blocks[2]]
    assert third is not None and bm.pool.index[third] == s_blocks[2]  # new content: shareable
    assert bm.allocate("u", 14, toks(14)).num_cached_tokens == 12
    bm.check_invariants()


def test_a_fork_before_the_appends_lets_parent_and_child_append_different_tokens() -> None:
    """Beam search: a beam two continuations extend forks before the Step's appends, so the child
    shares the parent's table as it was (6 tokens, not 7) and each appends its own token; their
    shared last block is copied on the first write, the full block stays shared. A fork left
    unmarked still comes after the allocations, as an admission fork does."""
    bm = make()
    bm.allocate("p", 6, toks(6))
    bm.commit("p", 6)
    before = list(bm.block_table("p").block_ids)
    r = bm.step(
        StepBatch(
            append_seq_ids=["p", "c"],
            append_token_ids=array("I", [50, 51]),
            alloc_seq_ids=["q"],
            alloc_num_tokens=[3],
            alloc_token_ids=array("I", [7, 8, 9]),
            fork_parent_seq_ids=["p", "q"],
            fork_child_seq_ids=["c", "q2"],
            fork_before_appends=[True, False],
        )
    )
    assert not (r.append_errors or r.fork_errors)
    p, c = bm.block_table("p").block_ids, bm.block_table("c").block_ids
    assert p[0] == c[0] == before[0]  # the full block is shared
    assert len({p[1], c[1]}) == 2 and before[1] in (p[1], c[1])  # the tail was copied once
    assert len(r.ops.copies) == 1 and r.replaced_index == [0]  # the parent's write copied it
    assert bm.seqs["p"].num_tokens == bm.seqs["c"].num_tokens == 7
    assert list(bm.seqs["c"].pending_tokens or []) == [4, 5, 51]  # the child's own token
    assert bm.seqs["q2"].num_tokens == 3  # forked after its parent's allocation
    for seq_id in ("p", "c", "q", "q2"):
        bm.free(seq_id)
    assert bm.stats().num_used_blocks == 0
    bm.check_invariants()


def test_a_fork_before_the_appends_of_a_missing_parent_is_a_fork_error_at_its_index() -> None:
    bm = make()
    bm.allocate("p", 3, toks(3))
    r = bm.step(
        StepBatch(
            fork_parent_seq_ids=["p", "ghost"],
            fork_child_seq_ids=["c", "g"],
            fork_before_appends=[False, True],
        )
    )
    assert [(e.index, e.seq_id, e.code) for e in r.fork_errors] == [(1, "g", ErrorCode.NOT_FOUND)]
    assert "c" in bm.seqs and "g" not in bm.seqs


def test_hash_chains_whole_prefix_not_just_the_block() -> None:
    bm = make()
    bm.allocate("a", 9, toks(9))
    bm.commit("a", 9)
    # Same second block content, different first block: no hit anywhere.
    other = [99, 98, 97, 96] + toks(5, 4)
    assert bm.allocate("b", 9, other).num_cached_tokens == 0


def test_cached_blocks_survive_free_and_are_hit_later() -> None:
    bm = make()
    a = bm.allocate("a", 9, toks(9))
    bm.commit("a", 9)
    released = bm.free("a")
    assert released == 3
    st = bm.stats()
    assert st.num_cached_blocks == 2 and st.num_free_blocks == 14 and st.num_used_blocks == 0
    b = bm.allocate("b", 9, toks(9))
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert bm.stats().num_cached_blocks == 0
    bm.check_invariants()


def test_eviction_takes_cached_blocks_leaves_first_when_free_runs_out() -> None:
    bm = make(num_blocks=5)
    a = bm.allocate("a", 13, toks(13))
    bm.commit("a", 13)  # 3 full blocks registered + 1 partial
    bm.free("a")
    assert bm.stats().num_cached_blocks == 3 and bm.stats().num_free_blocks == 2
    # Needs 3 blocks: 2 free + 1 evicted; the evicted one must be the chain's leaf.
    b = bm.allocate("b", 12)
    assert bm.stats().num_evicted_blocks == 1
    assert a.block_ids[2] in b.block_ids and a.block_ids[0] not in b.block_ids
    bm.free("b")
    # The first two blocks of the chain are still a hit (no hole at the root).
    c = bm.allocate("c", 9, toks(9))
    assert c.num_cached_tokens == 8 and c.block_ids[:2] == a.block_ids[:2]
    bm.check_invariants()


def test_allocate_errors_leave_state_unchanged() -> None:
    bm = make(num_blocks=4)
    bm.allocate("a", 8, toks(8))
    before = snapshot(bm)
    cases = [
        (lambda: bm.allocate("a", 4), AlreadyExists),
        (lambda: bm.allocate("", 4), InvalidArgument),
        (lambda: bm.allocate("z", 0), InvalidArgument),
        (lambda: bm.allocate("z", 3, [1, 2]), InvalidArgument),
        (lambda: bm.allocate("z", 2, [1, -1]), InvalidArgument),
        (lambda: bm.allocate("z", 2, [1, 2**32]), InvalidArgument),
        (lambda: bm.allocate("z", 17), InvalidArgument),  # larger than the whole pool
        (lambda: bm.allocate("z", 9), ResourceExhausted),  # 3 blocks, 2 available
        (lambda: bm.allocate("x" * 300, 1), InvalidArgument),
    ]
    for call, exc in cases:
        with pytest.raises(exc) as info:
            call()
        assert info.value.message
        assert snapshot(bm) == before, f"state changed by a rejected call raising {exc.__name__}"


def test_resource_exhausted_message_says_needed_and_available() -> None:
    bm = make(num_blocks=4)
    bm.allocate("a", 8)
    with pytest.raises(ResourceExhausted) as info:
        bm.allocate("b", 12)
    msg = info.value.message
    assert "needs 3 blocks" in msg and "only 2 are available" in msg
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED


def test_exhaustion_accounts_for_hits_that_come_out_of_the_evictable_set() -> None:
    bm = make(num_blocks=3)
    bm.allocate("a", 9, toks(9))
    bm.commit("a", 9)
    bm.free("a")  # 2 cached, 1 free
    # Same prompt: 2 hits (taken from cache) + 1 new block; exactly fits.
    r = bm.allocate("b", 9, toks(9))
    assert r.num_cached_tokens == 8
    bm.check_invariants()


# --- Append --------------------------------------------------------------------


def test_append_adds_a_block_at_each_boundary() -> None:
    bm = make()
    bm.allocate("a", 3)
    assert bm.append("a", 1).new_block_ids == []  # fills block 0
    r = bm.append("a", 1)
    assert len(r.new_block_ids) == 1 and not r.ops
    r = bm.append("a", 9)  # 5 -> 14 tokens: 4 blocks total, 2 new
    assert len(r.new_block_ids) == 2
    assert bm.block_table("a").num_tokens == 14
    assert len(bm.block_table("a").block_ids) == 4
    bm.check_invariants()


def test_append_copy_on_write_of_shared_partial_block() -> None:
    bm = make()
    a = bm.allocate("a", 6)
    bm.fork("a", "b")
    r = bm.append("a", 1)
    assert r.replaced_last_block
    assert r.ops.copies == [(a.block_ids[1], r.new_block_ids[0])]
    table_a = bm.block_table("a").block_ids
    table_b = bm.block_table("b").block_ids
    assert table_a[0] == table_b[0] and table_a[1] != table_b[1]
    assert table_a[1] == r.new_block_ids[0]
    # b now owns the old tail alone: appending to it needs no copy.
    r2 = bm.append("b", 1)
    assert not r2.ops and r2.new_block_ids == []
    assert bm.stats().num_cow_copies == 1
    bm.check_invariants()


def test_append_to_shared_full_tail_needs_no_copy() -> None:
    bm = make()
    bm.allocate("a", 8)
    bm.fork("a", "b")
    r = bm.append("a", 1)
    assert not r.replaced_last_block and not r.ops.copies and len(r.new_block_ids) == 1


def test_append_registers_blocks_that_become_full_at_commit() -> None:
    bm = make()
    bm.allocate("a", 3, toks(3))
    bm.append("a", 3, [3, 4, 5])  # block 0 full, block 1 has 2 tokens
    assert bm.stats().num_hashed_blocks == 0  # full, but its KV is not written yet
    assert bm.allocate("early", 6, toks(6)).num_cached_tokens == 0
    bm.free("early")
    assert bm.commit("a", 6) == 1
    assert bm.stats().num_hashed_blocks == 1
    # A new prompt with the same first 4 tokens hits block 0.
    assert bm.allocate("b", 6, toks(6)).num_cached_tokens == 4


def test_append_without_token_ids_stops_hashing_for_the_sequence() -> None:
    bm = make()
    bm.allocate("a", 3, toks(3))
    bm.append("a", 1)  # unknown token
    bm.append("a", 4, toks(4, 10))
    bm.commit("a", 8)
    assert bm.stats().num_hashed_blocks == 0


def test_append_errors_leave_state_unchanged() -> None:
    bm = make(num_blocks=3)
    bm.allocate("a", 4)
    bm.fork("a", "b")
    bm.allocate("c", 5)
    before = snapshot(bm)
    for call, exc in [
        (lambda: bm.append("nope", 1), NotFound),
        (lambda: bm.append("a", 0), InvalidArgument),
        (lambda: bm.append("a", 2, [1]), InvalidArgument),
        (lambda: bm.append("a", 100), InvalidArgument),  # more than the pool
        (lambda: bm.append("a", 5), ResourceExhausted),  # needs 2, 0 available
        (lambda: bm.append("c", 4), ResourceExhausted),
    ]:
        with pytest.raises(exc):
            call()
        assert snapshot(bm) == before


def test_cow_needs_room_and_fails_cleanly_without_it() -> None:
    bm = make(num_blocks=2)
    bm.allocate("a", 2)
    bm.fork("a", "b")
    bm.allocate("c", 1)
    before = snapshot(bm)
    with pytest.raises(ResourceExhausted):
        bm.append("a", 1)  # shared partial tail, no block for the copy
    assert snapshot(bm) == before


# --- Fork / Free ---------------------------------------------------------------


def test_fork_shares_every_block() -> None:
    bm = make()
    a = bm.allocate("a", 9)
    assert bm.fork("a", "b") == a.block_ids
    assert all(bm.pool.ref_counts[b] == 2 for b in a.block_ids)
    with pytest.raises(AlreadyExists):
        bm.fork("a", "b")
    with pytest.raises(NotFound):
        bm.fork("zz", "c")
    with pytest.raises(InvalidArgument):
        bm.fork("a", "")
    bm.check_invariants()


def test_free_releases_only_unshared_blocks() -> None:
    bm = make()
    bm.allocate("a", 9)
    bm.fork("a", "b")
    bm.append("b", 3)  # b: blocks 0,1 shared; tail copied; plus nothing new (12 tokens)
    assert bm.free("a") == 1  # only a's private tail
    assert bm.free("b") == 3
    assert bm.stats().num_used_blocks == 0
    with pytest.raises(NotFound):
        bm.free("a")
    bm.check_invariants()


def test_everything_free_after_all_sequences_are_freed() -> None:
    bm = make(num_blocks=64)
    rng = random.Random(1)
    for i in range(20):
        bm.allocate(f"s{i}", rng.randint(1, 20), [rng.randrange(3) for _ in range(0)] or None)
    for i in range(0, 20, 3):
        bm.fork(f"s{i}", f"f{i}")
    for sid in list(bm.seqs):
        bm.free(sid)
    st = bm.stats()
    assert st.num_used_blocks == 0 and st.num_free_blocks + st.num_cached_blocks == 64
    bm.check_invariants()


# --- Step ----------------------------------------------------------------------


def test_step_packed_appends_and_frees_with_per_item_errors() -> None:
    bm = make(num_blocks=8)
    bm.allocate("a", 4, toks(4))
    bm.allocate("b", 3)
    bm.allocate("gone", 4)
    r = bm.step(
        StepBatch(
            append_seq_ids=["a", "missing", "b"],
            append_token_ids=array("I", [7, 8, 9]),
            free_seq_ids=["gone", "never"],
        )
    )
    assert r.released == [1, 0]
    assert [(e.index, e.code) for e in r.free_errors] == [(1, ErrorCode.NOT_FOUND)]
    assert [(e.index, e.seq_id, e.code) for e in r.append_errors] == [(1, "missing", ErrorCode.NOT_FOUND)]
    # a crossed a boundary (new block); b filled its tail (no new block).
    assert r.new_block_index == [0] and len(r.new_block_ids) == 1
    assert bm.block_table("a").num_tokens == 5 and bm.block_table("b").num_tokens == 4
    bm.check_invariants()


def test_step_frees_before_appends_so_freed_room_is_usable() -> None:
    bm = make(num_blocks=2)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    r = bm.step(StepBatch(append_seq_ids=["a"], free_seq_ids=["b"]))
    assert not r.append_errors and len(r.new_block_ids) == 1


def test_step_item_that_does_not_fit_changes_nothing_and_others_apply() -> None:
    bm = make(num_blocks=4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.allocate("c", 3)
    r = bm.step(StepBatch(append_seq_ids=["a", "b", "c"], append_num_tokens=[1, 1, 1]))
    # a takes the last block; b cannot grow; c fills its tail.
    assert [e.seq_id for e in r.append_errors] == ["b"]
    assert r.append_errors[0].code is ErrorCode.RESOURCE_EXHAUSTED
    assert bm.block_table("b").num_tokens == 4
    assert bm.block_table("c").num_tokens == 4
    bm.check_invariants()


def test_step_reports_copy_on_write() -> None:
    bm = make()
    a = bm.allocate("a", 2)
    bm.fork("a", "b")
    r = bm.step(StepBatch(append_seq_ids=["a", "b"]))
    assert r.replaced_index == [0]
    assert r.ops.copies == [(a.block_ids[0], r.new_block_ids[0])]
    assert r.new_block_index == [0]
    bm.check_invariants()


def test_step_packed_allocations_and_forks_come_back_as_deltas() -> None:
    bm = make()
    bm.allocate("a", 4)
    r = bm.step(
        StepBatch(
            alloc_seq_ids=["n", "a", "m"],
            alloc_num_tokens=[5, 1, 2],
            fork_parent_seq_ids=["n", "m"],
            fork_child_seq_ids=["n/1", "a"],
        )
    )
    assert r.alloc_num_cached_tokens == [0, 0, 0]
    assert [(e.index, e.code) for e in r.alloc_errors] == [(1, ErrorCode.ALREADY_EXISTS)]
    assert [(e.index, e.code) for e in r.fork_errors] == [(1, ErrorCode.ALREADY_EXISTS)]
    assert r.alloc_block_index == [0, 0, 2]
    assert r.alloc_block_ids[:2] == bm.block_table("n").block_ids == bm.block_table("n/1").block_ids
    bm.check_invariants()


def test_commit_is_idempotent_bounded_and_owned_by_the_physical_block() -> None:
    bm = make()
    bm.allocate("a", 9, toks(9))
    with pytest.raises(InvalidArgument, match="more than the 9 tokens"):
        bm.commit("a", 10)
    with pytest.raises(NotFound):
        bm.commit("nope", 1)
    assert bm.commit("a", 5) == 1 and bm.commit("a", 3) == 1 and bm.commit("a", 5) == 1
    bm.fork("a", "child")  # the child inherits the committed state of the blocks it shares
    assert bm.seqs["child"].num_committed == 5
    assert bm.commit("a", 9) == 2 and bm.stats().num_committed_blocks == 2
    assert bm.commit("child", 9) == 2 and bm.stats().num_committed_blocks == 2  # already registered
    bm.check_invariants()
    # A freed block that is reused starts uncommitted: no hit on it.
    bm.free("a")
    bm.free("child")
    bm.allocate("big", 64)  # takes every block, evicting the cached ones
    bm.free("big")
    assert bm.allocate("again", 9, toks(9)).num_cached_tokens == 0


def test_step_equals_the_same_appends_one_by_one() -> None:
    """The decode fast path must agree with the general path."""
    rng = random.Random(7)
    a, b = make(num_blocks=200), make(num_blocks=200)
    for bm in (a, b):
        for i in range(10):
            r2 = random.Random(i)
            n = r2.randint(1, 9)
            bm.allocate(f"s{i}", n, [r2.randrange(5) for _ in range(n)])
        bm.fork("s0", "f0")
        bm.fork("s3", "f3")
    ids = list(a.seqs)
    for _ in range(30):
        tokens = [rng.randrange(5) for _ in ids]
        a.step(StepBatch(append_seq_ids=ids, append_token_ids=array("I", tokens)))
        for sid, t in zip(ids, tokens, strict=True):
            b.append(sid, 1, [t])
        for bm in (a, b):  # the engine's commits: everything but the newest token
            bm.step(
                StepBatch(
                    commit_seq_ids=ids, commit_num_computed_tokens=[bm.seqs[s].num_tokens - 1 for s in ids]
                )
            )
    assert snapshot(a) == snapshot(b)
    a.check_invariants()
