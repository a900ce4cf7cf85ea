"""Rollback on the pure core: a sequence shortened to a given length (speculative decoding
takes back the KV slots of the proposed tokens verification rejected).

B = 4 tokens per block. Every test asserts real tables, reference counts and the prefix
index, and runs the invariant checker."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.core import (
    BlockManager,
    CoreConfig,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    StepBatch,
)
from pagedkv.block_manager_svc.core.kv_groups import KVGroup
from pagedkv.block_manager_svc.core.tenants import Quota, TenantLedger

BS = 4


def make(num_blocks: int = 16, **kw: object) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=num_blocks,
            block_size=BS,
            **{"preemption_mode": "off", "eviction_policy": "lru", **kw},
        )  # type: ignore[arg-type]
    )


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_rollback_across_a_block_boundary_returns_the_emptied_blocks() -> None:
    bm = make()
    table = bm.allocate("a", 6, toks(6)).block_ids
    bm.commit("a", 6)
    new = bm.append("a", 7, toks(7, 6)).new_block_ids  # 13 tokens: blocks 2 and 3 are new
    assert len(new) == 2
    free_before = bm.stats().num_free_blocks
    assert bm.rollback("a", 7) == 2  # 7 tokens fit in 2 blocks: both new ones go back
    t = bm.block_table("a")
    assert t.block_ids == table and t.num_tokens == 7
    assert bm.stats().num_free_blocks == free_before + 2
    assert all(bm.pool.ref_counts[b] == 0 for b in new)
    bm.check_invariants()
    # The next append writes into the kept partial block, then takes a new one.
    r = bm.append("a", 2, [50, 51])
    assert len(r.new_block_ids) == 1 and not r.replaced_last_block
    bm.check_invariants()


def test_rollback_is_idempotent_and_never_grows() -> None:
    bm = make()
    bm.allocate("a", 5, toks(5))
    bm.append("a", 3, toks(3, 5))
    assert bm.rollback("a", 6) == 0  # same block count: nothing released
    assert bm.block_table("a").num_tokens == 6
    assert bm.rollback("a", 6) == 0
    assert bm.block_table("a").num_tokens == 6
    with pytest.raises(InvalidArgument):
        bm.rollback("a", 7)
    with pytest.raises(InvalidArgument):
        bm.rollback("a", 0)
    bm.check_invariants()


def test_rollback_below_the_committed_length_is_refused() -> None:
    bm = make()
    bm.allocate("a", 6, toks(6))
    bm.append("a", 4, toks(4, 6))
    bm.commit("a", 8)  # blocks 0 and 1 are committed and in the prefix cache
    with pytest.raises(FailedPrecondition) as e:
        bm.rollback("a", 7)
    assert e.value.reason == "ROLLBACK_BELOW_COMMITTED"
    assert bm.block_table("a").num_tokens == 10
    assert bm.rollback("a", 8) == 1  # down to the committed length is fine
    bm.check_invariants()


def test_rejected_tokens_are_never_committed_and_never_hit() -> None:
    """Tokens rolled back are cut from what the sequence hashes: the block that fills with the
    accepted tokens is cached under their hash, and a prompt with the rejected ones misses."""
    bm = make()
    bm.allocate("a", 4, toks(4))
    bm.append("a", 4, [9, 9, 9, 9])  # proposed tokens
    bm.rollback("a", 5)  # one accepted
    with pytest.raises(InvalidArgument):
        bm.commit("a", 8)  # the rejected slots do not exist any more
    bm.append("a", 3, [7, 7, 7])
    bm.commit("a", 8)
    rejected = toks(4) + [9, 9, 9, 9, 1]
    accepted = toks(4) + [9, 7, 7, 7, 1]
    assert bm.allocate("x", 9, rejected).num_cached_tokens == 4
    assert bm.allocate("y", 9, accepted).num_cached_tokens == 8
    bm.check_invariants()


def test_rollback_of_a_forked_sequences_shared_tail() -> None:
    """A fork shares the parent's blocks; rolling the child back into the shared tail keeps the
    parent's KV: the child's next write copies the block first, and blocks past the child's new
    length stay the parent's."""
    bm = make()
    parent = bm.allocate("p", 10, toks(10)).block_ids  # blocks 0, 1 full; block 2 holds 2
    bm.fork("p", "c")
    assert bm.rollback("c", 6) == 0  # block 2 is still the parent's: nothing freed
    assert bm.block_table("c").block_ids == parent[:2]
    assert bm.pool.ref_counts[parent[2]] == 1 and bm.pool.ref_counts[parent[1]] == 2
    bm.check_invariants()
    r = bm.append("c", 1, [42])
    assert r.replaced_last_block and r.ops.copies == [(parent[1], r.new_block_ids[0])]
    assert bm.block_table("p").block_ids == parent  # untouched
    assert bm.pool.ref_counts[parent[1]] == 1
    bm.check_invariants()


def test_rollback_into_a_block_a_fork_sibling_committed_copies_it_before_writing() -> None:
    """The sibling committed (so cached) a block past the rolled-back sequence's own committed
    length, then left: the block is the sequence's alone but its content is what the cache names,
    so the next write goes to a copy and the cached block stays a correct hit."""
    bm = make()
    bm.allocate("p", 8, toks(8))
    bm.fork("p", "c")
    bm.commit("c", 8)  # blocks 0 and 1 cached under the shared tokens
    bm.free("c")
    cached = bm.block_table("p").block_ids[1]
    bm.rollback("p", 6)  # p's committed length is 0
    r = bm.step(StepBatch(append_seq_ids=["p"], append_token_ids=None))  # the decode fast path
    assert r.replaced_index == [0] and r.ops.copies == [(cached, r.new_block_ids[0])]
    assert bm.pool.block_hash[cached] is not None
    bm.free("p")
    assert bm.allocate("q", 9, toks(8) + [0]).num_cached_tokens == 8
    bm.check_invariants()


def test_step_applies_rollbacks_first_and_reports_each_item() -> None:
    bm = make()
    bm.allocate("a", 4, toks(4))
    bm.append("a", 5, toks(5, 4))  # 9 tokens, 3 blocks
    r = bm.step(
        StepBatch(
            rollback_seq_ids=["a", "nope", "a"],
            rollback_num_tokens=[5, 3, 9],
            commit_seq_ids=["a", "a"],
            commit_num_computed_tokens=[5, 9],  # the second names rolled-back KV: refused
            append_seq_ids=["a"],
            append_num_tokens=[2],
        )
    )
    assert r.rollback_released == [1, 0, 0]
    assert [(e.index, e.code) for e in r.rollback_errors] == [
        (1, ErrorCode.NOT_FOUND),
        (2, ErrorCode.INVALID_ARGUMENT),
    ]
    assert [e.index for e in r.commit_errors] == [1]
    t = bm.block_table("a")
    assert t.num_tokens == 7 and len(t.block_ids) == 2 and bm.seqs["a"].num_committed == 5
    bm.check_invariants()


def test_rollback_returns_every_kv_groups_blocks() -> None:
    """A full group and a window group (8 tokens): both tables are cut at the new length, the
    window table keeps its live tail, and every released block is counted once."""
    groups = (KVGroup.full(), KVGroup.window(8))
    bm = make(32, kv_groups=groups)
    bm.allocate("a", 12, toks(12))
    bm.commit("a", 12)  # window first live block: (12 - 7) // 4 = 1
    assert len(bm.seqs["a"].kv_tables[0]) == 2
    bm.append("a", 9, toks(9, 12))  # 21 tokens: 6 blocks in group 0, 5 in the window
    used = bm.stats().num_used_blocks
    assert bm.rollback("a", 13) == 4  # blocks 4 and 5 of both groups
    seq = bm.seqs["a"]
    assert len(seq.block_ids) == 4 and len(seq.kv_tables[0]) == 3
    assert bm.stats().num_used_blocks == used - 4
    bm.check_invariants()
    bm.append("a", 3, toks(3, 13))
    bm.commit("a", 16)
    bm.check_invariants()
    assert bm.free("a") > 0
    assert bm.stats().num_used_blocks == 0


def test_rollback_uncharges_the_tenant() -> None:
    bm = make()
    bm.enable_tenancy(TenantLedger(quotas={"t": Quota(max_gpu_blocks=4)}))
    bm.allocate("a", 4, toks(4), tenant="t")
    bm.append("a", 8, toks(8, 4))
    assert bm.ledger.usage["t"].gpu_blocks == 3  # type: ignore[attr-defined]
    bm.rollback("a", 5)
    assert bm.ledger.usage["t"].gpu_blocks == 2  # type: ignore[attr-defined]
    bm.check_invariants()
