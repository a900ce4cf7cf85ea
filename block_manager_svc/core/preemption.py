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

from pagedkv.block_manager_svc.core.block_pool import BlockPool
from pagedkv.block_manager_svc.core.cpu_pool import CpuPool
from pagedkv.block_manager_svc.core.errors import InvalidArgument, ResourceExhausted
from pagedkv.block_manager_svc.core.results import CacheOps, Preemption, SwapInResult
from pagedkv.block_manager_svc.core.sequence import SeqState
from pagedkv.block_manager_svc.core.swap_planner import MODES, CostModel, PreemptionMode, SwapDecision, decide
from pagedkv.block_manager_svc.core.tenants import NULL_LEDGER, Ledger
from pagedkv.watermark import admission_room

MAX_REQUEUED = 65_536  # recompute victims whose arrival is remembered for re-admission


def rank(priority: int, arrival: int) -> tuple[int, int]:
    """Who yields: the sequence with the smaller rank is preempted first (lowest priority, then
    latest arrival: vLLM's order). The only definition of the order; the victim queue keeps its
    entries by it and a plan takes only victims ranked below the grower."""
    return priority, -arrival


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
        heapq.heappush(self._heap, (*rank(priority, arrival), self._tick, seq_id))
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


class Preempter:
    """Preemption and swap-in for one manager, behind a narrow interface.

    What it owns (its own state, persisted by block_manager_svc/records.py): the victim queue,
    the arrivals of recompute victims (`requeued`), the sequences preempted by the current call
    (`recently_preempted`, for error messages) and the preemption counters.

    What it reads: the running and swapped tables and the fork groups (the manager's dicts,
    shared, never replaced), the GPU pool's ref counts and hashes, the CPU pool's free count, the
    ledger's room and victim filter, and the cost model.

    What it may change, and nothing else: it moves victims from the running table to the
    swapped one (swap) and back (swap-in), with their GPU and CPU block references and the
    ledger's charges for them, and releases recompute victims through `release` (the manager's
    Free, so a dropped sequence is released exactly as a freed one).

    Who yields is decided in one place: `rank` orders the victim queue and `plan` takes, in that
    order, only sequences ranked below the grower; `preempt` (the frontend's own decision) names
    its victim and only prices it.
    """

    __slots__ = (
        "enabled",
        "mode",
        "block_size",
        "watermark_blocks",
        "cost_model",
        "pool",
        "cpu",
        "seqs",
        "swapped",
        "groups",
        "release",
        "exhausted",
        "ledger",
        "victims",
        "requeued",
        "recently_preempted",
        "num_preemptions_swap",
        "num_preemptions_recompute",
        "num_swapped_out_blocks",
        "num_swapped_in_blocks",
        "preemption_cost_s",
    )

    def __init__(
        self,
        *,
        mode: str,
        block_size: int,
        watermark_blocks: int,
        cost_model: CostModel,
        pool: BlockPool,
        cpu: CpuPool,
        seqs: dict[str, SeqState],
        swapped: dict[str, SeqState],
        groups: dict[int, set[str]],
        release: Callable[[str], int],
        exhausted: Callable[[str, int, int, int], ResourceExhausted],
    ) -> None:
        self.enabled = mode != "off"  # "off": growing never preempts (an explicit Preempt still does)
        self.mode = mode
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.cost_model = cost_model
        self.pool = pool
        self.cpu = cpu
        self.seqs = seqs
        self.swapped = swapped
        self.groups = groups
        self.release = release
        self.exhausted = exhausted
        self.ledger: Ledger = NULL_LEDGER  # the manager sets its own (enable_tenancy)
        self.victims = VictimQueue()  # running sequences in preemption order (when enabled)
        # Recompute victims' arrivals, restored when the frontend re-Allocates them under the
        # same id (see `_drop_group`). Bounded by MAX_REQUEUED.
        self.requeued: dict[str, int] = {}
        self.recently_preempted: dict[str, str] = {}  # by the current call: seq_id -> "swap"/"recompute"
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.preemption_cost_s = 0.0

    # --- what the manager tells it ------------------------------------------------------
    def new_call(self) -> None:
        """A new mutating call starts: forget who the previous one preempted."""
        if self.recently_preempted:
            self.recently_preempted.clear()

    def arrival_for(self, seq_id: str, arrival: int) -> int:
        """The arrival a newly admitted `seq_id` ranks with: its own from before, if it is a
        recompute victim coming back, else `arrival`."""
        if self.requeued:
            return self.requeued.pop(seq_id, arrival)
        return arrival

    def running(self, seq_id: str, priority: int, arrival: int) -> None:
        """`seq_id` runs on the GPU now (admitted, forked or swapped in): it can be a victim."""
        if self.enabled:
            self.victims.push(seq_id, priority, arrival)

    def gone(self, seq_id: str) -> None:
        """`seq_id` no longer runs (freed): it cannot be a victim."""
        if self.enabled:
            self.victims.discard(seq_id)

    # --- planning (pure) -------------------------------------------------------------------
    def group_of(self, seq: SeqState) -> list[str]:
        members = self.groups.get(seq.group)
        return sorted(members) if members is not None else [seq.seq_id]

    def price_group(
        self, members: list[str], drop: dict[int, int], mode: str, cpu_free: int
    ) -> tuple[Victim, int]:
        """(the group as a victim, blocks its preemption frees), given the references
        already dropped by earlier victims in `drop` (updated in place)."""
        seqs, ref_counts = self.seqs, self.pool.ref_counts
        distinct: set[int] = set()
        freed = 0
        for m in members:
            for table in (seqs[m].block_ids, *seqs[m].kv_tables):
                for b in table:
                    d = drop.get(b, 0) + 1
                    drop[b] = d
                    if d == ref_counts[b]:
                        freed += 1
                    distinct.add(b)
            freed += seqs[m].ahead_block >= 0  # private; released, never swapped
        # Tokens the re-prefill cannot get from the prefix cache: everything but
        # the leading hashed blocks that other (non-victim) sequences keep referenced.
        bs, block_hash = self.block_size, self.pool.block_hash
        recompute = 0
        for m in members:
            seq = seqs[m]
            kept = 0
            for b in seq.block_ids[: seq.num_hashed_blocks]:
                if block_hash[b] is None or ref_counts[b] <= drop[b]:
                    break
                kept += 1
            recompute += seq.num_tokens - kept * bs
        decision = decide(mode, self.cost_model, len(distinct), recompute, cpu_free)
        return Victim(members, decision, len(distinct)), freed

    def _cpu_free_for(self, tenant: str) -> int:
        cpu_free = self.cpu.num_free
        room = self.ledger.cpu_room(tenant)
        return cpu_free if room is None else min(cpu_free, room)

    def plan(self, grower: SeqState, shortfall: int, grown_groups: set[int] | None) -> PreemptionPlan | None:
        """Victims that free at least `shortfall` blocks, or None.

        Candidates rank below the grower (`rank`), are not in its fork group and have not grown
        earlier in this step; each candidate's whole fork group goes. With tenancy, only the
        grower's tenant's sequences. Pure: computes on the side, applies nothing."""
        key = rank(grower.priority, grower.arrival)
        seqs = self.seqs
        excluded = {grower.group}
        if grown_groups:
            excluded |= grown_groups
        victims: list[Victim] = []
        drop: dict[int, int] = {}
        gain = 0
        tenant = grower.tenant
        cpu_free = self._cpu_free_for(tenant)
        candidates = self.victims.candidates(self.ledger.victim_filter(seqs, tenant))
        try:
            for sid in candidates:
                seq = seqs[sid]
                if rank(seq.priority, seq.arrival) >= key:
                    break  # everyone after ranks above the grower
                if seq.group in excluded:
                    continue
                excluded.add(seq.group)
                victim, freed = self.price_group(self.group_of(seq), drop, self.mode, cpu_free)
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
    def apply(self, plan: PreemptionPlan, ops: CacheOps) -> list[Preemption]:
        out: list[Preemption] = []
        for v in plan.victims:
            self.preemption_cost_s += v.decision.cost_s
            share = v.decision.cost_s / len(v.members)
            if v.decision.mode is PreemptionMode.SWAP:
                out.extend(self._swap_out_group(v.members, ops, share))
                self.num_swapped_out_blocks += v.num_distinct_blocks
            else:
                out.extend(self._drop_group(v.members, share))
        return out

    def _swap_out_group(self, members: list[str], ops: CacheOps, share: float) -> list[Preemption]:
        """Copy the group's blocks to the CPU pool (one CPU block per distinct
        GPU block, shared as on the GPU) and release the GPU blocks.

        A released block is reusable in this same reply: workers run the
        reply's swap_out ops before its copies, swap-ins and forward pass."""
        cpu, pool = self.cpu, self.pool
        memo: dict[int, int] = {}
        out = []
        gpu_released = 0
        tenant = ""
        for m in members:
            seq = self.seqs.pop(m)
            tenant = seq.tenant
            self.victims.discard(m)
            cpu_tables: list[list[int]] = []
            for table in (seq.block_ids, *seq.kv_tables):  # every KV group's live blocks
                cpu_ids = []
                for b in table:
                    c = memo.get(b)
                    if c is None:
                        c = memo[b] = cpu.take_one()
                        ops.swap_out.append((b, c))
                    else:
                        cpu.incref(c)
                    cpu_ids.append(c)
                cpu_tables.append(cpu_ids)
            if seq.ahead_block >= 0:  # a block granted ahead holds no KV worth keeping
                gpu_released += pool.decref(seq.ahead_block)
                seq.ahead_block = -1
            num_blocks = 0
            for table in (seq.block_ids, *seq.kv_tables):
                num_blocks += len(table)
                for b in reversed(table):
                    gpu_released += pool.decref(b)
            out.append(Preemption(m, PreemptionMode.SWAP.value, seq.num_tokens, num_blocks, share))
            seq.block_ids = []
            seq.cpu_block_ids = cpu_tables[0]
            if seq.kv_tables:
                seq.kv_tables = []
                seq.cpu_kv_tables = cpu_tables[1:]
            self.swapped[m] = seq
            self.recently_preempted[m] = "swap"
        self.num_preemptions_swap += len(members)
        self.ledger.swapped_out(tenant, gpu_released, len(memo), len(members))
        return out

    def _drop_group(self, members: list[str], share: float) -> list[Preemption]:
        """Release the group's blocks and forget it; full hashed blocks stay in
        the prefix cache, so the frontend's re-prefill may hit them. The victims'
        arrivals are remembered so a re-Allocate under the same id keeps its place
        in the preemption order (vLLM keeps a request's arrival across preemption)."""
        out = []
        requeued = self.requeued
        tenant = ""
        for m in members:
            seq = self.seqs[m]
            tenant = seq.tenant
            self.release(m)
            num_blocks = len(seq.block_ids) + sum(len(t) for t in seq.kv_tables)
            out.append(Preemption(m, PreemptionMode.RECOMPUTE.value, seq.num_tokens, num_blocks, share))
            self.recently_preempted[m] = "recompute"
            if len(requeued) >= MAX_REQUEUED:
                del requeued[next(iter(requeued))]
            requeued[m] = seq.arrival
        self.num_preemptions_recompute += len(members)
        self.ledger.preempted(tenant, len(members))
        return out

    # --- the public operations -------------------------------------------------------------------
    def preempt(self, seq: SeqState, mode: str | None = None) -> tuple[list[Preemption], CacheOps]:
        """Preempt running `seq` and its fork group now, by the cost model
        (`mode` overrides the configured one; "off" means "auto" here)."""
        mode = mode or self.mode
        if mode == "off":
            mode = "auto"
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES[:3]}, got {mode!r}")
        self.recently_preempted.clear()
        victim, _ = self.price_group(self.group_of(seq), {}, mode, self._cpu_free_for(seq.tenant))
        ops = CacheOps()
        return self.apply(PreemptionPlan([victim]), ops), ops

    def swap_in(self, seq: SeqState) -> SwapInResult:
        """Bring swapped `seq`, with the rest of its swapped fork group, back to the GPU: new GPU
        blocks, swap_in ops cpu->gpu. Needs room above the admission watermark; never preempts
        and never evicts past it."""
        seq_id = seq.seq_id
        members = self.group_of(seq)
        distinct: dict[int, None] = {}
        for m in members:
            for c in self.swapped[m].cpu_block_ids or ():
                distinct[c] = None
            for table in self.swapped[m].cpu_kv_tables or ():
                for c in table:
                    distinct[c] = None
        pool = self.pool
        watermark = self.watermark_blocks
        available = admission_room(pool.num_available, watermark)
        if len(distinct) > available:
            raise self.exhausted(
                f"swapping in {seq_id!r}"
                + (f" and its fork group ({len(members)} sequences)" if len(members) > 1 else ""),
                len(distinct),
                max(available, 0),
                watermark,
            )
        self.ledger.check_gpu(seq.tenant, len(distinct))
        ops = CacheOps()
        memo: dict[int, int] = {}
        for c in distinct:
            g = memo[c] = pool.take_one()
            ops.swap_in.append((c, g))
        first = set(memo.values())
        tables: dict[str, list[int]] = {}
        kv_tables: dict[str, list[list[int]]] = {}
        cpu = self.cpu
        cpu_released = 0
        for m in members:
            s = self.swapped.pop(m)
            gpu_tables = []
            for cpu_table in (s.cpu_block_ids or (), *(s.cpu_kv_tables or ())):
                blocks = []
                for c in cpu_table:
                    g = memo[c]
                    if g in first:
                        first.discard(g)  # take_one already counted this reference
                    else:
                        pool.incref(g)
                    blocks.append(g)
                    cpu_released += cpu.decref(c)
                gpu_tables.append(blocks)
            s.block_ids = gpu_tables[0]
            s.cpu_block_ids = None
            if s.cpu_kv_tables is not None:
                s.kv_tables = gpu_tables[1:]
                s.cpu_kv_tables = None
                kv_tables[m] = [list(t) for t in s.kv_tables]
            self.seqs[m] = s
            self.running(m, s.priority, s.arrival)
            tables[m] = list(s.block_ids)
        self.num_swapped_in_blocks += len(distinct)
        self.ledger.swapped_in(seq.tenant, len(distinct), cpu_released)
        return SwapInResult(
            seq_id=seq_id, block_ids=list(tables[seq_id]), ops=ops, tables=tables, kv_tables=kv_tables
        )
