"""Preemption and swap: who is preempted, how (swap or recompute), and bringing
swapped sequences back (planner and applier).

Order. Victims are running sequences ranked below the grower: lowest priority
first, then latest arrival (vLLM's order). `VictimQueue` keeps them in that
order: a heap of (priority, -arrival, seq_id) with lazy deletion: pushing at
admission, swap-in or fork is O(log n); dropping a sequence (free, preemption)
only forgets its key, and dead entries are skipped when met and compacted away
when they outnumber live ones. Listing the next k candidates walks the heap:
O(k log k), never a scan.

Groups. Sequences that share blocks through Fork are preempted together: each
`SeqState.group` is the arrival of the group's first sequence, and the
manager's `groups` maps a group id to its members (kept only for groups of two
or more). With tenancy, a tenant only preempts its own sequences.

How. For each victim group the cost model (core/swap_planner.py) picks swap or
recompute. `plan` is pure (a refused call leaves the state byte for byte as it
was, which journal replay relies on); `apply` releases the victims' blocks:
swap copies them to the CPU pool (swap_out ops in the reply), recompute drops
the sequence (the frontend re-Allocates it; full hashed blocks stay cached).
`swap_in` brings a swapped group back when there is room above the admission
watermark; it never preempts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from typing import TYPE_CHECKING

from block_manager_svc.core.errors import FailedPrecondition, InvalidArgument, NotFound
from block_manager_svc.core.results import CacheOps, Preemption, SwapInResult
from block_manager_svc.core.sequence import check_seq_id
from block_manager_svc.core.swap_planner import MODES, PreemptionMode, SwapDecision, decide

if TYPE_CHECKING:
    from block_manager_svc.core.manager import BlockManager
    from block_manager_svc.core.sequence import SeqState

MAX_REQUEUED = 65_536  # recompute victims whose arrival is remembered for re-admission


class VictimQueue:
    """Running sequences in preemption order (lowest priority, latest arrival first)."""

    __slots__ = ("_heap", "_live", "_tick")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, str]] = []  # (priority, -arrival, token, seq_id)
        self._live: dict[str, int] = {}  # seq_id -> token of its live entry
        self._tick = 0

    def push(self, seq_id: str, priority: int, arrival: int) -> None:
        self._tick += 1
        self._live[seq_id] = self._tick
        heapq.heappush(self._heap, (priority, -arrival, self._tick, seq_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(heap)
            self._heap = heap

    def discard(self, seq_id: str) -> None:
        self._live.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def candidates(self, accept: Callable[[str], bool]) -> Generator[str]:
        """Live sequences in preemption order for which `accept` holds.

        Walks the heap as a tree (a side heap of frontier positions) instead
        of popping it, so planning never changes the heap, not even its
        layout: a rejected call leaves the state byte for byte as it was,
        which is what journal replay relies on. O(k log k) for k entries seen.
        The caller must exhaust or close the iterator before mutating."""
        heap, live = self._heap, self._live
        if not heap:
            return
        frontier: list[tuple[tuple[int, int, int, str], int]] = [(heap[0], 0)]
        n = len(heap)
        while frontier:
            entry, i = heapq.heappop(frontier)
            for c in (2 * i + 1, 2 * i + 2):
                if c < n:
                    heapq.heappush(frontier, (heap[c], c))
            if live.get(entry[3]) != entry[2]:
                continue  # dead: freed, preempted, or re-pushed since
            if accept(entry[3]):
                yield entry[3]


@dataclass(slots=True)
class Victim:
    """One fork group chosen to be preempted, and how."""

    members: list[str]
    decision: SwapDecision
    num_distinct_blocks: int  # distinct GPU blocks the group holds (what a swap moves)


@dataclass(slots=True)
class PreemptionPlan:
    """Victim groups, in order (nothing applied yet)."""

    victims: list[Victim]


class StepScope:
    """Which fork groups already grew earlier in this step (never preempted).

    Built only when a step first needs to preempt: O(step size) once."""

    __slots__ = ("seqs", "ids", "upto", "groups")

    def __init__(self, seqs: dict[str, SeqState], packed_ids: SequenceT[str]) -> None:
        self.seqs = seqs
        self.ids = packed_ids
        self.upto = 0
        self.groups: set[int] = set()

    def grown_groups(self, pos: int) -> set[int]:
        """Groups of the append items before position `pos`."""
        ids, seqs, groups = self.ids, self.seqs, self.groups
        while self.upto < pos:
            seq = seqs.get(ids[self.upto])
            if seq is not None:
                groups.add(seq.group)
            self.upto += 1
        return groups


# --- planning (pure) -------------------------------------------------------------------
def group_of(bm: BlockManager, seq: SeqState) -> list[str]:
    members = bm.groups.get(seq.group)
    return sorted(members) if members is not None else [seq.seq_id]


def price_group(
    bm: BlockManager, members: list[str], drop: dict[int, int], mode: str, cpu_free: int
) -> tuple[Victim, int]:
    """(the group as a victim, blocks its preemption frees), given the references
    already dropped by earlier victims in `drop` (updated in place)."""
    seqs, ref_counts = bm.seqs, bm.pool.ref_counts
    distinct: set[int] = set()
    freed = 0
    for m in members:
        for b in seqs[m].block_ids:
            d = drop.get(b, 0) + 1
            drop[b] = d
            if d == ref_counts[b]:
                freed += 1
            distinct.add(b)
    # Tokens the re-prefill cannot get from the prefix cache: everything but
    # the leading hashed blocks that other (non-victim) sequences keep referenced.
    bs, block_hash = bm.block_size, bm.pool.block_hash
    recompute = 0
    for m in members:
        seq = seqs[m]
        kept = 0
        for b in seq.block_ids[: seq.num_hashed_blocks]:
            if block_hash[b] is None or ref_counts[b] <= drop[b]:
                break
            kept += 1
        recompute += seq.num_tokens - kept * bs
    decision = decide(mode, bm.cost_model, len(distinct), recompute, cpu_free)
    return Victim(members, decision, len(distinct)), freed


def _cpu_free_for(bm: BlockManager, tenant: str) -> int:
    cpu_free = bm.cpu.num_free
    room = bm.ledger.cpu_room(tenant)
    return cpu_free if room is None else min(cpu_free, room)


def plan(
    bm: BlockManager, grower: SeqState, shortfall: int, grown_groups: set[int] | None
) -> PreemptionPlan | None:
    """Victims that free at least `shortfall` blocks, or None.

    Candidates rank below the grower (lower priority, or the same priority
    and a later arrival: vLLM's order), are not in its fork group and have
    not grown earlier in this step; each candidate's whole fork group goes.
    Pure: computes on the side, applies nothing."""
    key = (grower.priority, -grower.arrival)
    seqs = bm.seqs
    excluded = {grower.group}
    if grown_groups:
        excluded |= grown_groups
    victims: list[Victim] = []
    drop: dict[int, int] = {}
    gain = 0
    tenant = grower.tenant
    cpu_free = _cpu_free_for(bm, tenant)
    mode = bm.config.preemption_mode
    candidates = bm.victims.candidates(bm.ledger.victim_filter(seqs, tenant))
    try:
        for sid in candidates:
            seq = seqs[sid]
            if (seq.priority, -seq.arrival) >= key:
                break  # everyone after ranks above the grower
            if seq.group in excluded:
                continue
            excluded.add(seq.group)
            victim, freed = price_group(bm, group_of(bm, seq), drop, mode, cpu_free)
            if victim.decision.mode is PreemptionMode.SWAP:
                cpu_free -= victim.num_distinct_blocks
            victims.append(victim)
            gain += freed
            if gain >= shortfall:
                return PreemptionPlan(victims)
    finally:
        candidates.close()
    return None


# --- applying ------------------------------------------------------------------------------
def apply(bm: BlockManager, plan: PreemptionPlan, ops: CacheOps) -> list[Preemption]:
    out: list[Preemption] = []
    for v in plan.victims:
        bm.preemption_cost_s += v.decision.cost_s
        share = v.decision.cost_s / len(v.members)
        if v.decision.mode is PreemptionMode.SWAP:
            out.extend(_swap_out_group(bm, v.members, ops, share))
            bm.num_swapped_out_blocks += v.num_distinct_blocks
        else:
            out.extend(_drop_group(bm, v.members, share))
    return out


def _swap_out_group(bm: BlockManager, members: list[str], ops: CacheOps, share: float) -> list[Preemption]:
    """Copy the group's blocks to the CPU pool (one CPU block per distinct
    GPU block, shared as on the GPU) and release the GPU blocks.

    A released block is reusable in this same reply: workers run the
    reply's swap_out ops before its copies, swap-ins and forward pass."""
    cpu, pool = bm.cpu, bm.pool
    memo: dict[int, int] = {}
    out = []
    gpu_released = 0
    tenant = ""
    for m in members:
        seq = bm.seqs.pop(m)
        tenant = seq.tenant
        bm.victims.discard(m)
        cpu_ids = []
        for b in seq.block_ids:
            c = memo.get(b)
            if c is None:
                c = memo[b] = cpu.take_one()
                ops.swap_out.append((b, c))
            else:
                cpu.incref(c)
            cpu_ids.append(c)
        for b in reversed(seq.block_ids):
            gpu_released += pool.decref(b)
        out.append(Preemption(m, PreemptionMode.SWAP.value, seq.num_tokens, len(seq.block_ids), share))
        seq.block_ids = []
        seq.cpu_block_ids = cpu_ids
        bm.swapped[m] = seq
        bm.recently_preempted[m] = "swap"
    bm.num_preemptions_swap += len(members)
    bm.ledger.swapped_out(tenant, gpu_released, len(memo), len(members))
    return out


def _drop_group(bm: BlockManager, members: list[str], share: float) -> list[Preemption]:
    """Release the group's blocks and forget it; full hashed blocks stay in
    the prefix cache, so the frontend's re-prefill may hit them. The victims'
    arrivals are remembered so a re-Allocate under the same id keeps its place
    in the preemption order (vLLM keeps a request's arrival across preemption)."""
    out = []
    requeued = bm.requeued
    tenant = ""
    for m in members:
        seq = bm.seqs[m]
        tenant = seq.tenant
        bm.free(m)
        out.append(Preemption(m, PreemptionMode.RECOMPUTE.value, seq.num_tokens, len(seq.block_ids), share))
        bm.recently_preempted[m] = "recompute"
        if len(requeued) >= MAX_REQUEUED:
            del requeued[next(iter(requeued))]
        requeued[m] = seq.arrival
    bm.num_preemptions_recompute += len(members)
    bm.ledger.preempted(tenant, len(members))
    return out


# --- the public operations -------------------------------------------------------------------
def preempt(bm: BlockManager, seq_id: str, mode: str | None = None) -> tuple[list[Preemption], CacheOps]:
    """Preempt a running sequence and its fork group now, by the cost model
    (`mode` overrides the configured one; "off" means "auto" here)."""
    seq = bm.get_running(seq_id)
    mode = mode or bm.config.preemption_mode
    if mode == "off":
        mode = "auto"
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {MODES[:3]}, got {mode!r}")
    bm.recently_preempted.clear()
    victim, _ = price_group(bm, group_of(bm, seq), {}, mode, _cpu_free_for(bm, seq.tenant))
    ops = CacheOps()
    return apply(bm, PreemptionPlan([victim]), ops), ops


def swap_in(bm: BlockManager, seq_id: str) -> SwapInResult:
    """Bring a swapped sequence, with the rest of its swapped fork group,
    back to the GPU: new GPU blocks, swap_in ops cpu->gpu. Needs room above
    the admission watermark; never preempts and never evicts past it."""
    seq = bm.swapped.get(seq_id)
    if seq is None:
        check_seq_id(seq_id)
        if seq_id in bm.seqs:
            raise FailedPrecondition(
                f"sequence {seq_id!r} is not swapped out (it is running)", reason="SEQUENCE_NOT_SWAPPED_OUT"
            )
        raise NotFound(f"sequence {seq_id!r} does not exist")
    members = group_of(bm, seq)
    distinct: dict[int, None] = {}
    for m in members:
        for c in bm.swapped[m].cpu_block_ids or ():
            distinct[c] = None
    pool = bm.pool
    watermark = bm.config.watermark_blocks
    available = pool.num_available - watermark
    if len(distinct) > available:
        raise bm.exhausted(
            f"swapping in {seq_id!r}"
            + (f" and its fork group ({len(members)} sequences)" if len(members) > 1 else ""),
            len(distinct),
            max(available, 0),
            watermark,
        )
    bm.ledger.check_gpu(seq.tenant, len(distinct))
    ops = CacheOps()
    memo: dict[int, int] = {}
    for c in distinct:
        g = memo[c] = pool.take_one()
        ops.swap_in.append((c, g))
    first = set(memo.values())
    tables: dict[str, list[int]] = {}
    cpu = bm.cpu
    cpu_released = 0
    preempt_on = bm.preempt_on
    for m in members:
        s = bm.swapped.pop(m)
        blocks = []
        for c in s.cpu_block_ids or ():
            g = memo[c]
            if g in first:
                first.discard(g)  # take_one already counted this reference
            else:
                pool.incref(g)
            blocks.append(g)
            cpu_released += cpu.decref(c)
        s.block_ids = blocks
        s.cpu_block_ids = None
        bm.seqs[m] = s
        if preempt_on:
            bm.victims.push(m, s.priority, s.arrival)
        tables[m] = list(blocks)
    bm.num_swapped_in_blocks += len(distinct)
    bm.ledger.swapped_in(seq.tenant, len(distinct), cpu_released)
    return SwapInResult(seq_id=seq_id, block_ids=list(tables[seq_id]), ops=ops, tables=tables)
