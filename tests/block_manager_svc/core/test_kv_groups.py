"""KV-cache groups in the core: a full group and a sliding-window group over one pool.

B = 4 tokens per block and W = 8 tokens: a window group's table starts at block
first_live(c) = max(0, (c - 7) // 4) of a sequence with c committed tokens
(core/kv_groups.py). Every test asserts real tables and counts, and the
invariant checker (every block's ref count = references from every group's
table + the cache) after each step.
"""

from __future__ import annotations

from array import array

import pytest

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, CoreError, StepBatch
from pagedkv.block_manager_svc.core.errors import (
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from pagedkv.block_manager_svc.core.kv_events import BlockRemoved, BlockStored
from pagedkv.block_manager_svc.core.kv_groups import (
    KVGroup,
    format_kv_groups,
    group_key,
    parse_kv_groups,
)
from pagedkv.block_manager_svc.core.tenants import Quota, TenantLedger

BS, W = 4, 8
TWO = (KVGroup.full(), KVGroup.window(W))


def core(num_gpu_blocks: int = 32, **kw: object) -> BlockManager:
    return BlockManager(CoreConfig(num_gpu_blocks=num_gpu_blocks, block_size=BS, kv_groups=TWO, **kw))  # type: ignore[arg-type]


def used(bm: BlockManager) -> int:
    return bm.stats().num_used_blocks


def window(bm: BlockManager, seq_id: str) -> list[int]:
    return bm.block_table(seq_id).kv_block_ids[0]


def first_live(c: int) -> int:
    return max(0, (c - W + 1) // BS)


# --- configuration ---------------------------------------------------------------------------
def test_groups_parse_format_and_validate() -> None:
    gemma = parse_kv_groups("full, window:512x5")
    assert gemma == (KVGroup.full(), *[KVGroup.window(512)] * 5)
    assert format_kv_groups(gemma) == "full,window:512x5"
    assert parse_kv_groups("") == (KVGroup.full(),)
    assert parse_kv_groups("full,full,window:8") == (KVGroup.full(), KVGroup.full(), KVGroup.window(8))
    for bad in ("window:8,full", "full,window:0", "full,sliding", "full,window:8x0", "full,window:x"):
        with pytest.raises(ValueError):
            parse_kv_groups(bad)
    with pytest.raises(ValueError, match="group 0"):
        CoreConfig(num_gpu_blocks=8, kv_groups=(KVGroup.window(8), KVGroup.full()))
    assert KVGroup.window(512).max_live_blocks(16) == 33 and KVGroup.full().max_live_blocks(16) is None
    assert group_key(b"h" * 16, 0) == b"h" * 16 and group_key(b"h" * 16, 3) == b"h" * 16 + b"\x03"


# --- a window group's blocks are released as the sequence grows ---------------------------------
def test_window_blocks_are_released_as_commits_advance() -> None:
    bm = core()
    a = bm.allocate("a", 10, list(range(10)))
    assert len(a.block_ids) == 3 and len(a.kv_block_ids[0]) == 3  # nothing computed: all needed
    assert set(a.block_ids).isdisjoint(a.kv_block_ids[0]) and used(bm) == 6
    bm.commit("a", 10)  # next position 10 reads tokens [3, 10]: block 0 still in the window
    assert window(bm, "a") == a.kv_block_ids[0] and used(bm) == 6
    r = bm.append("a", 6, list(range(10, 16)))
    assert (
        len(r.new_block_ids) == 1 and len(r.kv_new_block_ids[0]) == 1 and r.kv_replaced_last_block == [False]
    )
    assert window(bm, "a") == [*a.kv_block_ids[0], *r.kv_new_block_ids[0]] and used(bm) == 8
    bm.commit("a", 16)  # next position 16 reads [9, 16]: blocks 0 and 1 fall out
    assert window(bm, "a") == [a.kv_block_ids[0][2], r.kv_new_block_ids[0][0]]
    assert used(bm) == 6
    # They were committed: they went to the evictable cache under the window group's key.
    pool = bm.pool
    for b in a.kv_block_ids[0][:2]:
        assert pool.ref_counts[b] == 0 and b in pool.eviction_policy
        h = pool.block_hash[b]
        assert h is not None and len(h) == 17 and h[16] == 1
    assert bm.stats().num_cached_blocks == 2
    bm.check_invariants()


def test_uncommitted_content_goes_back_to_the_free_list() -> None:
    bm = core()
    bm.allocate("a", 16)  # no token ids: nothing can be cached
    free_before = bm.pool.num_free
    bm.commit("a", 16)
    assert len(window(bm, "a")) == 2 and bm.pool.num_free == free_before + 2
    assert bm.stats().num_cached_blocks == 0
    bm.check_invariants()


@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
def test_exact_counts_while_decoding(chunk: int) -> None:
    """At every length, the window group holds exactly the blocks from first_live(committed) on,
    and at most ceil(W/B) + 1 = 3 of them once all but the positions in flight are committed."""
    bm = core(64)
    bm.allocate("a", 5, list(range(5)))
    n = 5
    while n < 120:
        bm.commit("a", n - 1)  # the last position is still to be computed
        nblocks = -(-n // BS)
        assert len(bm.seqs["a"].block_ids) == nblocks
        assert len(window(bm, "a")) == nblocks - first_live(n - 1) <= 3
        assert used(bm) == nblocks + nblocks - first_live(n - 1)
        bm.check_invariants()
        bm.append("a", chunk, [n % 7] * chunk)
        n += chunk


def test_gemma_3_270m_holds_one_full_table_and_five_windows_at_8k() -> None:
    """18 layers: 3 global + 15 with a 512-token window = 6 groups of 3 layers, B = 16. At 8k
    tokens a sequence holds the full group's 512 blocks and 32 per window group, against
    6 * 512 with one table for every layer: within (1/6 of the full table + 5/6 of one window,
    in all-layer blocks) + one block per group."""
    groups = parse_kv_groups("full,window:512x5")
    bm = BlockManager(CoreConfig(num_gpu_blocks=4096, block_size=16, kv_groups=groups))
    bm.allocate("g", 512)
    tokens = 512
    while tokens < 8192:
        bm.commit("g", tokens)
        bm.append("g", 512)
        tokens += 512
    bm.commit("g", tokens - 1)  # decoding: the last position is in flight
    full_table, one_window = 8192 // 16, 512 // 16
    assert len(bm.seqs["g"].block_ids) == full_table
    assert [len(t) for t in bm.seqs["g"].kv_tables] == [one_window] * 5
    assert used(bm) == full_table + 5 * one_window == 672
    assert used(bm) <= full_table + 5 * one_window + len(groups)
    bm.check_invariants()
    assert bm.free("g") == 672 and used(bm) == 0


# --- prefix hits with a window -------------------------------------------------------------------
def test_a_hit_needs_only_the_last_window_of_a_window_group() -> None:
    bm = core()
    prompt = list(range(20))
    a = bm.allocate("a", 20, prompt)
    bm.commit("a", 20)  # registers 5 blocks in each group; the window keeps blocks 3 and 4
    assert len(window(bm, "a")) == 2
    bm.free("a")
    assert used(bm) == 0 and bm.stats().num_cached_blocks == 10
    b = bm.allocate("b", 21, [*prompt, 99])
    assert b.num_cached_tokens == 20
    assert b.block_ids[:5] == a.block_ids
    # The window group's hit is blocks [first_live(20), 5) = [3, 5): a's last two, then a new one.
    assert b.kv_block_ids[0][:2] == a.kv_block_ids[0][3:] and len(b.kv_block_ids[0]) == 3
    assert used(bm) == 6 + 3
    bm.check_invariants()


def _evict_window_prefix() -> tuple[BlockManager, list[int]]:
    """'a' holds 16 committed tokens; its window released blocks 0 and 1, then a filler that took
    every available block evicted them. The full group's blocks are all still held by 'a'."""
    bm = core(16, eviction_policy="lru")
    prompt = list(range(16))
    bm.allocate("a", 8, prompt[:8])
    bm.commit("a", 8)
    bm.append("a", 8, prompt[8:])
    bm.commit("a", 16)
    assert len(window(bm, "a")) == 2 and bm.stats().num_cached_blocks == 2
    assert bm.pool.num_available == 10
    bm.allocate("filler", 17)  # 5 blocks per group: every free block and both cached ones
    bm.free("filler")
    assert bm.stats().num_cached_blocks == 0
    return bm, prompt


def test_a_hit_counts_only_where_every_group_serves_it() -> None:
    bm, prompt = _evict_window_prefix()
    # Blocks 0 and 1 of the full group are cached (held by 'a'); the window group's are gone, and
    # a hit of 1 or 2 blocks needs them: no hit at all.
    b = bm.allocate("b", 9, prompt[:8] + [5])
    assert b.num_cached_tokens == 0
    assert set(b.block_ids).isdisjoint(bm.seqs["a"].block_ids)
    bm.check_invariants()
    # The same prompt on a one-group manager would hit 8 tokens: the window group decides.
    one = BlockManager(CoreConfig(num_gpu_blocks=16, block_size=BS))
    one.allocate("a", 16, prompt)
    one.commit("a", 16)
    assert one.allocate("b", 9, prompt[:8] + [5]).num_cached_tokens == 8


def test_a_longer_hit_skips_the_released_window_blocks() -> None:
    bm, prompt = _evict_window_prefix()
    # A hit of 4 blocks needs the window group's [first_live(16), 4) = [2, 4) only: 'a' holds them.
    b = bm.allocate("b", 17, [*prompt, 1])
    assert b.num_cached_tokens == 16
    assert b.block_ids[:4] == bm.seqs["a"].block_ids
    assert b.kv_block_ids[0][:2] == window(bm, "a") and len(b.kv_block_ids[0]) == 3
    bm.check_invariants()


# --- fork and copy-on-write per group -----------------------------------------------------------
def test_fork_shares_every_group_and_copies_each_shared_tail() -> None:
    bm = core()
    a = bm.allocate("a", 6, list(range(6)))
    assert bm.fork("a", "b") == a.block_ids
    assert bm.block_table("b").kv_block_ids == [a.kv_block_ids[0]]
    assert all(bm.pool.ref_counts[x] == 2 for x in (*a.block_ids, *a.kv_block_ids[0]))
    assert used(bm) == 4
    r = bm.append("b", 1, [6])
    assert r.replaced_last_block and r.kv_replaced_last_block == [True]
    assert [c[0] for c in r.ops.copies] == [a.block_ids[1], a.kv_block_ids[0][1]]
    assert [c[1] for c in r.ops.copies] == [r.new_block_ids[0], r.kv_new_block_ids[0][0]]
    assert bm.block_table("b").kv_block_ids == [[a.kv_block_ids[0][0], r.kv_new_block_ids[0][0]]]
    assert bm.block_table("a").kv_block_ids == [a.kv_block_ids[0]]
    assert used(bm) == 6 and bm.stats().num_cow_copies == 2
    bm.check_invariants()
    # The parent's own next token finds private tails: no copy.
    r = bm.append("a", 1, [7])
    assert not r.ops.copies and not r.new_block_ids and r.kv_new_block_ids == [[]]
    bm.check_invariants()


def test_fork_children_release_their_window_on_their_own() -> None:
    bm = core()
    bm.allocate("a", 16, list(range(16)))
    bm.fork("a", "b")
    bm.commit("b", 16)  # b's window drops blocks 0 and 1; a still holds them
    assert len(window(bm, "b")) == 2 and len(window(bm, "a")) == 4
    assert window(bm, "b") == window(bm, "a")[2:]
    assert used(bm) == 8
    bm.check_invariants()
    bm.commit("a", 16)
    assert used(bm) == 6 and bm.stats().num_cached_blocks == 2
    bm.check_invariants()


# --- swap and preemption ----------------------------------------------------------------------
def test_swap_out_and_in_move_only_live_blocks_of_every_group() -> None:
    bm = core(32, num_cpu_blocks=16, preemption_mode="swap")
    bm.allocate("a", 14, list(range(14)))
    bm.commit("a", 14)  # window: blocks [1, 4)
    bm.fork("a", "b")
    assert len(window(bm, "a")) == 3 and used(bm) == 7
    preempted, ops = bm.preempt("a", "swap")
    assert sorted(p.seq_id for p in preempted) == ["a", "b"] and preempted[0].num_blocks == 7
    assert len(ops.swap_out) == 7 and used(bm) == 0
    t = bm.block_table("a")
    assert t.swapped and len(t.cpu_block_ids) == 4 and [len(x) for x in t.kv_cpu_block_ids] == [3]
    assert bm.block_table("b").kv_cpu_block_ids == t.kv_cpu_block_ids
    bm.check_invariants()
    back = bm.swap_in("b")
    assert len(back.ops.swap_in) == 7 and set(back.tables) == {"a", "b"}
    assert back.kv_tables["a"] == back.kv_tables["b"] and len(back.kv_tables["a"][0]) == 3
    assert bm.block_table("a").kv_block_ids == back.kv_tables["a"]
    assert used(bm) == 7 and bm.cpu.num_free == 16
    bm.check_invariants()
    # The window goes on sliding after the round trip.
    bm.append("a", 2, [1, 2])
    bm.commit("a", 16)
    assert len(window(bm, "a")) == 2
    bm.check_invariants()


def test_growth_preempts_counting_every_group() -> None:
    bm = core(12, preemption_mode="recompute")
    bm.allocate("low", 12, priority=0)  # 3 + 3 blocks
    bm.allocate("high", 12, priority=1)  # 3 + 3: the pool is full
    assert bm.pool.num_available == 0
    r = bm.append("high", 1)  # needs one block per group: preempts "low", freeing 6
    assert [p.seq_id for p in r.preempted] == ["low"] and r.preempted[0].num_blocks == 6
    assert len(r.new_block_ids) == 1 and len(r.kv_new_block_ids[0]) == 1
    assert used(bm) == 8
    bm.check_invariants()


def test_admission_counts_every_group() -> None:
    bm = core(10)
    with pytest.raises(InvalidArgument, match="2 KV groups"):
        bm.allocate("a", 21)  # 6 blocks per group: 12 > the whole pool
    bm.allocate("s", 4)
    with pytest.raises(ResourceExhausted):
        bm.allocate("a", 20)  # 5 + 5 > the 8 left
    bm.free("s")
    bm.allocate("a", 20)  # 5 + 5
    assert bm.pool.num_available == 0
    with pytest.raises(CoreError) as e:
        bm.allocate("b", 1)
    assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED
    with pytest.raises(CoreError) as e:
        bm.append("a", 1)  # 6 + 6 uncommitted: not now, but it fits once the window slides
    assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED
    with pytest.raises(InvalidArgument, match="more than the whole pool"):
        bm.append("a", 21)  # 11 blocks of the full group alone: never
    bm.commit("a", 20)  # the window keeps 2 of its 5: 3 blocks back
    assert bm.pool.num_free == 3
    bm.allocate("b", 4)  # one block per group: one left
    r = bm.append("a", 1)  # one per group: the later arrival "b" yields its two
    assert [(p.seq_id, p.num_blocks) for p in r.preempted] == [("b", 2)]
    assert used(bm) == 9 and bm.block_table("a").num_tokens == 21
    bm.check_invariants()


def test_free_returns_every_group_and_grant_is_refused() -> None:
    bm = core()
    bm.allocate("a", 13, list(range(13)))
    bm.fork("a", "b")
    bm.append("b", 3, [1, 2, 3])
    bm.commit("b", 16)
    with pytest.raises(FailedPrecondition) as e:
        bm.grant("a")
    assert e.value.reason == "GRANT_UNSUPPORTED_WITH_KV_GROUPS"
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert used(bm) == 0 and not any(bm.pool.ref_counts)
    assert bm.pool.num_free + bm.stats().num_cached_blocks == 32
    bm.check_invariants()


def test_tenant_usage_counts_every_group_and_shrinks_as_the_window_slides() -> None:
    bm = core()
    ledger = TenantLedger(default_quota=Quota(max_gpu_blocks=7))
    bm.enable_tenancy(ledger)
    bm.allocate("a", 12, list(range(12)), tenant="t")
    assert ledger.usage["t"].gpu_blocks == 6
    with pytest.raises(ResourceExhausted) as e:
        bm.append("a", 1)  # one block per group: 8 > 7
    assert e.value.reason == "TENANT_QUOTA_EXCEEDED"
    bm.commit("a", 12)  # the window releases block 0
    assert ledger.usage["t"].gpu_blocks == 5
    bm.append("a", 1)
    assert ledger.usage["t"].gpu_blocks == 7
    bm.check_invariants()  # usage == a recount from every group's tables
    bm.free("a")
    assert ledger.usage["t"].gpu_blocks == 0 and ledger.usage["t"].sequences == 0


# --- Step, events, reset ----------------------------------------------------------------------
def test_step_reports_every_group() -> None:
    bm = core()
    bm.allocate("a", 7, list(range(7)))
    bm.fork("a", "f")
    r = bm.step(
        StepBatch(
            commit_seq_ids=["a"],
            commit_num_computed_tokens=[7],
            append_seq_ids=["a", "f"],
            append_num_tokens=[2, 1],
            append_token_ids=array("I", [7, 8, 7]),
            alloc_seq_ids=["n"],
            alloc_num_tokens=[5],
            alloc_token_ids=array("I", range(5)),
        )
    )
    assert not r.append_errors and not r.alloc_errors and len(r.kv_groups) == 1
    g = r.kv_groups[0]
    # a: shared tail copied in both groups, then one new block each; f then owns its tails.
    assert r.replaced_index == [0] and g.replaced_index == [0] and len(r.ops.copies) == 2
    assert g.new_block_index == [0, 0] and window(bm, "a")[-2:] == g.new_block_ids
    assert r.new_block_index == [0, 0] and bm.seqs["a"].block_ids[-2:] == r.new_block_ids
    assert g.alloc_block_index == [0, 0] and window(bm, "n") == g.alloc_block_ids
    assert bm.block_table("f").kv_block_ids[0] != window(bm, "a")
    bm.check_invariants()
    # The decode fast path keeps every group's private tail.
    r = bm.step(StepBatch(append_seq_ids=["n", "a"], append_token_ids=array("I", [1, 2])))
    assert not r.append_errors and not r.ops.copies and r.kv_groups[0].new_block_ids == []
    assert bm.seqs["n"].num_tokens == 6 and bm.seqs["a"].num_tokens == 10
    # f's tail is full: its next token takes a new block in each group.
    r = bm.step(StepBatch(append_seq_ids=["f"], append_token_ids=array("I", [3])))
    assert len(r.new_block_ids) == 1 and len(r.kv_groups[0].new_block_ids) == 1
    bm.check_invariants()


def test_events_name_the_group_and_reset_clears_every_group() -> None:
    bm = core(12, eviction_policy="lru")
    bm.enable_events(True)
    bm.allocate("a", 9, list(range(9)))
    bm.commit("a", 8)
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert [(e.group, e.block) for e in stored] == [
        (0, bm.seqs["a"].block_ids[0]),
        (1, window(bm, "a")[0]),
        (0, bm.seqs["a"].block_ids[1]),
        (1, window(bm, "a")[1]),
    ]
    assert stored[0].block_hash == stored[1].block_hash and len(stored[1].block_hash) == 16
    assert stored[2].parent_hash == stored[0].block_hash and stored[3].parent_hash is None
    bm.free("a")
    bm.allocate("x", 24)  # 6 blocks per group: evicts every cached block
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(e.group for e in removed) == [0, 0, 1, 1]
    bm.free("x")
    bm.allocate("a", 9, list(range(9)))
    bm.commit("a", 8)
    assert bm.reset_prefix_cache() == (4, 0)
    assert bm.allocate("b", 9, list(range(9))).num_cached_tokens == 0
    bm.check_invariants()
