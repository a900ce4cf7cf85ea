"""The Step's values and their wire form: the engine's :class:`StepPlan` becomes the packed
StepRequest (:func:`step_request`), and the StepResponse a :class:`StepDelta` of changes to apply
(:func:`step_delta`: block-table growth, allocations, preemptions, per-item errors; the cache ops
stay the worker's wire message, forwarded to the workers as they are).

Pure translation, no calls: frontend/engine/bm_session.py sends what this builds, and the
scheduler's tests run it against the block manager's core in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pagedkv.v1 import block_manager_pb2 as pb

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@dataclass(slots=True)
class StepPlan:
    """What one Step asks, in the manager's apply order (sequence ids and token ids only)."""

    rollbacks: list[tuple[str, int]] = field(default_factory=list)  # (seq id, tokens kept)
    commits: list[tuple[str, int]] = field(default_factory=list)  # (seq id, computed tokens)
    frees: list[str] = field(default_factory=list)
    appends: list[tuple[str, int | None]] = field(default_factory=list)  # (seq id, token id or unknown)
    allocs: list[tuple[str, list[int], int]] = field(default_factory=list)  # (seq id, tokens, priority)
    alloc_salts: list[str] = field(default_factory=list)  # each alloc's cache salt (none given: "")
    # Per alloc: take no prefix-cache hit (its prompt logprobs need every position); none given: read.
    alloc_skip_prefix_hits: list[bool] = field(default_factory=list)
    forks: list[tuple[str, str]] = field(default_factory=list)  # (parent, child)
    swap_ins: list[str] = field(default_factory=list)
    grants: list[str] = field(default_factory=list)  # a block ahead of need, applied last
    # Forks applied before the appends (beam search: each child appends its own token in this
    # Step); on the wire after ``forks``, flagged fork_before_appends, their errors indexed after them.
    early_forks: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class ItemError:
    """One item of a Step the manager refused (nothing of it applied). ``code``: a grpc.StatusCode value."""

    kind: str  # "append", "free", "alloc", "fork", "swap_in", "commit", "grant", "rollback"
    index: int
    seq_id: str
    code: int
    message: str


@dataclass(slots=True, frozen=True)
class Preempted:
    seq_id: str
    swap: bool  # swapped out (else to be recomputed)
    cost_s: float


@dataclass(slots=True)
class StepDelta:
    """A Step reply as changes to apply. Block growth: (append index, block, replaces the table's
    last block (copy-on-write)); allocation tables and prefix hits per alloc index; swap-ins per
    swap-in index, each the (seq id, new table) of every member of its fork group."""

    available_blocks: int
    prefix_cache_drops: int
    grown: list[tuple[int, int, bool]]
    ops: pb.CacheOps
    preempted: list[Preempted]
    errors: list[ItemError]
    alloc_tables: list[list[int]]
    alloc_cached: list[int]
    swap_ins: list[list[tuple[str, list[int]]]]
    granted: list[tuple[int, int]] = field(default_factory=list)  # (grant index, block ahead)
    # KV-cache groups 1.. (empty with one group), per group: its growth like ``grown``, and per
    # alloc index its table (a window group's live tail); per swap-in, each member's tails.
    group_grown: list[list[tuple[int, int, bool]]] = field(default_factory=list)
    alloc_group_tables: list[list[list[int]]] = field(default_factory=list)
    swap_in_groups: list[dict[str, list[list[int]]]] = field(default_factory=list)


_KINDS = {
    pb.StepItemError.APPEND: "append",
    pb.StepItemError.PACKED_APPEND: "append",
    pb.StepItemError.FREE: "free",
    pb.StepItemError.PACKED_FREE: "free",
    pb.StepItemError.ALLOCATE: "alloc",
    pb.StepItemError.FORK: "fork",
    pb.StepItemError.SWAP_IN: "swap_in",
    pb.StepItemError.COMMIT: "commit",
    pb.StepItemError.GRANT: "grant",
    pb.StepItemError.ROLLBACK: "rollback",
}


def step_request(plan: StepPlan, lease_id: str) -> pb.StepRequest:
    tokens = [t for _, t in plan.appends]
    known = [t for t in tokens if t is not None]  # sent only when every append has its id
    return pb.StepRequest(
        rollback_seq_ids=[s for s, _ in plan.rollbacks],
        rollback_num_tokens=[n for _, n in plan.rollbacks],
        commit_seq_ids=[s for s, _ in plan.commits],
        commit_num_computed_tokens=[n for _, n in plan.commits],
        free_seq_ids=plan.frees,
        append_seq_ids=[s for s, _ in plan.appends],
        append_token_ids=known if tokens and len(known) == len(tokens) else [],
        alloc_seq_ids=[s for s, _, _ in plan.allocs],
        alloc_num_tokens=[len(t) for _, t, _ in plan.allocs],
        alloc_token_ids=[t for _, toks, _ in plan.allocs for t in toks],
        alloc_priorities=[p for _, _, p in plan.allocs] if any(p for _, _, p in plan.allocs) else [],
        alloc_lease_ids=[lease_id] * len(plan.allocs),
        alloc_cache_salts=plan.alloc_salts if any(plan.alloc_salts) else [],
        alloc_skip_prefix_hits=plan.alloc_skip_prefix_hits if any(plan.alloc_skip_prefix_hits) else [],
        fork_parent_seq_ids=[p for p, _ in plan.forks + plan.early_forks],
        fork_child_seq_ids=[c for _, c in plan.forks + plan.early_forks],
        fork_before_appends=[False] * len(plan.forks) + [True] * len(plan.early_forks)
        if plan.early_forks
        else [],
        swap_in_seq_ids=plan.swap_ins,
        grant_seq_ids=plan.grants,
    )


def _grown(
    index: Sequence[int], ids: Sequence[int], replaced_index: Sequence[int]
) -> list[tuple[int, int, bool]]:
    replaced = set(replaced_index)
    seen: set[int] = set()
    grown = []
    for i, block in zip(index, ids, strict=False):
        first = i in replaced and i not in seen
        seen.add(i)
        grown.append((int(i), int(block), first))
    return grown


def _tables(num_allocs: int, index: Sequence[int], ids: Sequence[int]) -> list[list[int]]:
    tables: list[list[int]] = [[] for _ in range(num_allocs)]
    for i, block in zip(index, ids, strict=False):
        tables[i].append(int(block))
    return tables


def step_delta(resp: pb.StepResponse, num_allocs: int) -> StepDelta:
    grown = _grown(resp.packed_new_block_index, resp.packed_new_block_ids, resp.packed_replaced_index)
    tables = _tables(num_allocs, resp.packed_alloc_block_index, resp.packed_alloc_block_ids)
    groups = resp.group_deltas
    return StepDelta(
        available_blocks=resp.num_available_blocks,
        prefix_cache_drops=resp.prefix_cache_drops,
        grown=grown,
        ops=resp.ops,
        preempted=[Preempted(p.seq_id, p.mode == pb.Preemption.SWAP, p.cost_s) for p in resp.preempted],
        errors=[
            ItemError(_KINDS.get(e.kind, "unknown"), e.index, e.seq_id, e.code, e.message)
            for e in resp.errors
        ],
        alloc_tables=tables,
        alloc_cached=list(resp.alloc_num_cached_tokens) or [0] * num_allocs,
        swap_ins=[[(m.seq_id, list(m.block_ids)) for m in r.sequences] for r in resp.swap_ins],
        granted=[
            (int(i), int(b))
            for i, b in zip(resp.packed_grant_index, resp.packed_grant_block_ids, strict=False)
        ],
        group_grown=[
            _grown(d.packed_new_block_index, d.packed_new_block_ids, d.packed_replaced_index) for d in groups
        ],
        alloc_group_tables=[
            list(t)
            for t in zip(
                *(_tables(num_allocs, d.packed_alloc_block_index, d.packed_alloc_block_ids) for d in groups),
                strict=True,
            )
        ]
        if groups
        else [],
        swap_in_groups=[
            {m.seq_id: [list(t.block_ids) for t in m.group_tables] for m in r.sequences if m.group_tables}
            for r in resp.swap_ins
        ],
    )


def unknown_sequences(delta: StepDelta, plan: StepPlan | None = None) -> list[str]:
    """Sequences the engine holds that the manager answered NOT_FOUND for (commits, appends,
    swap-ins, grants; not a victim preempted in this very Step, nor a beam this Step forks ahead
    of its appends, whose appends fail with a refused fork): it no longer has the engine's state."""
    skip = {p.seq_id for p in delta.preempted}
    if plan is not None:
        skip.update(c for _, c in plan.early_forks)
    return [
        e.seq_id
        for e in delta.errors
        if e.kind in ("commit", "append", "swap_in", "grant") and e.code == NOT_FOUND and e.seq_id not in skip
    ]
