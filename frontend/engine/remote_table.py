"""The block manager's side of this engine's sequences, as the engine knows it (a remote block table).

The manager owns every block; the engine mirrors its own share to save round trips. Per sequence
(``Seq.blocks``, types.py SeqBlocks): its table, the token slots the manager holds, what it was told
is computed, the block granted ahead and whether its tail is shared. For the engine as a whole
(:class:`RemoteTable`): what it owes the manager (the Frees of finished sequences, held back while a
fenced worker may still write their blocks, and of what an unanswered Step may have created), the
cache ops the manager's replies left owed to the workers, the pool as the last reply showed it,
and what recently finished sequences committed (an admission hint).

The scheduler asks it whether a sequence can grow without a Step (:meth:`RemoteTable.can_grow`),
which commits and appends are owed, and after each Step hands it the reply
(:meth:`RemoteTable.reconcile`, then :meth:`RemoteTable.reconcile_appends` once the queues moved).
Pure: no gRPC, no clock.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from pagedkv.frontend.engine.step_messages import RESOURCE_EXHAUSTED, StepDelta, StepPlan
from pagedkv.frontend.engine.types import Seq, SeqStatus
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.v1 import block_manager_pb2 as pb

log = structlog.get_logger("pagedkv.engine")


@dataclass(slots=True, frozen=True)
class PoolView:
    """What the last Step reply said about the pool: free + cached blocks, and how many cached
    blocks ever left the prefix cache (a finished sequence's prefix is trusted while it has not moved)."""

    available: int
    prefix_cache_drops: int


@dataclass(slots=True)
class BlockManagerPlan:
    """One Step's worth of work, with the sequences its reply is applied to: the ones that grow by
    a slot, come back from the CPU pool, are admitted, and the samples forked from the admitted."""

    step: StepPlan
    grow: list[Seq] = field(default_factory=list)
    swap_in: list[Seq] = field(default_factory=list)
    admit: list[Seq] = field(default_factory=list)
    forks: list[tuple[Seq, Seq]] = field(default_factory=list)
    grant: list[Seq] = field(default_factory=list)
    # Beam search: new beams forked ahead of the appends (StepPlan.early_forks), each appending its
    # own token in this Step.
    beam_forks: list[tuple[Seq, Seq]] = field(default_factory=list)

    @property
    def created(self) -> list[str]:
        """Sequences this Step creates in the block manager (admitted and forked)."""
        forks = self.forks + self.beam_forks
        return [s.seq_id for s in self.admit] + [c.seq_id for _, c in forks]


def growth_blocks(grow: Iterable[Seq], block_size: int) -> int:
    """New blocks the appends of ``grow`` take: their tokens past the blocks they hold."""
    return sum(s.blocks.growth(len(s.tokens), block_size) for s in grow)


class RemoteTable:
    """What this engine knows the block manager holds for it and what it owes it."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        *,
        prefix_caching: bool,
        defer_appends: bool,
        hints: int,
        kv_groups: tuple[int, ...] = (0,),
    ) -> None:
        self.block_size = block_size
        # The pool's KV-cache groups (Config.kv_groups), each's window in tokens (0: full): groups
        # 1.. have a table each per sequence (SeqBlocks.groups); a window group's loses its entries
        # before the window at each Commit.
        self.kv_groups = kv_groups
        self.prefix_caching = prefix_caching
        self.defer_appends = defer_appends  # EngineConfig.defer_appends
        self.pool = PoolView(num_gpu_blocks, 0)  # what the last Step reply said about the block pool
        self.to_free: list[Seq] = []  # freed in the next Step (after their commits)
        # Sequences whose blocks a step a worker did not answer may still write (frontend/engine/
        # fencing.py): a finished one among them stays in to_free until the engine clears it here.
        self.held: set[str] = set()
        # Sequences a Step that got no answer may have created: freed in the next Step that does.
        self.unconfirmed: list[str] = []
        # Finished sequences the manager preempted before their Free: nothing of theirs can be
        # appended or committed any more (a recompute victim is gone, a swapped one is on the CPU).
        self.preempted_finished: set[str] = set()
        self.pending_ops = pb.CacheOps()  # cache ops owed to the workers, sent with the next worker step
        # What recently finished sequences committed: a hint for admission (frontend/engine/admission.py),
        # each with the manager's prefix_cache_drops when it finished; trusted only while that
        # counter has not moved (nothing left the cache since, so their blocks are still cached).
        self.finished_prefixes: collections.deque[tuple[list[int], int, int]] = collections.deque(
            maxlen=hints
        )

    # --- what the engine owes the manager ------------------------------------------
    def free_later(self, seq: Seq) -> None:
        """Free it in the next Step (after its commits)."""
        self.to_free.append(seq)

    def finished(self, seq: Seq) -> None:
        """It finished: freed in the next Step, and what it committed is a hint for admission."""
        self.to_free.append(seq)
        self.finished_prefixes.append((seq.tokens, seq.num_computed, self.pool.prefix_cache_drops))

    def owes_free(self, seq: Seq) -> bool:
        return seq in self.to_free

    def finishing(self) -> list[Seq]:
        """Sequences whose Free goes into the next Step (their commits go first)."""
        return list(self.to_free)

    def frees_due(self) -> list[str]:
        """The Frees the next Step sends: ``to_free`` but the finished sequences held by a fence
        (a sequence requeued for recompute is freed at once: it is allocated again under its id)."""
        return [
            s.seq_id for s in self.to_free if s.seq_id not in self.held or s.status is not SeqStatus.FINISHED
        ]

    def unanswered(self, seq_ids: Iterable[str]) -> None:
        """A Step got no answer: what it may have created is freed by the first one that does."""
        self.unconfirmed.extend(seq_ids)

    def take_all_frees(self) -> list[str]:
        """Every Free owed (the engine is about to free everything it may hold)."""
        frees = [s.seq_id for s in self.to_free] + self.unconfirmed
        self.to_free, self.unconfirmed = [], []
        self.preempted_finished.clear()
        return frees

    def forget_cache(self) -> None:
        """The cache's contents are gone or void: no cache op of the old tables may run any more,
        and no hint of what finished sequences committed holds."""
        self.pending_ops = pb.CacheOps()
        self.finished_prefixes.clear()

    # --- what the workers are owed -------------------------------------------------
    def take_ops(self) -> pb.CacheOps:
        """The cache ops owed to the workers, for the worker step about to be sent."""
        ops, self.pending_ops = self.pending_ops, pb.CacheOps()
        return ops

    def has_pending_ops(self) -> bool:
        ops = self.pending_ops
        return bool(len(ops.copies) or len(ops.swap_out) or len(ops.swap_in))

    # --- growth, commits, owed appends ---------------------------------------------
    def note_pool(self, delta: StepDelta) -> None:
        self.pool = PoolView(delta.available_blocks, delta.prefix_cache_drops)

    def can_grow(self, seq: Seq) -> bool:
        """May it compute its last token now, without a Step?"""
        return seq.blocks.fits(len(seq.tokens), self.block_size)

    def commits(self, running: Iterable[Seq]) -> list[tuple[Seq, int]]:
        """(sequence, computed tokens) of sequences whose computed KV grew past a block boundary since
        their last commit (only full blocks enter the prefix cache), finished ones included; never
        past the slots the manager holds (it applies commits before this Step's appends)."""
        bs = self.block_size
        out = []
        for s in itertools.chain(running, self.to_free):
            if s.seq_id in self.preempted_finished:
                continue
            n = min(s.num_computed, s.blocks.slots)
            if n // bs > s.blocks.committed // bs:
                out.append((s, n))
        return out

    def owed_slots(self, frees: list[str], grow: list[Seq]) -> list[Seq]:
        """Finished sequences about to be freed whose computed KV fills a block the manager has no
        slots for yet (their appends were deferred, into blocks they held: the block granted ahead
        among them). Committing that block first needs those appends, and the manager applies a
        Step's commits before its appends: so this Step appends, and the next commits and frees
        (else generated text would never reach the prefix cache, for the next turn of a chat).
        None while this Step's growth needs more blocks than the pool has: their Frees go now, and
        their last blocks stay out of the prefix cache, since holding them back would make that
        growth fail and preempt a running sequence (recomputed, or swapped out and back)."""
        if not self.defer_appends or not self.prefix_caching:
            return []
        bs = self.block_size
        if growth_blocks(grow, bs) > self.pool.available:
            return []
        due = set(frees)
        return [
            s
            for s in self.to_free
            if s.seq_id in due
            and s.status is SeqStatus.FINISHED
            and s.seq_id not in self.preempted_finished
            and s.num_computed // bs > min(s.num_computed, s.blocks.slots) // bs
        ]

    # --- what a Step did to one sequence --------------------------------------------
    def allocated(
        self, seq: Seq, table: list[int], cached: int, groups: list[list[int]] | None = None
    ) -> None:
        """Admitted: its table (and groups 1..'s), a slot for each token, and its prefix hits
        computed (and committed)."""
        b = seq.blocks
        b.table, b.slots = table, len(seq.tokens)
        b.groups = [list(t) for t in groups or ()]
        seq.num_computed = b.committed = cached

    def committing(self, seq: Seq, num_tokens: int) -> None:
        """A Commit of ``num_tokens`` goes in this Step: the manager releases each window group's
        blocks before the window of that position (core/kv_groups.py), and so does this table."""
        b = seq.blocks
        b.committed = num_tokens
        n, bs = len(b.table), self.block_size
        for window, tail in zip(self.kv_groups[1:], b.groups, strict=False):
            first_live = max(0, (num_tokens - window + 1) // bs) if window else 0
            drop = first_live - (n - len(tail))
            if drop > 0:
                del tail[:drop]

    def forked(self, parent: Seq, child: Seq) -> None:
        """A sample (or a beam) forked from ``parent``: it shares every block of its table (so both
        tails are shared), not the block granted ahead, as in the manager."""
        p, c = parent.blocks, child.blocks
        c.table, c.slots, c.committed = list(p.table), p.slots, p.committed
        c.groups = [list(t) for t in p.groups]
        child.num_computed = parent.num_computed
        p.tail_shared = c.tail_shared = True

    def rolled_back(self, seq: Seq, num_tokens: int) -> None:
        """Shortened to ``num_tokens`` slots (speculative decoding: a Step's rollback takes back
        the slots of rejected proposals): the table's blocks wholly past them leave it, as they
        leave the manager's; the block granted ahead stays granted."""
        b = seq.blocks
        b.slots = min(b.slots, num_tokens)
        keep, n = blocks_for_tokens(num_tokens, self.block_size), len(b.table)
        del b.table[keep:]
        for tail in b.groups:  # every KV-cache group's too (a tail starts at n - len(tail))
            del tail[max(0, keep - (n - len(tail))) :]

    def swapped_out(self, seq: Seq) -> None:
        """Its table's blocks went to the CPU pool whole; the block granted ahead was released, and
        with it the KV its deferred tokens wrote there: those are computed again."""
        b = seq.blocks
        seq.num_computed = min(seq.num_computed, len(b.table) * self.block_size)
        b.table, b.ahead = [], None
        b.groups = []

    # --- a Step's reply ------------------------------------------------------------
    def reconcile(self, plan: BlockManagerPlan, delta: StepDelta) -> None:
        """The reply's changes to what the manager holds, before the queues move: what the plan freed
        is gone, the pool, the grown tables (a copy-on-write replaces the last block; a sequence
        growing into its block granted ahead must get that block), the cache ops owed."""
        if plan.step.frees:
            sent = set(plan.step.frees)
            self.to_free = [s for s in self.to_free if s.seq_id not in sent]
            self.unconfirmed = []
            self.preempted_finished -= sent
        self.note_pool(delta)
        for i, block, replaces_last in delta.grown:
            b = plan.grow[i].blocks
            if replaces_last:
                b.table[-1] = block
                continue
            if b.ahead is not None:
                if block != b.ahead:  # its KV may already be in the granted block
                    raise RuntimeError(
                        f"block manager grew {plan.grow[i].seq_id} into block {block}, not block "
                        f"{b.ahead} it granted ahead"
                    )
                b.ahead = None
            b.table.append(block)
        for g, grown in enumerate(delta.group_grown):  # groups 1..: grow alike (no grants with groups)
            for i, block, replaces_last in grown:
                tail = plan.grow[i].blocks.groups[g]
                if replaces_last:
                    tail[-1] = block
                else:
                    tail.append(block)
        self.pending_ops.copies.extend(delta.ops.copies)
        self.pending_ops.swap_out.extend(delta.ops.swap_out)
        self.pending_ops.swap_in.extend(delta.ops.swap_in)

    def reconcile_appends(self, plan: BlockManagerPlan, delta: StepDelta, victims: set[str]) -> list[Seq]:
        """The rest of the reply, once the queues moved (preemptions, allocations, swap-ins): the
        blocks granted ahead to sequences still running, and a slot for each append that went
        through. Returns the sequences whose append found no room and nothing left to preempt:
        the scheduler preempts them itself. Another refused append is a bug, raised."""
        for j, block in delta.granted:  # (a refused grant changes nothing: it is asked again later)
            if plan.grant[j].running:
                plan.grant[j].blocks.ahead = block
        failed: set[int] = set()
        no_room: list[Seq] = []
        for err in delta.errors:
            if err.kind in ("alloc", "fork", "swap_in", "grant"):
                continue  # the scheduler's (a swap-in without room stays swapped)
            if err.seq_id in victims:
                failed.add(err.index)
                continue  # its own later item: expected after its preemption
            if err.kind != "append":
                log.warning("step_item_error", kind=err.kind, seq_id=err.seq_id, message=err.message)
                continue
            failed.add(err.index)
            s = plan.grow[err.index]
            if err.code != RESOURCE_EXHAUSTED:
                raise RuntimeError(f"block manager refused to grow {err.seq_id}: {err.message}")
            if s.running and s not in no_room:  # (once: a sequence may have several appends)
                no_room.append(s)
        for i, s in enumerate(plan.grow):
            if i not in failed and (s.running or s.status is SeqStatus.FINISHED) and s not in no_room:
                s.blocks.slots += 1
                s.blocks.tail_shared = False  # the manager copied a shared tail on this write
        return no_room
