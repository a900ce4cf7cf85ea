"""The engine's queues and every move of a sequence between them (vLLM v1's Scheduler, without I/O).

The scheduler owns the waiting, running and swapped queues and the sequences of every request the
engine has not released; what the block manager holds for them and what it is owed (Frees, owed
appends, cache ops for the workers) is the remote table's (remote_table.py), which the scheduler
asks whether a sequence can grow without a Step and hands each reply to. Each iteration the
engine (frontend/engine/engine.py) asks it for a block-manager plan (:meth:`Scheduler.plan`),
sends it, hands the reply back (:meth:`Scheduler.apply_block_manager`), asks for the worker batches
(:meth:`Scheduler.batches`), runs them and hands the results back (:meth:`Scheduler.apply_outputs`).

No gRPC calls, no threads, no clock: every transition is testable against the block manager's core
in-process (tests/frontend/engine/test_scheduler.py). Which sequences go is policy.py's (pure);
what a sampled token does to a sequence is output.py's.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from pagedkv.frontend.engine import output, policy
from pagedkv.frontend.engine.beam_group import BeamGroup
from pagedkv.frontend.engine.policy import Limits
from pagedkv.frontend.engine.remote_table import BlockManagerPlan, RemoteTable, growth_blocks
from pagedkv.frontend.engine.speculate import (
    SpeculativeConfig,
    draft_tokens_for,
    next_proposal_bound,
    proposal_for,
    speculation_on,
)
from pagedkv.frontend.engine.step_messages import (
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    ItemError,
    StepDelta,
    StepPlan,
)
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
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.watermark import never_admitted

log = structlog.get_logger("pagedkv.engine")


@dataclass(slots=True)
class PrefillItem:
    """A prefill chunk in flight on a prefill worker: the sequence, where the chunk starts, its length,
    and the sequence's attempt when it was sent (SeqBlocks.attempt)."""

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
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.limits = limits
        self.speculative = speculative  # EngineConfig.speculative (None: off)
        # Sequences whose slots in the block manager past a length hold proposals that were
        # rejected or never verified: rolled back to that length in the next Step (after a
        # swap-in for a swapped one: only a running sequence can be rolled back).
        self.rollbacks: dict[Seq, int] = {}
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
        # Beam search (beam_group.py): each beam-search request's search and live beams, and the
        # new beams a decision forked, sent in the next Step ahead of its appends (each then
        # appends its own token), until a reply applied them.
        self.beams: dict[str, BeamGroup] = {}
        self.beam_forks: list[tuple[Seq, Seq]] = []
        # What the block manager holds for this engine's sequences, and what it is owed.
        self.remote = RemoteTable(
            limits.block_size,
            num_gpu_blocks,
            prefix_caching=limits.prefix_caching,
            defer_appends=defer_appends,
            hints=limits.max_num_seqs,
        )

    # --- requests ------------------------------------------------------------------
    def seq_id(self, request_id: str, index: int) -> str:
        return f"{self.id_prefix}:{request_id}/{index}"

    def add(self, request: GenerationRequest) -> RequestOutput:
        """Queue a validated request (its first sample; the others fork from it at admission)."""
        out = RequestOutput(
            request.request_id,
            list(request.prompt),
            [Completion(index=i) for i in range(request.n)],
            prompt_logprobs=None if request.prompt_logprobs is None else [None] * len(request.prompt),
        )
        self.outputs[request.request_id] = out
        # A beam search's first beam holds its own tokens, and its admission counts all n places.
        own = Completion(index=0) if request.beam is not None else None
        seq = Seq(
            self.seq_id(request.request_id, 0),
            request,
            out,
            0,
            list(request.prompt),
            width=request.n,
            own_completion=own,
        )
        if own is not None:
            self.beams[request.request_id] = BeamGroup.start(seq)
        self.seqs[seq.seq_id] = seq
        self._enqueue(seq)
        self.stats.prompt_tokens += len(request.prompt)
        return out

    def _enqueue(self, seq: Seq) -> None:
        """Join the waiting queue behind every sequence of the same or a higher priority: admission
        goes by priority, then arrival (the block manager's convention, higher first; serve maps
        vLLM's lower-first onto it). With every priority 0, as under fcfs, this is arrival order."""
        i = len(self.waiting)
        while i and self.waiting[i - 1].request.priority < seq.request.priority:
            i -= 1
        self.waiting.insert(i, seq)

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> bool:
        """Finish a request (or one of its samples) now: its sequences leave the queues and the
        ones holding blocks are freed in the next Step. False when nothing was left to finish.
        A beam search ends whole (its beams are not its completions: an index is not one of them);
        beams forked by its last decision and not sent yet are dropped by the next plan."""
        if self.beams.pop(request_id, None) is not None:
            index = None
        found = False
        for seq in [s for s in self.seqs.values() if s.request.request_id == request_id]:
            if index is not None and seq.index != index:
                continue
            if seq.status is SeqStatus.FINISHED:
                continue
            found = True
            self._finish(seq, reason)
        out = self.outputs.get(request_id)
        if out is not None and index is None:
            for c in out.completions:  # samples not forked yet never will be
                if c.finish_reason is None:
                    c.finish_reason = reason
        return found

    def _finish(self, seq: Seq, reason: str) -> None:
        """It leaves the queues now; if it holds blocks, they are freed in the next Step."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self._drop_proposal(seq)
            if seq.running:
                self.running.remove(seq)
            else:
                self.swapped.remove(seq)
            self.remote.free_later(seq)
        seq.status = SeqStatus.FINISHED
        seq.completion.finish_reason = reason

    def release(self, request_id: str) -> bool:
        """Forget a finished request once its blocks were freed. False (and everything kept) while
        any of its sequences is unfinished or waits for its Free in the next Step."""
        seqs = [s for s in self.seqs.values() if s.request.request_id == request_id]
        if any(s.status is not SeqStatus.FINISHED or self.remote.owes_free(s) for s in seqs):
            return False
        for s in seqs:
            del self.seqs[s.seq_id]
        self.outputs.pop(request_id, None)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.remote.to_free)

    def should_back_off(self, *, prefill_in_flight: bool) -> bool:
        """An iteration with nothing to compute: should the engine pause before the next, rather
        than spin? Yes while only Frees a fence holds back are left, or while the head of the queue
        waits, with nothing running, for room other frontends hold. Not while cache ops are owed
        (they go with the next worker step). Raises for a head that could never be admitted."""
        if self.remote.has_pending_ops():
            return False
        waits_for_fence = bool(self.remote.to_free) and not self.remote.frees_due()
        if waits_for_fence and not self.waiting and not self.running and not self.swapped:
            return True
        if not self.waiting or self.running or self.swapped or self.remote.frees_due() or prefill_in_flight:
            return False
        head = self.waiting[0]
        # Its tokens (the prompt, and what it generated before a preemption by recompute): samples
        # fork from them and share them.
        limits = self.limits
        why = never_admitted(
            len(head.tokens), limits.block_size, self.num_gpu_blocks, limits.watermark, limits.kv_groups
        )
        if why is not None:
            raise RuntimeError(f"request {head.request.request_id}: {why}")
        return True

    def num_requests(self) -> tuple[int, int]:
        """(waiting, running) requests: running while any sample holds blocks (running or swapped)."""
        running = {s.request.request_id for s in self.running}
        running.update(s.request.request_id for s in self.swapped)
        waiting = {s.request.request_id for s in self.waiting} - running
        return len(waiting), len(running)

    def prompt_blocks(self, tokens: Sequence[int]) -> int:
        return blocks_for_tokens(len(tokens), self.limits.block_size) * self.limits.kv_groups

    # --- the block-manager Step ----------------------------------------------------
    def needs_pool_refresh(self) -> bool:
        """Would admission trust finished sequences' hints on an old reply? (An idle engine's last
        reply may predate another frontend's evictions: the engine reads the pool afresh first.)"""
        return bool(
            self.limits.prefix_caching and self.waiting and self.remote.finished_prefixes and not self.running
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
        remote = self.remote
        rollbacks = self._take_rollbacks()  # applied first: commits and appends see the new lengths
        if full:
            self._propose()
        grow = [s for s in self.running if s.needs_slot] if full else []
        beam_forks = self._beam_forks() if full else []  # (its children append beside ``grow``)
        swap_in = policy.swap_ins(self.swapped, len(self.running), self.limits) if full else []
        admit: list[Seq] = []
        if full:
            admit, held = policy.admissions(
                self.waiting,
                self.running,
                remote.finishing(),
                grow + [c for _, c in beam_forks],
                len(swap_in),
                remote.pool,
                self.limits,
                remote.finished_prefixes,
            )
            self.stats.admissions_held += held
        commits = remote.commits(self.running)
        frees = remote.frees_due() + remote.unconfirmed
        owed = remote.owed_slots(frees, grow)
        if owed:  # their appends first; their commits and Frees in the next Step
            sent = {s.seq_id for s in owed}
            frees = [x for x in frees if x not in sent]
        lazy = self.defer_appends and full
        must_grow = [s for s in grow if not remote.can_grow(s)] if lazy else grow
        asks = rollbacks or must_grow or frees or swap_in or admit or owed or beam_forks
        if not (asks or (commits and not lazy)):
            return None
        for s, n in commits:
            remote.committing(s, n)
        for parent, child in beam_forks:  # forked before the appends: the parent's table as it is now
            remote.forked(parent, child)
        forks = [
            (seq, self._sample_of(seq, i))
            for seq in admit
            if seq.width > 1 and not seq.is_beam  # (a beam search forks at its first decision)
            for i in range(1, seq.request.n)
        ]
        # One append per token the manager has no slot for yet (its id: hashed for the prefix cache).
        items = [(s, t) for s in grow for t in s.tokens[s.blocks.slots :]]
        items += [(c, t) for _, c in beam_forks for t in c.tokens[c.blocks.slots :]]
        items += [(s, t) for s in owed for t in s.tokens[s.blocks.slots : s.num_computed // bs * bs]]
        grant: list[Seq] = []
        # No grant while a sequence waits to be admitted or swapped in: the blocks are its, and
        # with it waiting every iteration makes a Step anyway (its admission), so none is saved.
        if lazy and len(self.waiting) == len(admit) and len(self.swapped) == len(swap_in):
            spare = (
                remote.pool.available
                - self.limits.watermark
                - sum(self.prompt_blocks(s.tokens) for s in admit)
                - growth_blocks(grow, bs)
            )
            # Admitted ones too: the manager applies grants after this Step's allocations.
            candidates = [*self.running, *(s for s in admit if s.width == 1)]
            grant = policy.grants(candidates, spare, self.limits, self.grant_ahead_tokens)
        step = StepPlan(
            rollbacks=rollbacks,
            commits=[(s.seq_id, n) for s, n in commits],
            frees=frees,
            appends=[(s.seq_id, t) for s, t in items],
            allocs=[(s.seq_id, s.tokens, s.request.priority) for s in admit],
            alloc_salts=[s.request.cache_salt for s in admit],
            alloc_skip_prefix_hits=[not s.reads_prefix_cache for s in admit],
            forks=[(p.seq_id, c.seq_id) for p, c in forks],
            swap_ins=[s.seq_id for s in swap_in],
            grants=[s.seq_id for s in grant],
            early_forks=[(p.seq_id, c.seq_id) for p, c in beam_forks],
        )
        return BlockManagerPlan(step, [s for s, _ in items], swap_in, admit, forks, grant, beam_forks)

    # --- speculative decoding (docs/speculative.md) ----------------------------------
    def _propose(self) -> None:
        """Speculative decoding: while few enough sequences run (speculate.speculation_on), each
        decoding one that may verify gets its n-gram proposal appended to its tokens (``Seq.proposed``
        of them): this Step appends their slots with their token ids (when they do not fit the
        blocks it holds, or a Step goes anyway), the worker step verifies them, and
        :meth:`apply_outputs` keeps what was accepted (the rest is rolled back in the next Step).
        A proposal never takes more than one new block, and that only while the pool has room to
        spare: speculation must not cost a preemption. With the workers' draft model the worker
        proposes instead (``_ask_drafts``)."""
        cfg = self.speculative
        for s in self.running:
            s.draft_tokens = 0
        if cfg is None or not speculation_on(cfg, len(self.running)):
            return
        bs = self.limits.block_size
        if cfg.method == "draft_model":
            self._ask_drafts(cfg, bs)
            return
        spare = self.remote.pool.available - self.limits.watermark > len(self.running)
        for s in self.running:
            if not self._may_speculate(s):
                continue
            left = s.request.max_tokens - len(s.completion.token_ids)  # the pass draws one itself
            room = (s.blocks.held + spare) * bs - len(s.tokens)
            proposal = proposal_for(cfg, s.tokens, min(left - 1, room), s.proposal_bound)
            if proposal:
                s.tokens.extend(proposal)
                s.proposed = len(proposal)

    def _ask_drafts(self, cfg: SpeculativeConfig, bs: int) -> None:
        """The draft-model proposer: each sequence that may speculate asks its next pass for up to
        its bound of draft tokens, as many as its held blocks have room for past its last token
        (their KV is written there before any slot is appended, as multi-step decode's; a tail a
        fork shares is never written past its slots)."""
        for s in self.running:
            if not self._may_speculate(s) or s.blocks.tail_shared:
                continue
            left = s.request.max_tokens - len(s.completion.token_ids)
            room = s.blocks.held * bs - len(s.tokens)
            s.draft_tokens = draft_tokens_for(cfg, min(left - 1, room), s.proposal_bound)

    @staticmethod
    def _may_speculate(s: Seq) -> bool:
        """A sequence whose next step is one decode token the worker can verify proposals for: not
        under a grammar (the worker takes one mask per step, not one per proposed position, so a
        sequence under a grammar decodes plainly), nor with penalties (their history changes with
        every token), nor while forked samples wait for its logits."""
        opts = s.request.sampling
        return (
            s.status is SeqStatus.RUNNING
            and not s.proposed
            and bool(s.completion.token_ids)
            and s.num_computed == len(s.tokens) - 1
            and not s.awaiting_parent
            and not any(c.awaiting_parent for c in s.children)
            and opts.grammar is None
            and not opts.penalized
            and not s.is_beam  # (a beam's step reports candidates for its request's decision)
        )

    def _drop_proposal(self, s: Seq) -> None:
        """Take unverified proposals off a sequence's tokens (it was preempted or aborted, or was left
        out of the worker step); slots the manager holds for them are rolled back."""
        if s.proposed:
            del s.tokens[-s.proposed :]
            s.proposed = 0
            self._owe_rollback(s, len(s.tokens))

    def _owe_rollback(self, s: Seq, num_tokens: int) -> None:
        if s.blocks.slots > num_tokens:
            self.rollbacks[s] = min(num_tokens, self.rollbacks.get(s, num_tokens))

    def _take_rollbacks(self) -> list[tuple[str, int]]:
        """The rollbacks this Step sends (the running sequences'), with the remote table shortened
        to them now: the Step applies them first. A sequence requeued or finished since holds
        nothing to roll back (its Free takes everything); a swapped one waits for its swap-in."""
        for s in self.running:  # proposals a worker step did not verify (left out of it)
            if s.proposed and s.status is SeqStatus.RUNNING:
                self._drop_proposal(s)
        out = []
        for s, n in list(self.rollbacks.items()):
            if s.status is SeqStatus.SWAPPED:
                continue
            del self.rollbacks[s]
            if s.running and s.blocks.slots > n:
                self.remote.rolled_back(s, n)
                out.append((s.seq_id, n))
        return out

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

    def step_unanswered(self, plan: BlockManagerPlan) -> None:
        """The Step got no answer: what it may have created is freed by the first one that does."""
        self.remote.unanswered(plan.created)

    def apply_block_manager(self, plan: BlockManagerPlan, delta: StepDelta) -> None:
        """A Step reply: the remote table takes the block-side changes (what was freed, grown tables,
        cache ops owed to the workers); the queues follow preemptions, allocations, forks and
        swap-ins; then the grants and the appends that went through count. Beam-search forks
        first: their children grow in this very reply."""
        refused = self._apply_beam_forks(plan, delta)
        self.remote.reconcile(plan, delta)
        for err in delta.errors:
            if err.kind == "rollback":  # never below what was committed: a refusal is a bug
                raise RuntimeError(f"block manager refused to roll back {err.seq_id}: {err.message}")
        preempted = self._apply_preemptions(delta)
        errors: dict[str, dict[int, ItemError]] = collections.defaultdict(dict)
        for err in delta.errors:
            errors[err.kind][err.index] = err
        self._apply_allocations(delta, plan.admit, errors["alloc"])
        self._apply_forks(plan.forks, errors["fork"])
        self._apply_swap_ins(delta, plan.swap_in)
        self.stats.blocks_granted_ahead += sum(plan.grant[j].running for j, _ in delta.granted)
        # Nothing left to preempt for their growth: preempt them ourselves (freed in the next Step,
        # before their re-allocation there, so they may hit their own committed blocks).
        for s in self.remote.reconcile_appends(plan, delta, preempted | refused):
            self._preempt_self(s)

    def _apply_allocations(self, delta: StepDelta, admit: list[Seq], errors: dict[int, ItemError]) -> None:
        for j, seq in enumerate(admit):
            err = errors.get(j)
            if err is not None:
                if err.code == RESOURCE_EXHAUSTED:
                    continue  # no room yet: it keeps its place in the queue
                raise RuntimeError(f"block manager refused to allocate {err.seq_id}: {err.message}")
            cached = delta.alloc_cached[j]
            if cached and not seq.reads_prefix_cache:  # its prompt logprobs would miss those positions
                raise RuntimeError(
                    f"the block manager gave {seq.seq_id} prefix-cache hits it asked not to take "
                    "(a block manager that predates StepRequest.alloc_skip_prefix_hits?)"
                )
            self.waiting.remove(seq)
            groups = delta.alloc_group_tables[j] if delta.alloc_group_tables else None
            self.remote.allocated(seq, delta.alloc_tables[j], cached, groups)
            if seq.index == 0 and not seq.completion.token_ids:
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
                self._enqueue(child)
                continue
            parent.children.append(child)
            self.remote.forked(parent, child)
            child.status = SeqStatus.RUNNING
            self.seqs[child.seq_id] = child
            self.running.append(child)

    # --- beam search (beam_group.py) ----------------------------------------------------
    def _beam_forks(self) -> list[tuple[Seq, Seq]]:
        """The beam forks the next Step sends (kept until a reply applies them). A child whose
        parent left the GPU since the decision (preempted) is computed anew from its tokens as a
        sequence of its own; one whose request was aborted is dropped (it never held a block)."""
        send = []
        for parent, child in list(self.beam_forks):
            if parent.status is SeqStatus.RUNNING:
                send.append((parent, child))
                continue
            self.beam_forks.remove((parent, child))
            if parent.status is not SeqStatus.FINISHED:
                self._beam_anew(child)
        return send

    def _beam_anew(self, child: Seq) -> None:
        """A new beam that could not fork from its parent: it waits to be allocated (its prefix
        from the prefix cache where committed) and computes the rest."""
        child.blocks.released()
        child.num_computed = 0
        child.status = SeqStatus.WAITING
        self.seqs[child.seq_id] = child
        self.waiting.appendleft(child)

    def _apply_beam_forks(self, plan: BlockManagerPlan, delta: StepDelta) -> set[str]:
        """The beam forks of a Step (before its appends): a child the manager forked runs, sharing
        its parent's blocks; one it refused (e.g. a tenant's sequence quota) is computed anew, and
        its appends in the same Step failed with it. Returns the refused children's ids."""
        if not plan.beam_forks:
            return set()
        base = len(plan.forks)  # the wire's forks: the admission forks, then these
        errors = {e.index - base: e for e in delta.errors if e.kind == "fork" and e.index >= base}
        victims = {p.seq_id for p in delta.preempted}
        refused: set[str] = set()
        sent = {id(child) for _, child in plan.beam_forks}
        self.beam_forks = [(p, c) for p, c in self.beam_forks if id(c) not in sent]
        for j, (_, child) in enumerate(plan.beam_forks):
            err = errors.get(j)
            if err is not None:
                log.info("beam_fork_refused", seq_id=child.seq_id, code=err.code, message=err.message)
                refused.add(child.seq_id)
                self._beam_anew(child)
                continue
            if (
                any(
                    e.kind == "append" and e.seq_id == child.seq_id and e.code == NOT_FOUND
                    for e in delta.errors
                )
                and child.seq_id not in victims
            ):
                raise RuntimeError(
                    f"the block manager forked {child.seq_id} after its appends (a block manager "
                    "that predates StepRequest.fork_before_appends?)"
                )
            child.status = SeqStatus.RUNNING
            self.seqs[child.seq_id] = child
            self.running.append(child)
        return refused

    def _beam_step(self, group: BeamGroup) -> list[TokenEvent]:
        """Every live beam of ``group`` reported: decide the next beams and move the sequences
        (beam_group.py): pruned beams are freed in the next Step, new ones forked in it; once the
        search is over, the request's completions are its answer, streamed as tokens now."""
        rid = group.output.request_id
        for s in [s for s in group.pruned if not self.remote.owes_free(s)]:
            group.pruned.remove(s)  # freed: forgotten, so a long search keeps only its live beams
            self.seqs.pop(s.seq_id, None)
        moves = group.decide(lambda index: self.seq_id(rid, index))
        for s in moves.pruned:
            self._finish(s, "pruned")
        group.pruned += moves.pruned
        self.beam_forks += moves.forks
        if not moves.done:
            return []
        del self.beams[rid]
        events = []
        for c in group.output.completions:
            for j, (token, logprob) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
                reason = c.finish_reason if j == len(c.token_ids) - 1 else None
                top = c.top_logprobs[j] if c.top_logprobs else ()
                events.append(TokenEvent(rid, c.index, token, logprob, reason, top))
        self.stats.generated_tokens += len(events)
        return events

    def _apply_preemptions(self, delta: StepDelta) -> set[str]:
        """Follow the block manager's preemption decisions; returns the victims' ids."""
        victims: set[str] = set()
        for p in delta.preempted:
            victims.add(p.seq_id)
            seq = self.seqs.get(p.seq_id)
            if seq is not None and seq.status is SeqStatus.FINISHED:
                self.remote.preempted_finished.add(seq.seq_id)  # its Free still goes (CPU blocks)
                continue
            if seq is None or not seq.running:
                continue
            self._drop_proposal(seq)
            if p.swap:
                self.running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                self.remote.swapped_out(seq)
                self.swapped.append(seq)
                self.stats.preempted_swap += 1
            else:
                self._requeue(seq)
                self.stats.preempted_recompute += 1
            log.info("preempted", seq_id=seq.seq_id, mode="SWAP" if p.swap else "RECOMPUTE", cost_s=p.cost_s)
        return victims

    def _apply_swap_ins(self, delta: StepDelta, asked: list[Seq]) -> None:
        for k, members in enumerate(delta.swap_ins[: len(asked)]):
            tails = delta.swap_in_groups[k] if k < len(delta.swap_in_groups) else {}
            for seq_id, table in members:
                s = self.seqs.get(seq_id)
                if s is None or s.status is not SeqStatus.SWAPPED:
                    continue
                s.blocks.table = table
                s.blocks.groups = tails.get(seq_id, [])
                s.status = SeqStatus.RUNNING
                self.swapped.remove(s)
                self.running.append(s)

    def _preempt_self(self, seq: Seq) -> None:
        """Recompute it later: its Free goes into the next Step, ahead of its re-allocation."""
        self._drop_proposal(seq)
        self.remote.free_later(seq)
        self._requeue(seq)
        self.stats.preempted_recompute += 1
        log.info("preempted", seq_id=seq.seq_id, mode="RECOMPUTE", by="engine")

    def _requeue(self, seq: Seq) -> None:
        """Back to the front of the queue; everything generated so far becomes its prompt.
        A sample still waiting for its parent's prompt becomes a request of its own."""
        self._drop_proposal(seq)
        if seq.running:
            self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.blocks.released()
        seq.num_computed = 0
        seq.parent = None
        self.waiting.appendleft(seq)

    # --- faults --------------------------------------------------------------------
    def take_block_holders(self) -> tuple[list[Seq], list[str]]:
        """Every running and swapped sequence, and the ids of everything this engine may hold in
        the block manager (those, finished ones, what an unanswered Step may have created)."""
        victims = list(self.running) + list(self.swapped)
        return victims, [s.seq_id for s in victims] + self.remote.take_all_frees()

    def requeue_all(self, victims: list[Seq]) -> None:
        """Every running and swapped sequence back to the head of the queue, in order, to be
        recomputed; no cache op of the old tables may run any more, and no hint of what finished
        sequences committed holds."""
        for s in reversed(victims):  # appendleft: keep their order at the head of the queue
            self.stats.recomputed_tokens += s.num_computed
            if s.status is SeqStatus.SWAPPED:
                self.swapped.remove(s)
            self._requeue(s)
        self.remote.forget_cache()

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

    def start_prefill(self, chunks: list[tuple[Seq, int]]) -> list[PrefillItem]:
        """The chunks a prefill worker computes while the engine goes on decoding."""
        for s, _ in chunks:
            s.status = SeqStatus.PREFILLING
        return [PrefillItem(s, s.num_computed, k, s.blocks.attempt) for s, k in chunks]

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
            and it.seq.blocks.attempt == it.attempt
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
            proposed = s.proposed if s.proposed and it.start + it.tokens == len(s.tokens) else 0
            if proposed:  # a verification pass: its proposals leave the tokens, the accepted come back
                del s.tokens[-proposed:]
                s.proposed = 0
            computed = it.tokens - proposed
            output.record_prompt_logprobs(s, it.start, out.prompt_logprobs)
            s.num_computed += computed
            self.stats.computed_tokens += computed
            for c in s.children:
                if c.awaiting_parent:
                    c.num_computed = s.num_computed  # their shared prompt blocks were just written
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk: its sampled token is meaningless
            if s.is_beam:  # its step's candidates, for its request's decision (none once aborted)
                group = self.beams.get(s.request.request_id)
                top = list(zip(out.top_token_ids, out.top_logprobs, strict=True))
                if group is not None and group.report(s, top):
                    events += self._beam_step(group)
                continue
            for child, drawn in output.fork_firsts(s, out.fork_samples):
                events.append(self._accept_token(child, drawn))
            events.append(self._accept_token(s, out))
            drafted = out.num_draft_tokens  # the workers' draft model proposed (the engine asked)
            s.draft_tokens = 0
            if out.next_samples:
                events += self._accept_next(s, out.next_samples, multi_step=not (proposed or drafted))
            if proposed or drafted:
                self._verified(s, proposed or drafted, out.num_accepted_tokens, rollback=bool(proposed))
        return events

    def _verified(self, s: Seq, proposed: int, accepted: int, rollback: bool = True) -> None:
        """A verification pass is in: count it; the slots past what it computed (rejected proposals,
        and the slot of the token it drew, which holds a proposal's id) are rolled back. A draft
        model's proposals had no slots (``rollback=False``): the accepted ones are appended next."""
        st = self.stats
        st.spec_passes += 1
        st.spec_proposed += proposed
        st.spec_accepted += accepted
        st.spec_emitted += accepted + 1
        if self.speculative is not None:
            most = self.speculative.num_speculative_tokens
            s.proposal_bound = next_proposal_bound(s.proposal_bound, proposed, accepted, most)
        if s.running and rollback:
            self._owe_rollback(s, s.num_computed)

    def _accept_next(
        self, s: Seq, samples: Sequence[wpb.Sample], *, multi_step: bool = True
    ) -> list[TokenEvent]:
        """Multi-step decode: the tokens the steps after the first drew, each computed on the one
        before it. They count until one finishes the sequence (a stop string the caller matches
        aborts it later, as with single steps); what the worker computed past that is dropped with
        the sequence's blocks. A verification pass's accepted tokens come back the same way
        (``multi_step=False``): each was computed on the one before it."""
        events = []
        for drawn in samples:
            if s.status is not SeqStatus.RUNNING:
                break
            s.num_computed += 1  # the token the last step drew is in the cache now
            self.stats.computed_tokens += 1
            self.stats.multi_step_tokens += multi_step
            events.append(self._accept_token(s, drawn))
        return events

    def _accept_token(self, s: Seq, drawn: output.Drawn) -> TokenEvent:
        ev = output.accept_token(s, drawn)
        self.stats.generated_tokens += 1
        if ev.finish_reason is not None:
            self.running.remove(s)
            self.remote.finished(s)
        return ev

    def reservation(self, batch: list[tuple[Seq, int]]) -> BlockManagerPlan | None:
        """Overlap (EngineConfig.overlap_block_manager): the Step that reserves, while the workers
        compute ``batch``, the slot of the token each sequence is sampling, so the next iteration
        needs no append before its worker call (vLLM v1's async scheduling); None: nobody to reserve.

        The token is not known yet, so the append carries no token id: the block manager stops
        hashing the sequence there (no prefix-cache hits on generated text). So a sequence whose
        prompt's last chunk is in this step is left out: its last prompt blocks are committed only
        in the next Step, and a reservation now would keep them out of the prefix cache (a burst
        sharing a system prompt then got almost no hits). Sequences that finish by length, and
        parents whose samples wait for this step's logits, are left out too; one that stops on a
        stop token frees its reservation with itself. The reply is applied after the worker step
        (:meth:`apply_reservation`)."""
        seqs = [
            s
            for s, k in batch
            if s.num_computed + k == len(s.tokens)
            and not s.needs_slot
            and s.completion.token_ids
            and len(s.completion.token_ids) + 1 < s.request.max_tokens
            and not any(c.awaiting_parent for c in s.children)
            and not s.is_beam  # its next token is its request's decision, and may fork it
        ]
        if not seqs:
            return None
        return BlockManagerPlan(StepPlan(appends=[(s.seq_id, None) for s in seqs]), grow=seqs)

    def apply_reservation(self, plan: BlockManagerPlan, delta: StepDelta) -> None:
        """The reply to the Step of :meth:`reservation`, once the worker step's results are in."""
        self.stats.slots_reserved_ahead += len(plan.grow)
        self.apply_block_manager(plan, delta)
