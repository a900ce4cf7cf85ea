"""The engine's queues and every move of a sequence between them (vLLM v1's Scheduler, without I/O).

The scheduler owns the waiting, running and swapped queues, the sequences of every request the
engine has not released, what it owes the block manager (finished sequences to free, sequences an
unanswered Step may have created) and what it owes the workers (cache ops). Each iteration the
engine (frontend/engine/engine.py) asks it for a block-manager plan (:meth:`Scheduler.plan`),
sends it, hands the reply back (:meth:`Scheduler.apply_block_manager`), asks for the worker batches
(:meth:`Scheduler.batches`), runs them and hands the results back (:meth:`Scheduler.apply_outputs`).

No gRPC calls, no threads, no clock: every transition is testable against the block manager's core
in-process (tests/frontend/engine/test_scheduler.py). Which sequences go is policy.py's (pure);
what a sampled token does to a sequence is output.py's.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from pagedkv.frontend.engine import output, policy
from pagedkv.frontend.engine.policy import Limits, PoolView
from pagedkv.frontend.engine.step_messages import RESOURCE_EXHAUSTED, ItemError, StepDelta, StepPlan
from pagedkv.frontend.engine.types import (
    Completion,
    EngineStats,
    GenerationRequest,
    RequestOutput,
    Seq,
    SeqStatus,
    TokenEvent,
)
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb

log = structlog.get_logger("pagedkv.engine")


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

    @property
    def created(self) -> list[str]:
        """Sequences this Step creates in the block manager (admitted and forked)."""
        return [s.seq_id for s in self.admit] + [c.seq_id for _, c in self.forks]


@dataclass(slots=True)
class PrefillItem:
    """A prefill chunk in flight on a prefill worker: the sequence, where the chunk starts, its length,
    and the sequence's attempt when it was sent (Seq.attempt)."""

    seq: Seq
    start: int
    tokens: int
    attempt: int = 0


class Scheduler:
    def __init__(
        self,
        limits: Limits,
        num_gpu_blocks: int,
        id_prefix: str,
        stats: EngineStats,
        *,
        defer_appends: bool = True,
        grant_ahead_tokens: int | None = None,
    ) -> None:
        self.limits = limits
        self.defer_appends = defer_appends  # EngineConfig.defer_appends
        # EngineConfig.grant_ahead_tokens (None: the block size)
        self.grant_ahead_tokens = limits.block_size if grant_ahead_tokens is None else grant_ahead_tokens
        self.num_gpu_blocks = num_gpu_blocks
        self.id_prefix = id_prefix  # sequence ids are unique per engine: many engines share a manager
        self.stats = stats
        self.outputs: dict[str, RequestOutput] = {}
        self.seqs: dict[str, Seq] = {}
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.swapped: collections.deque[Seq] = collections.deque()
        self.to_free: list[str] = []  # finished: freed in the next Step (after their commits)
        # Sequences whose blocks a step a worker did not answer may still write (frontend/engine/
        # fencing.py): a finished one among them stays in to_free until the engine clears it here.
        self.held: set[str] = set()
        # Sequences a Step that got no answer may have created: freed in the next Step that does.
        self.unconfirmed: list[str] = []
        # Finished sequences the manager preempted before their Free: nothing of theirs can be
        # appended or committed any more (a recompute victim is gone, a swapped one is on the CPU).
        self.preempted_finished: set[str] = set()
        self.pending_ops = pb.CacheOps()  # cache ops owed to the workers, sent with the next worker step
        self.blocks = PoolView(num_gpu_blocks, 0)  # what the last Step reply said about the block pool
        # What recently finished sequences committed: a hint for admission (frontend/engine/admission.py),
        # each with the manager's prefix_cache_drops when it finished; trusted only while that
        # counter has not moved (nothing left the cache since, so their blocks are still cached).
        self.finished_prefixes: collections.deque[tuple[list[int], int, int]] = collections.deque(
            maxlen=limits.max_num_seqs
        )

    # --- requests ------------------------------------------------------------------
    def seq_id(self, request_id: str, index: int) -> str:
        return f"{self.id_prefix}:{request_id}/{index}"

    def add(self, request: GenerationRequest) -> RequestOutput:
        """Queue a validated request (its first sample; the others fork from it at admission)."""
        out = RequestOutput(
            request.request_id, list(request.prompt), [Completion(index=i) for i in range(request.n)]
        )
        self.outputs[request.request_id] = out
        seq = Seq(self.seq_id(request.request_id, 0), request, out, 0, list(request.prompt), width=request.n)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        self.stats.prompt_tokens += len(request.prompt)
        return out

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> bool:
        """Finish a request (or one of its samples) now: its sequences leave the queues and the
        ones holding blocks are freed in the next Step. False when nothing was left to finish."""
        found = False
        for seq in [s for s in self.seqs.values() if s.request.request_id == request_id]:
            if index is not None and seq.index != index:
                continue
            if seq.status is SeqStatus.FINISHED:
                continue
            found = True
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
            else:
                if seq.running:
                    self.running.remove(seq)
                else:
                    self.swapped.remove(seq)
                self.to_free.append(seq.seq_id)
            seq.status = SeqStatus.FINISHED
            seq.completion.finish_reason = reason
        out = self.outputs.get(request_id)
        if out is not None and index is None:
            for c in out.completions:  # samples not forked yet never will be
                if c.finish_reason is None:
                    c.finish_reason = reason
        return found

    def release(self, request_id: str) -> bool:
        """Forget a finished request once its blocks were freed. False (and everything kept) while
        any of its sequences is unfinished or waits for its Free in the next Step."""
        seqs = [s for s in self.seqs.values() if s.request.request_id == request_id]
        pending = set(self.to_free)
        if any(s.status is not SeqStatus.FINISHED or s.seq_id in pending for s in seqs):
            return False
        for s in seqs:
            del self.seqs[s.seq_id]
        self.outputs.pop(request_id, None)
        return True

    def frees_due(self) -> list[str]:
        """The Frees the next Step sends: ``to_free`` but the finished sequences held by a fence
        (a sequence requeued for recompute is freed at once: it is allocated again under its id)."""
        held = self.held
        if not held:
            return list(self.to_free)
        return [x for x in self.to_free if x not in held or self.seqs[x].status is not SeqStatus.FINISHED]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.to_free)

    def num_requests(self) -> tuple[int, int]:
        """(waiting, running) requests: running while any sample holds blocks (running or swapped)."""
        running = {s.request.request_id for s in self.running}
        running.update(s.request.request_id for s in self.swapped)
        waiting = {s.request.request_id for s in self.waiting} - running
        return len(waiting), len(running)

    def finishing(self) -> list[Seq]:
        """Finished sequences whose Free goes into the next Step (their commits go first)."""
        return [self.seqs[x] for x in self.to_free]

    def prompt_blocks(self, tokens: Sequence[int]) -> int:
        return blocks_for_tokens(len(tokens), self.limits.block_size)

    # --- the block-manager Step ----------------------------------------------------
    def needs_pool_refresh(self) -> bool:
        """Would admission trust finished sequences' hints on an old reply? (An idle engine's last
        reply may predate another frontend's evictions: the engine reads the pool afresh first.)"""
        return bool(
            self.limits.prefix_caching and self.waiting and self.finished_prefixes and not self.running
        )

    def plan(self, *, full: bool = True) -> BlockManagerPlan | None:
        """The iteration's Step: commits, frees, appends, allocations, forks, swap-ins, in the
        manager's apply order; None when there is nothing to ask. ``full=False`` (a flush): commits
        and frees only. Commits are marked as sent here.

        With ``defer_appends``, appends that fit the blocks their sequence holds, and commits, wait
        for the next Step something else needs; that Step carries every deferred token id, and
        grants the sequences near the end of their blocks their next block ahead (policy.grants),
        so that crossing a block boundary does not need a Step of its own either."""
        bs = self.limits.block_size
        grow = [s for s in self.running if s.needs_slot] if full else []
        swap_in = policy.swap_ins(self.swapped, len(self.running), self.limits) if full else []
        admit: list[Seq] = []
        if full:
            admit, held = policy.admissions(
                self.waiting,
                self.running,
                self.finishing(),
                grow,
                len(swap_in),
                self.blocks,
                self.limits,
                self.finished_prefixes,
            )
            self.stats.admissions_held += held
        commits = self._commits()
        frees = self.frees_due() + self.unconfirmed
        owed = self._owed_slots(frees, grow)
        if owed:  # their appends first; their commits and Frees in the next Step
            sent = {s.seq_id for s in owed}
            frees = [x for x in frees if x not in sent]
        lazy = self.defer_appends and full
        must_grow = [s for s in grow if not s.has_room(bs)] if lazy else grow
        if not (must_grow or frees or swap_in or admit or owed or (commits and not lazy)):
            return None
        for s, n in commits:
            s.num_committed = n
        forks = [
            (seq, self._sample_of(seq, i)) for seq in admit if seq.width > 1 for i in range(1, seq.request.n)
        ]
        # One append per token the manager has no slot for yet (its id: hashed for the prefix cache).
        items = [(s, t) for s in grow for t in s.tokens[s.num_slots :]]
        items += [(s, t) for s in owed for t in s.tokens[s.num_slots : s.num_computed // bs * bs]]
        grant: list[Seq] = []
        # No grant while a sequence waits to be admitted or swapped in: the blocks are its, and
        # with it waiting every iteration makes a Step anyway (its admission), so none is saved.
        if lazy and len(self.waiting) == len(admit) and len(self.swapped) == len(swap_in):
            bs = self.limits.block_size
            spare = (
                self.blocks.available
                - self.limits.watermark
                - sum(self.prompt_blocks(s.tokens) for s in admit)
                - policy.growth_blocks(grow, bs)
            )
            # Admitted ones too: the manager applies grants after this Step's allocations.
            candidates = [*self.running, *(s for s in admit if s.width == 1)]
            grant = policy.grants(candidates, spare, self.limits, self.grant_ahead_tokens)
        step = StepPlan(
            commits=[(s.seq_id, n) for s, n in commits],
            frees=frees,
            appends=[(s.seq_id, t) for s, t in items],
            allocs=[(s.seq_id, s.tokens, s.request.priority) for s in admit],
            forks=[(p.seq_id, c.seq_id) for p, c in forks],
            swap_ins=[s.seq_id for s in swap_in],
            grants=[s.seq_id for s in grant],
        )
        return BlockManagerPlan(step, [s for s, _ in items], swap_in, admit, forks, grant)

    def _owed_slots(self, frees: list[str], grow: list[Seq]) -> list[Seq]:
        """Finished sequences about to be freed whose computed KV fills a block the manager has no
        slots for yet (their appends were deferred, into blocks they held: the block granted ahead
        among them). Committing that block first needs those appends, and the manager applies a
        Step's commits before its appends: so this Step appends, and the next commits and frees
        (else generated text would never reach the prefix cache, for the next turn of a chat).
        None while this Step's growth needs more blocks than the pool has: their Frees go now, and
        their last blocks stay out of the prefix cache, since holding them back would make that
        growth fail and preempt a running sequence (recomputed, or swapped out and back)."""
        if not self.defer_appends or not self.limits.prefix_caching:
            return []
        bs = self.limits.block_size
        if policy.growth_blocks(grow, bs) > self.blocks.available:
            return []
        due = set(frees)
        return [
            s
            for s in self.finishing()
            if s.seq_id in due
            and s.status is SeqStatus.FINISHED
            and s.seq_id not in self.preempted_finished
            and s.num_computed // bs > min(s.num_computed, s.num_slots) // bs
        ]

    def _sample_of(self, parent: Seq, index: int) -> Seq:
        """Sample ``index`` of the parent's request, forked at its admission from its prompt."""
        return Seq(
            self.seq_id(parent.request.request_id, index),
            parent.request,
            parent.output,
            index,
            list(parent.tokens),
            parent=parent,
        )

    def _commits(self) -> list[tuple[Seq, int]]:
        """(sequence, computed tokens) of sequences whose computed KV grew past a block boundary since
        their last commit (only full blocks enter the prefix cache), finished ones included; never
        past the slots the manager holds (it applies commits before this Step's appends)."""
        bs = self.limits.block_size
        out = []
        for s in itertools.chain(self.running, self.finishing()):
            if s.seq_id in self.preempted_finished:
                continue
            n = min(s.num_computed, s.num_slots)
            if n // bs > s.num_committed // bs:
                out.append((s, n))
        return out

    def step_unanswered(self, plan: BlockManagerPlan) -> None:
        """The Step got no answer: what it may have created is freed by the first one that does."""
        self.unconfirmed.extend(plan.created)

    def note_pool(self, delta: StepDelta) -> None:
        self.blocks = PoolView(delta.available_blocks, delta.prefix_cache_drops)

    def apply_block_manager(self, plan: BlockManagerPlan, delta: StepDelta) -> None:
        """A Step reply: block tables, cache ops (owed to the workers), preemptions, allocations,
        forks and swap-ins. What the plan freed is gone from the manager now."""
        if plan.step.frees:
            sent = set(plan.step.frees)
            self.to_free = [x for x in self.to_free if x not in sent]
            self.unconfirmed = []
            self.preempted_finished -= sent
        self.note_pool(delta)
        grow = plan.grow
        for i, block, replaces_last in delta.grown:
            s = grow[i]
            if replaces_last:
                s.block_table[-1] = block
                continue
            if s.ahead_block is not None:
                if block != s.ahead_block:  # its KV may already be in the granted block
                    raise RuntimeError(
                        f"block manager grew {s.seq_id} into block {block}, not block {s.ahead_block} "
                        "it granted ahead"
                    )
                s.ahead_block = None
            s.block_table.append(block)
        self.pending_ops.copies.extend(delta.ops.copies)
        self.pending_ops.swap_out.extend(delta.ops.swap_out)
        self.pending_ops.swap_in.extend(delta.ops.swap_in)
        preempted = self._apply_preemptions(delta)
        errors: dict[str, dict[int, ItemError]] = collections.defaultdict(dict)
        for err in delta.errors:
            errors[err.kind][err.index] = err
        self._apply_allocations(delta, plan.admit, errors["alloc"])
        self._apply_forks(plan.forks, errors["fork"])
        self._apply_swap_ins(delta, plan.swap_in)
        for j, block in delta.granted:  # (a refused grant changes nothing: it is asked again later)
            if plan.grant[j].running:
                plan.grant[j].ahead_block = block
                self.stats.blocks_granted_ahead += 1
        failed: set[int] = set()
        for err in delta.errors:
            if err.kind in ("alloc", "fork", "swap_in", "grant"):
                continue  # handled above (a swap-in without room stays swapped)
            if err.seq_id in preempted:
                failed.add(err.index)
                continue  # its own later item: expected after its preemption
            if err.kind != "append":
                log.warning("step_item_error", kind=err.kind, seq_id=err.seq_id, message=err.message)
                continue
            failed.add(err.index)
            if err.code == RESOURCE_EXHAUSTED:
                # Nothing left to preempt for it: preempt it ourselves (freed in the next Step,
                # before its re-allocation there, so it may hit its own committed blocks).
                if grow[err.index].running:  # (once: a sequence may have several appends)
                    self._preempt_self(grow[err.index])
            else:
                raise RuntimeError(f"block manager refused to grow {err.seq_id}: {err.message}")
        for i, s in enumerate(grow):
            if i not in failed and (s.running or s.status is SeqStatus.FINISHED):  # (owed slots)
                s.num_slots += 1
                s.tail_shared = False  # the manager copied a shared tail on this write

    def _apply_allocations(self, delta: StepDelta, admit: list[Seq], errors: dict[int, ItemError]) -> None:
        for j, seq in enumerate(admit):
            err = errors.get(j)
            if err is not None:
                if err.code == RESOURCE_EXHAUSTED:
                    continue  # no room yet: it keeps its place in the queue
                raise RuntimeError(f"block manager refused to allocate {err.seq_id}: {err.message}")
            self.waiting.remove(seq)
            seq.block_table = delta.alloc_tables[j]
            cached = delta.alloc_cached[j]
            seq.num_computed = seq.num_committed = cached
            seq.num_slots = len(seq.tokens)
            if seq.index == 0 and not seq.output.completions[0].token_ids:
                seq.output.num_cached_tokens = cached
            self.stats.prefix_hit_tokens += cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _apply_forks(self, forks: list[tuple[Seq, Seq]], errors: dict[int, ItemError]) -> None:
        for j, (parent, child) in enumerate(forks):
            err = errors.get(j)
            if err is not None and not parent.running:
                continue  # the parent was not admitted: it forks again when it is
            parent.width = 1
            if err is not None:
                # E.g. a tenant's sequence quota: this sample becomes a request of its own, later.
                log.info("fork_refused", seq_id=child.seq_id, code=err.code, message=err.message)
                child.parent = None
                self.seqs[child.seq_id] = child
                self.waiting.append(child)
                continue
            parent.children.append(child)
            parent.tail_shared = child.tail_shared = True
            child.block_table = list(parent.block_table)
            child.num_computed = child.num_committed = parent.num_computed
            child.num_slots = parent.num_slots
            child.status = SeqStatus.RUNNING
            self.seqs[child.seq_id] = child
            self.running.append(child)

    def _apply_preemptions(self, delta: StepDelta) -> set[str]:
        """Follow the block manager's preemption decisions; returns the victims' ids."""
        victims: set[str] = set()
        for p in delta.preempted:
            victims.add(p.seq_id)
            seq = self.seqs.get(p.seq_id)
            if seq is not None and seq.status is SeqStatus.FINISHED:
                self.preempted_finished.add(
                    seq.seq_id
                )  # its Free still goes (a swapped one holds CPU blocks)
                continue
            if seq is None or not seq.running:
                continue
            if p.swap:
                self.running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                # Its table's blocks go to the CPU whole; the block granted ahead is released, and
                # with it the KV its deferred tokens wrote there: those are computed again.
                seq.num_computed = min(seq.num_computed, len(seq.block_table) * self.limits.block_size)
                seq.block_table = []
                seq.ahead_block = None  # released by the swap-out
                self.swapped.append(seq)
                self.stats.preempted_swap += 1
            else:
                self._requeue(seq)
                self.stats.preempted_recompute += 1
            log.info("preempted", seq_id=seq.seq_id, mode="SWAP" if p.swap else "RECOMPUTE", cost_s=p.cost_s)
        return victims

    def _apply_swap_ins(self, delta: StepDelta, asked: list[Seq]) -> None:
        for _, members in zip(asked, delta.swap_ins, strict=False):
            for seq_id, table in members:
                s = self.seqs.get(seq_id)
                if s is None or s.status is not SeqStatus.SWAPPED:
                    continue
                s.block_table = table
                s.status = SeqStatus.RUNNING
                self.swapped.remove(s)
                self.running.append(s)

    def _preempt_self(self, seq: Seq) -> None:
        """Recompute it later: its Free goes into the next Step, ahead of its re-allocation."""
        self.to_free.append(seq.seq_id)
        self._requeue(seq)
        self.stats.preempted_recompute += 1
        log.info("preempted", seq_id=seq.seq_id, mode="RECOMPUTE", by="engine")

    def _requeue(self, seq: Seq) -> None:
        """Back to the front of the queue; everything generated so far becomes its prompt.
        A sample still waiting for its parent's prompt becomes a request of its own."""
        if seq.running:
            self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.attempt += 1
        seq.block_table = []
        seq.ahead_block = None
        seq.num_computed = seq.num_committed = seq.num_slots = 0
        seq.parent = None
        seq.tail_shared = False
        self.waiting.appendleft(seq)

    # --- faults --------------------------------------------------------------------
    def take_block_holders(self) -> tuple[list[Seq], list[str]]:
        """Every running and swapped sequence, and the ids of everything this engine may hold in
        the block manager (those, finished ones, what an unanswered Step may have created)."""
        victims = list(self.running) + list(self.swapped)
        frees = [s.seq_id for s in victims] + self.to_free + self.unconfirmed
        self.to_free, self.unconfirmed = [], []
        self.preempted_finished.clear()
        return victims, frees

    def requeue_all(self, victims: list[Seq]) -> None:
        """Every running and swapped sequence back to the head of the queue, in order, to be
        recomputed; no cache op of the old tables may run any more, and no hint of what finished
        sequences committed holds."""
        for s in reversed(victims):  # appendleft: keep their order at the head of the queue
            self.stats.recomputed_tokens += s.num_computed
            if s.status is SeqStatus.SWAPPED:
                self.swapped.remove(s)
            self._requeue(s)
        self.pending_ops = pb.CacheOps()
        self.finished_prefixes.clear()

    def forget_all(self) -> list[str]:
        """Closing: every running and swapped sequence leaves the queues; the ids to free."""
        victims, frees = self.take_block_holders()
        self.running = []
        self.swapped.clear()
        return frees

    # --- the worker step -----------------------------------------------------------
    def batches(
        self, *, separate_budgets: bool, num_workers: int, prefill_busy: bool
    ) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, int]]]:
        """(sequence, tokens to compute) of this iteration's decode batch and prefill chunks."""
        return policy.batches(
            self.running,
            self.limits,
            separate_budgets=separate_budgets,
            num_workers=num_workers,
            prefill_busy=prefill_busy,
        )

    def decode_steps(self, batch: list[tuple[Seq, int]], want: int) -> list[int] | None:
        """Decode steps per sequence of ``batch`` in one worker call (policy.decode_steps), or None
        for one: also while a sequence waits for admission or a swap-in (it would wait for the
        whole call)."""
        if want <= 1 or self.waiting or self.swapped:
            return None
        return policy.decode_steps(batch, want, self.limits.block_size)

    def take_ops(self) -> pb.CacheOps:
        """The cache ops owed to the workers, for the worker step about to be sent."""
        ops, self.pending_ops = self.pending_ops, pb.CacheOps()
        return ops

    def has_pending_ops(self) -> bool:
        ops = self.pending_ops
        return bool(len(ops.copies) or len(ops.swap_out) or len(ops.swap_in))

    def start_prefill(self, chunks: list[tuple[Seq, int]]) -> list[PrefillItem]:
        """The chunks a prefill worker computes while the engine goes on decoding."""
        for s, _ in chunks:
            s.status = SeqStatus.PREFILLING
        return [PrefillItem(s, s.num_computed, k, s.attempt) for s, k in chunks]

    def end_prefill(self, items: list[PrefillItem]) -> list[PrefillItem]:
        """A prefill came back (or was dropped): its sequences compute here again. Returns the items
        whose results still apply: not those of a sequence preempted while its chunk ran, even one
        admitted again since (an overlapped Step's preemption, then the next Step's admission) at the
        same start: its chunk wrote into the blocks of its earlier attempt."""
        for it in items:
            if it.seq.status is SeqStatus.PREFILLING:
                it.seq.status = SeqStatus.RUNNING
        return [
            it
            for it in items
            if it.seq.status is SeqStatus.RUNNING
            and it.seq.num_computed == it.start
            and it.seq.attempt == it.attempt
        ]

    def fork_draws(self, s: Seq, tokens: int) -> list[Seq]:
        """The samples whose first token the worker draws in this step of ``s`` (n > 1: from the
        prompt's last position, so only with the prompt's final chunk)."""
        final = s.num_computed + tokens == len(s.tokens)
        s.forks_sent = [c for c in s.children if c.awaiting_parent] if final else []
        return s.forks_sent

    def apply_outputs(
        self, items: Sequence[PrefillItem], outputs: Sequence[wpb.SequenceOutput]
    ) -> list[TokenEvent]:
        """A worker step's results: the computed chunks, and for every sequence whose prompt is now
        computed its sampled token (and its forked samples' first tokens)."""
        events: list[TokenEvent] = []
        for it, out in zip(items, outputs, strict=False):
            s = it.seq
            s.num_computed += it.tokens
            self.stats.computed_tokens += it.tokens
            for c in s.children:
                if c.awaiting_parent:
                    c.num_computed = s.num_computed  # their shared prompt blocks were just written
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk: its sampled token is meaningless
            for child, drawn in output.fork_firsts(s, out.fork_samples):
                events.append(self._accept_token(child, drawn))
            events.append(self._accept_token(s, out))
            if out.next_samples:
                events += self._accept_next(s, out.next_samples)
        return events

    def _accept_next(self, s: Seq, samples: Sequence[wpb.Sample]) -> list[TokenEvent]:
        """Multi-step decode: the tokens the steps after the first drew, each computed on the one
        before it. They count until one finishes the sequence (a stop string the caller matches
        aborts it later, as with single steps); what the worker computed past that is dropped with
        the sequence's blocks."""
        events = []
        for drawn in samples:
            if s.status is not SeqStatus.RUNNING:
                break
            s.num_computed += 1  # the token the last step drew is in the cache now
            self.stats.computed_tokens += 1
            self.stats.multi_step_tokens += 1
            events.append(self._accept_token(s, drawn))
        return events

    def _accept_token(self, s: Seq, drawn: output.Drawn) -> TokenEvent:
        ev = output.accept_token(s, drawn)
        self.stats.generated_tokens += 1
        if ev.finish_reason is not None:
            self.running.remove(s)
            self.to_free.append(s.seq_id)
            self.finished_prefixes.append((s.tokens, s.num_computed, self.blocks.prefix_cache_drops))
        return ev

    def reservable(self, batch: list[tuple[Seq, int]]) -> list[Seq]:
        """Overlap: the sequences of this worker step that will go on after it, whose next slot
        may be reserved while it computes (a sequence whose prompt's last chunk is in this step,
        one that finishes by length, and a parent whose samples wait for this step are left out)."""
        return [
            s
            for s, k in batch
            if s.num_computed + k == len(s.tokens)
            and not s.needs_slot
            and s.completion.token_ids
            and len(s.completion.token_ids) + 1 < s.request.max_tokens
            and not any(c.awaiting_parent for c in s.children)
        ]

    def apply_reservations(self, seqs: list[Seq], delta: StepDelta) -> None:
        """The reply to an overlapped Step that reserved ``seqs``' next slots."""
        self.stats.slots_reserved_ahead += len(seqs)
        self.apply_block_manager(
            BlockManagerPlan(StepPlan(appends=[(s.seq_id, None) for s in seqs]), grow=seqs), delta
        )
