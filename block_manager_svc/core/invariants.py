"""The block manager's bookkeeping invariants, checked from scratch (O(pool)).

For tests, recovery (after a journal replay) and debug tooling; never on the
request path. `check_invariants(bm)` raises AssertionError naming the first
inconsistency:

* every block is exactly one of free, cached (evictable) or referenced, and the
  reference counts equal the block tables and the blocks granted ahead (each
  private to a running sequence, outside its table, unhashed);
* the prefix index, the blocks' hashes, the parent/child counts and the leaf
  flags the eviction policy keeps agree; every hashed block is committed KV;
* the hashes a sequence kept from Allocate are its pending blocks' chain;
* the CPU pool's counts equal the swapped tables; fork groups are whole (all
  running or all swapped); the victim queue holds exactly the running sequences;
* with tenancy, each tenant's usage equals what the tables say;
* with several KV groups, every group's table counts: each full group's
  table is as long as group 0's, each window group's is exactly the blocks
  from the window of the committed count on (core/kv_groups.py), on the GPU
  and in the CPU pool alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.block_manager_svc.core.prefix_cache import chain_hashes
from pagedkv.kv_capacity import blocks_for_tokens

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.core.manager import BlockManager
    from pagedkv.block_manager_svc.core.sequence import SeqState


def check_invariants(bm: BlockManager) -> None:
    """Raise AssertionError if the bookkeeping is inconsistent."""
    _check_tenants(bm)
    _check_gpu_pool(bm)
    _check_sequences(bm)
    _check_swap_and_groups(bm)
    _check_prefix_tree(bm)


def _check_tenants(bm: BlockManager) -> None:
    ledger = bm.ledger
    if not ledger.enabled:
        return
    have = ledger.usage  # type: ignore[union-attr]
    want = ledger.recount(bm.seqs, bm.swapped)  # type: ignore[union-attr]
    for t in set(want) | set(have):
        a, b = want.get(t), have.get(t)
        got = (b.gpu_blocks, b.cpu_blocks, b.sequences) if b else (0, 0, 0)
        exp = (a.gpu_blocks, a.cpu_blocks, a.sequences) if a else (0, 0, 0)
        assert got == exp, f"tenant {t!r} usage {got} differs from the tables {exp}"


def _check_gpu_pool(bm: BlockManager) -> None:
    pool = bm.pool
    counts = [0] * pool.num_blocks
    for seq in bm.seqs.values():
        assert len(seq.block_ids) == blocks_for_tokens(seq.num_tokens, bm.block_size), seq.seq_id
        assert seq.cpu_block_ids is None, f"running {seq.seq_id} has CPU blocks"
        assert seq.cpu_kv_tables is None, f"running {seq.seq_id} has CPU blocks in its KV groups"
        _check_group_tables(bm, seq, seq.kv_tables)
        for table in (seq.block_ids, *seq.kv_tables):
            for b in table:
                counts[b] += 1
        if seq.ahead_block >= 0:
            assert seq.ahead_block not in seq.block_ids, f"{seq.seq_id}'s block ahead is in its table"
            assert pool.block_hash[seq.ahead_block] is None, f"{seq.seq_id}'s block ahead is hashed"
            counts[seq.ahead_block] += 1
    for seq in bm.swapped.values():
        assert seq.ahead_block < 0, f"swapped {seq.seq_id} holds a block ahead"
    assert counts == pool.ref_counts, "ref counts differ from the tables"
    free = set(pool.free_list)
    assert len(free) == len(pool.free_list), "a block is on the free list twice"
    policy = pool.eviction_policy
    for b in range(pool.num_blocks):
        in_free = b in free
        in_cache = b in policy
        referenced = counts[b] > 0
        assert in_free + in_cache + referenced == 1, f"block {b} is in {in_free, in_cache, referenced}"
        if in_free:
            assert pool.block_hash[b] is None, f"free block {b} still has a hash"
        if in_cache:
            assert pool.block_hash[b] is not None, f"cached block {b} has no hash"
    for h, b in pool.index.items():
        assert pool.block_hash[b] == h, f"index entry for block {b} disagrees"
    assert pool.num_free + pool.num_cached + sum(1 for c in counts if c) == pool.num_blocks


def _check_group_tables(bm: BlockManager, seq: SeqState, tables: list[list[int]] | None) -> None:
    """Groups 1..'s tables of `seq` (running or swapped) have the lengths its tokens and its
    committed count give."""
    groups = bm.kv_groups
    bs = bm.block_size
    tables = tables or []
    assert len(tables) == len(groups) - 1, f"{seq.seq_id} has {len(tables)} tables for groups 1.."
    n = blocks_for_tokens(seq.num_tokens, bs)
    for g, table in enumerate(tables, 1):
        want = n - groups[g].first_live(seq.num_committed, bs)
        assert len(table) == want, f"{seq.seq_id}'s KV group {g} holds {len(table)} blocks, not {want}"


def _check_sequences(bm: BlockManager) -> None:
    bs = bm.block_size
    for seq in list(bm.seqs.values()) + list(bm.swapped.values()):
        # A sequence hashes (registers) only blocks inside its committed range,
        # so every index entry, and so every hit, names committed KV.
        assert seq.num_hashed_blocks * bs <= seq.num_committed <= seq.num_tokens, seq.seq_id
        pending = seq.pending_tokens
        if pending is None:
            continue
        assert len(pending) == seq.num_tokens - seq.num_hashed_blocks * bs, seq.seq_id
        kept = seq.pending_hashes
        assert len(kept) <= len(pending) // bs, f"{seq.seq_id} keeps more hashes than full pending blocks"
        if kept:
            assert kept == chain_hashes(seq.last_hash, pending, bs, len(kept)), (
                f"{seq.seq_id} kept stale hashes"
            )


def _check_swap_and_groups(bm: BlockManager) -> None:
    """The CPU pool, swapped sequences, fork groups and the preemption queue."""
    cpu = bm.cpu
    assert not (bm.seqs.keys() & bm.swapped.keys()), "a sequence is both running and swapped"
    cpu_counts = [0] * cpu.num_blocks
    for seq in bm.swapped.values():
        assert seq.block_ids == [], f"swapped {seq.seq_id} still holds GPU blocks"
        assert seq.kv_tables == [], f"swapped {seq.seq_id} still holds GPU blocks in its KV groups"
        assert seq.cpu_block_ids is not None
        assert len(seq.cpu_block_ids) == blocks_for_tokens(seq.num_tokens, bm.block_size), seq.seq_id
        if bm.multi:
            _check_group_tables(bm, seq, seq.cpu_kv_tables)
        else:
            assert seq.cpu_kv_tables is None, seq.seq_id
        for table in (seq.cpu_block_ids, *(seq.cpu_kv_tables or ())):
            for c in table:
                cpu_counts[c] += 1
    assert cpu_counts == cpu.ref_counts, "CPU ref counts differ from the swapped tables"
    cpu_free = set(cpu.free_list)
    assert len(cpu_free) == len(cpu.free_list), "a CPU block is on the free list twice"
    for c in range(cpu.num_blocks):
        assert (c in cpu_free) != (cpu_counts[c] > 0), f"CPU block {c} is both or neither free and used"
    for g, members in bm.groups.items():
        assert len(members) >= 2, f"group {g} has {len(members)} members"
        states = set()
        for m in members:
            member = bm.seqs.get(m) or bm.swapped.get(m)
            assert member is not None and member.group == g, f"group {g} lists {m}"
            states.add(m in bm.swapped)
        assert len(states) == 1, f"group {g} is partly swapped"
    if bm.preempt_on:
        victims = bm.preemption.victims
        assert len(victims) == len(bm.seqs) and all(s in victims for s in bm.seqs)


def _check_prefix_tree(bm: BlockManager) -> None:
    """Parent/child counts and the leaf flags the eviction policy keeps."""
    pool = bm.pool
    children: dict[bytes, int] = {}
    for b in pool.index.values():
        parent = pool.parent_hash[b]
        if parent is not None:
            children[parent] = children.get(parent, 0) + 1
    assert children == pool.child_count, "child counts differ from the index"
    policy = pool.eviction_policy
    exact = getattr(policy, "exact_leaves", True)
    for b in range(pool.num_blocks):
        if b in policy:
            leaf = pool.block_hash[b] not in children
            flag = policy.is_leaf(b)
            # Exact policies track leaves eagerly; lazy ones (lru) only set
            # aside blocks found to have children when popped.
            assert flag == leaf if exact else (flag or not leaf), f"cached block {b} leaf flag"
