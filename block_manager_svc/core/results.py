"""Values the core hands back: block ids, cache ops, stats.

Plain slotted dataclasses so that the servicer can translate them to protobuf
without touching core internals, and tests can compare them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.block_manager_svc.core.errors import ErrorCode


@dataclass(slots=True)
class CacheOps:
    """Work the data plane must do before the next forward pass.

    Each entry is a (src, dst) block pair. Workers run them in the order
    swap_out, copies, swap_in, so that a block swapped out can be reused as a
    copy or swap-in target within the same step.
    """

    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies or self.swap_out or self.swap_in)

    def extend(self, other: CacheOps) -> None:
        self.copies.extend(other.copies)
        self.swap_out.extend(other.swap_out)
        self.swap_in.extend(other.swap_in)


@dataclass(slots=True)
class Preemption:
    """A sequence preempted to make room, and how.

    mode "swap": its blocks were copied to the CPU pool (the swap_out ops are
    in the reply's ops); it stays known, swapped, until SwapIn or Free.
    mode "recompute": its blocks were released and the sequence removed; the
    frontend must re-Allocate it (prompt + generated tokens) to continue.
    `cost_s` is the cost model's estimate of the chosen mode.
    """

    seq_id: str
    mode: str
    num_tokens: int
    num_blocks: int
    cost_s: float


@dataclass(slots=True)
class SwapInResult:
    """A swapped sequence (and its swapped fork group) back on the GPU.

    `block_ids` is the requested sequence's new table; `tables` holds the new
    tables of every sequence brought back (the requested one included).
    """

    seq_id: str
    block_ids: list[int]
    ops: CacheOps
    tables: dict[str, list[int]] = field(default_factory=dict)
    # With several KV groups: every sequence brought back's tables of groups 1.. (window
    # groups' live tails), like `tables`.
    kv_tables: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass(slots=True)
class AllocateResult:
    block_ids: list[int]
    num_cached_tokens: int
    # With several KV groups: groups 1..'s tables (a window group's live tail). Empty with one.
    kv_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class AppendResult:
    """New blocks for one sequence.

    When `replaced_last_block` is set, new_block_ids[0] took the place of the
    table's former last block (copy-on-write; the copy is in ops.copies) and
    the rest were appended after it.
    """

    new_block_ids: list[int]
    ops: CacheOps
    replaced_last_block: bool = False
    # Sequences preempted to make room (their swap_out ops are in `ops`).
    preempted: list[Preemption] = field(default_factory=list)
    # With several KV groups, groups 1..'s share, like new_block_ids / replaced_last_block
    # (their copies are in ops.copies after group 0's). Empty with one group.
    kv_new_block_ids: list[list[int]] = field(default_factory=list)
    kv_replaced_last_block: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class BlockTable:
    block_ids: list[int]
    num_tokens: int
    # Swapped out: block_ids is empty and cpu_block_ids names its CPU blocks.
    swapped: bool = False
    cpu_block_ids: list[int] = field(default_factory=list)
    # With several KV groups: groups 1..'s tables (a window group's live tail: its first entry is
    # block index len(block_ids) - len(tail), or blocks_for_tokens(num_tokens) - len when swapped).
    kv_block_ids: list[list[int]] = field(default_factory=list)
    kv_cpu_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class ItemError:
    """One rejected item of a step; the item changed nothing."""

    index: int
    seq_id: str
    code: ErrorCode
    message: str


@dataclass(slots=True)
class GroupDeltas:
    """One KV group's (1..) share of a step, indexed like StepResult's group-0 fields.
    `copies[k]` is the copy-on-write of item `replaced_index[k]` in this group. With several
    groups, ops.copies holds group 0's copies (in replaced_index order, as with one group), then
    group 1's `copies`, then group 2's, and so on."""

    new_block_index: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    replaced_index: list[int] = field(default_factory=list)
    alloc_block_index: list[int] = field(default_factory=list)
    alloc_block_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """The deltas of one scheduler step (all items packed).

    `new_block_index[i]` is the index (into the step's append list) of the
    sequence that received `new_block_ids[i]`; `replaced_index` lists the items
    whose first new block replaced their last block (copy-on-write), in the
    order of their copies in `ops.copies`.
    `released[j]` is the number of blocks the j-th free released (0 on error).
    `alloc_num_cached_tokens[j]` is the j-th allocation's prefix hit (0 on
    error); `alloc_block_index`/`alloc_block_ids` its table, like appends.
    """

    new_block_index: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    replaced_index: list[int] = field(default_factory=list)
    ops: CacheOps = field(default_factory=CacheOps)
    released: list[int] = field(default_factory=list)
    append_errors: list[ItemError] = field(default_factory=list)
    free_errors: list[ItemError] = field(default_factory=list)
    commit_errors: list[ItemError] = field(default_factory=list)
    # Every preemption of the step; the swap_out ops are in `ops`.
    # preempted_by[i]: the append item whose growth caused preempted[i].
    preempted: list[Preemption] = field(default_factory=list)
    preempted_by: list[int] = field(default_factory=list)
    alloc_num_cached_tokens: list[int] = field(default_factory=list)
    alloc_block_index: list[int] = field(default_factory=list)
    alloc_block_ids: list[int] = field(default_factory=list)
    alloc_errors: list[ItemError] = field(default_factory=list)
    fork_errors: list[ItemError] = field(default_factory=list)
    # One result per requested swap-in (None on error), applied last.
    swap_in_results: list[SwapInResult | None] = field(default_factory=list)
    swap_in_errors: list[ItemError] = field(default_factory=list)
    # Grants, applied after the swap-ins: the block each granted item holds ahead, by item index.
    grant_index: list[int] = field(default_factory=list)
    grant_block_ids: list[int] = field(default_factory=list)
    grant_errors: list[ItemError] = field(default_factory=list)
    # With several KV groups: groups 1..'s deltas (the fields above are group 0's). Empty with one.
    kv_groups: list[GroupDeltas] = field(default_factory=list)
    # Rollbacks, applied first: blocks each one made unreferenced (0 on error), by item index.
    rollback_released: list[int] = field(default_factory=list)
    rollback_errors: list[ItemError] = field(default_factory=list)


@dataclass(slots=True)
class Stats:
    block_size: int
    num_gpu_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_sequences: int
    num_hashed_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evicted_blocks: int
    num_cow_copies: int
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    num_swapped_sequences: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    preemption_cost_s: float = 0.0
    num_prefix_cache_resets: int = 0
    # Blocks that entered the prefix cache by Commit (cumulative).
    num_committed_blocks: int = 0
