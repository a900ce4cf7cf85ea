"""The engine's values: requests and their outputs, a sequence's state, the configuration, the
counters, and the errors the engine raises. Plain data; no gRPC, no protobuf."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv import defaults
from pagedkv.frontend.engine.beam import BeamParams, candidates_per_beam
from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.kv_capacity import blocks_for_tokens

MAX_TOP_LOGPROBS = defaults.MAX_TOP_LOGPROBS  # what a worker returns at most per position


class CacheHostLost(RuntimeError):
    """Every worker says the cache host (and so every sequence's KV) is gone (docs/reliability.md)."""


class BlockManagerUnavailable(RuntimeError):
    """The block manager stayed unreachable for longer than EngineConfig.block_manager_outage_s.

    The engine's state stays consistent: what the unanswered Step may have allocated is freed in the
    first Step that gets through, and the caller decides what happens to the requests in flight
    (`pagedkv serve` ends them with 503 + Retry-After and refuses new ones until the manager answers)."""


class ManagerLostState(Exception):
    """The block manager no longer holds this engine's sequences: it restarted without a state dir
    (this engine's lease was created anew) or the lease expired. ``seq_ids``: sequences the last Step
    may have created there anyway (they are freed with the rest before everything is re-allocated)."""

    def __init__(self, why: str, seq_ids: Sequence[str] = ()) -> None:
        super().__init__(why)
        self.seq_ids = list(seq_ids)


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    """Sampling parameters of a request (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # Also report this many most likely tokens (with logprobs) at every position: OpenAI's
    # logprobs=N / top_logprobs, vLLM's SamplingParams.logprobs. 0 = only the chosen token's.
    logprobs: int = 0
    # Logit adjustments (worker_svc/model/sampling.py): OpenAI's presence/frequency penalties
    # (-2..2) and logit_bias ((token id, -100..100) pairs), vLLM's repetition_penalty (> 0, 1 = off)
    # and min_p (0..1, 0 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Grammar-constrained decoding (frontend/serve/grammar.py Grammar): each sample's tokens follow it.
    grammar: Any = None

    @property
    def penalized(self) -> bool:
        """Whether the worker needs the sequence's token history (sent with each step only then)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Reject what a worker would refuse, before anything is allocated (the option is named)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError("logit_bias: token ids must be distinct and >= 0")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias: values must be in [-100, 100]")


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int = 16
    n: int = 1
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    # Mixed into its prompt's first block hash by the block manager: only requests with the same
    # salt share prefix-cache blocks (vLLM's cache_salt; "" = the shared space).
    cache_salt: str = ""
    # vLLM's prompt_logprobs: score every prompt token after the first (RequestOutput.prompt_logprobs)
    # with this many most likely tokens (0 = only its own logprob); None: not asked. Its prompt
    # then takes no prefix-cache hit (every position must be computed) until it is scored.
    prompt_logprobs: int | None = None
    # Beam search (vLLM's use_beam_search): the n best of n beams, best first, instead of n
    # samples, decided as transformers' generate(num_beams=n) decides (frontend/engine/beam.py);
    # the beams end at stop_token_ids. None: sampling.
    beam: BeamParams | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        if not self.request_id or "/" in self.request_id:
            raise ValueError(f"request_id must be non-empty and contain no '/': {self.request_id!r}")
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")
        if self.n < 1:
            raise ValueError(f"request {self.request_id}: n must be >= 1")
        self.sampling.validate()
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"request {self.request_id}: prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.prompt_logprobs}"
            )
        if self.seed_span_overflows():
            raise ValueError(f"request {self.request_id}: seed + n must stay below 2**63")
        if self.beam is not None:
            self._validate_beam(self.beam, vocab_size)

    def _validate_beam(self, beam: BeamParams, vocab_size: int | None) -> None:
        """Beam search ranks the model's own log-softmax: nothing may change the distribution, and
        each beam's K candidates (beam.candidates_per_beam) come from the worker's top logprobs."""
        beam.validate()
        opts = self.sampling
        if opts.penalized or opts.logit_bias or opts.grammar is not None:
            raise ValueError(
                f"request {self.request_id}: beam search scores the model's own log-softmax: "
                "penalties, logit_bias and grammars do not apply to it"
            )
        k = candidates_per_beam(self.n, len(set(self.stop_token_ids)))
        if k > MAX_TOP_LOGPROBS or (vocab_size is not None and k > vocab_size):
            raise ValueError(
                f"request {self.request_id}: beam search of width {self.n} with "
                f"{len(set(self.stop_token_ids))} stop tokens keeps {k} candidates per beam: at most "
                f"{min(MAX_TOP_LOGPROBS, vocab_size or MAX_TOP_LOGPROBS)} (the worker's top logprobs, "
                "the vocabulary)"
            )

    @property
    def step_sampling(self) -> SamplingOptions:
        """What each worker step samples with: the request's options, or for beam search its
        candidates, the top logprobs of the model's own log-softmax (greedy: the token drawn is
        not used), as many as the search keeps or the client asked to see."""
        if self.beam is None:
            return self.sampling
        k = candidates_per_beam(self.n, len(set(self.stop_token_ids)))
        return SamplingOptions(logprobs=max(k, self.sampling.logprobs))

    def seed_span_overflows(self) -> bool:
        s = self.sampling.seed
        return s is not None and s + self.n > 2**63


@dataclass(slots=True)
class TokenEvent:
    """One generated token of one sample, as it is produced."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    finish_reason: str | None  # None while running, else "stop" or "length"
    # SamplingOptions.logprobs most likely (token, logprob) of the position, most likely first.
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per token, when asked
    # Beam search: the hypothesis' score, cumulative logprob / length ** length_penalty
    # (transformers' sequences_scores); None for a sample.
    beam_score: float | None = None


@dataclass(slots=True, frozen=True)
class PromptLogprob:
    """A prompt token's score at its position (vLLM's prompt logprobs): its logprob under the
    model, its rank (the tokens at least as likely, itself included) and the most likely tokens."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # GenerationRequest.prompt_logprobs (token, logprob)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0
    # GenerationRequest.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # before it) and for those not scored yet; None when not asked.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token the request asked to score has its score (True when none was asked)."""
        scores = self.prompt_logprobs
        return scores is None or all(x is not None for x in scores[1:])


class SeqStatus(enum.Enum):
    """Where a sequence is in its life, one state at a time (frontend/engine/scheduler.py moves it).

    The facts that are not states are counted or linked, not flagged: a running sequence needs a
    slot while ``blocks.slots < len(tokens)`` (its last sampled token has no room in the block manager
    yet), and a sample forked at admission awaits its first token while it has a ``parent``."""

    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # holds blocks and is scheduled every iteration it can compute
    PREFILLING = "prefilling"  # holds blocks; its prefill chunk runs on a prefill worker right now
    SWAPPED = "swapped"  # its blocks are in the CPU pool until it is swapped back in
    FINISHED = "finished"  # done (stop, length or abort); freed in the next Step


@dataclass(slots=True)
class SeqBlocks:
    """What the block manager holds for one sequence, as this engine knows it from its Step replies
    (frontend/engine/remote_table.py keeps it in step with them). Knowing it saves round trips:
    a sequence whose tokens fit the blocks it holds computes before any Step appends their slots."""

    table: list[int] = field(default_factory=list)  # its block table
    # KV-cache groups 1..'s tables (the pool's Config.kv_groups; empty with one group), each its
    # live tail: a window group's entries before its window were released at a Commit, so the
    # tail starts at block index len(table) - len(tail).
    groups: list[list[int]] = field(default_factory=list)
    slots: int = 0  # token slots the manager holds for it (allocated + appended)
    committed: int = 0  # what the manager was told is computed (Commit)
    # The block the manager granted it ahead of need (Step grant_seq_ids): its table's next entry
    # once its tokens pass the blocks in the table, so it computes into it before any Step says so.
    ahead: int | None = None
    # Its last block may be shared with fork siblings (until an append of its own went through the
    # manager, which copies a shared tail on write): its appends cannot wait.
    tail_shared: bool = False
    # Which allocation these blocks belong to: bumped each time it is released to be recomputed (a
    # prefill chunk launched under an earlier attempt wrote into blocks it no longer holds, so its
    # results must not count even when the new attempt starts at the same token).
    attempt: int = 0

    @property
    def held(self) -> int:
        """Blocks the manager holds for it: its table and the block granted ahead."""
        return len(self.table) + (self.ahead is not None)

    @property
    def step_table(self) -> list[int]:
        """The table a worker step gets: with the block granted ahead, which the step writes into
        once the tokens pass the table (the manager makes it the next entry at that append)."""
        return self.table if self.ahead is None else [*self.table, self.ahead]

    @property
    def group_tables(self) -> list[tuple[int, list[int]]]:
        """Groups 1..'s tables as a worker step gets them: (first block index, live block ids)."""
        n = len(self.table)
        return [(n - len(t), t) for t in self.groups]

    def fits(self, num_tokens: int, block_size: int) -> bool:
        """May ``num_tokens`` tokens be computed now, before a Step? Yes once the manager holds a
        slot for each, or while they fit the blocks held (the one granted ahead too) in a private
        tail (their appends wait for a Step)."""
        return self.slots >= num_tokens or (not self.tail_shared and num_tokens <= self.held * block_size)

    def growth(self, num_tokens: int, block_size: int) -> int:
        """New blocks appends up to ``num_tokens`` tokens take: those past the blocks it holds, in
        every KV-cache group."""
        return max(0, blocks_for_tokens(num_tokens, block_size) - self.held) * (1 + len(self.groups))

    def released(self) -> None:
        """The manager holds nothing for it any more, and the next allocation is a new attempt."""
        self.table, self.ahead, self.slots, self.committed = [], None, 0, 0
        self.groups = []
        self.tail_shared = False
        self.attempt += 1


@dataclass(slots=True, eq=False)
class Seq:
    seq_id: str
    request: GenerationRequest
    output: RequestOutput
    index: int
    tokens: list[int]
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the cache
    blocks: SeqBlocks = field(default_factory=SeqBlocks)  # what the block manager holds for it
    # Sequences admitting this one starts: the request's n for its first sequence until its other
    # samples exist (forked at admission, or queued on their own when a fork is refused), else 1.
    width: int = 1
    # An n > 1 sample forked at admission shares its parent's prompt blocks; the parent's prefill
    # step draws its first token (SequenceInput.fork_sampling). None once it runs on its own.
    parent: Seq | None = None
    children: list[Seq] = field(default_factory=list)
    # The children whose first token the last worker request asked this sequence's step to draw.
    forks_sent: list[Seq] = field(default_factory=list)
    # SamplingOptions.grammar: this sample's place in it (frontend/serve/grammar.py Matcher).
    matcher: Any = None
    # Speculative decoding: how many of ``tokens``' last ones are proposals the next worker step
    # verifies (scheduler.py adds them before its Step and takes them off when the step is back).
    proposed: int = 0
    # Speculative decoding with the workers' draft model: tokens its next decode pass asks the draft
    # to propose (set by the scheduler for one iteration; their KV goes into the held blocks past
    # the slots, as multi-step decode's, so nothing is appended or rolled back for them).
    draft_tokens: int = 0
    # The most tokens its next proposal may hold (speculate.next_proposal_bound after each pass;
    # None before the first: the configured num_speculative_tokens).
    proposal_bound: int | None = None
    # A beam's own tokens so far (beam search): the request's completions are filled with the best
    # hypotheses when the search ends (frontend/engine/beam_group.py). None for a sample.
    own_completion: Completion | None = None

    @property
    def completion(self) -> Completion:
        own = self.own_completion
        return own if own is not None else self.output.completions[self.index]

    @property
    def is_beam(self) -> bool:
        """A beam of a beam search: its worker steps report candidates, decided per request."""
        return self.own_completion is not None

    @property
    def seed(self) -> int | None:
        s = self.request.sampling.seed
        return None if s is None else s + self.index

    @property
    def running(self) -> bool:
        """In the running queue (holding blocks on the GPU pool), whether or not it computes now."""
        return self.status is SeqStatus.RUNNING or self.status is SeqStatus.PREFILLING

    @property
    def needs_slot(self) -> bool:
        """Its last sampled token has no slot in the block manager yet (the next Step appends one)."""
        return self.running and self.blocks.slots < len(self.tokens)

    @property
    def block_table(self) -> list[int]:
        """Its block table (read-only: monitors show it; remote_table.py changes it)."""
        return self.blocks.table

    @property
    def reads_prefix_cache(self) -> bool:
        """May its allocation take prefix-cache hits? Not while its prompt logprobs are missing
        scores: a hit's positions would not be computed (vLLM's skip_reading_prefix_cache)."""
        return self.output.prompt_scored

    @property
    def awaiting_parent(self) -> bool:
        """A sample forked at admission whose first token the parent's prefill has not drawn yet."""
        return self.parent is not None


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    # Tokens per worker step (decode tokens + prefill chunks): bounds step latency.
    max_batch_tokens: int = 512
    timeout_s: float = 30.0
    # Cache host loss: False = raise CacheHostLost; True = wait (up to cache_recovery_timeout_s)
    # for a worker attached to a new cache host, reset the prefix cache and re-prefill everything.
    recover_lost_cache: bool = False
    cache_recovery_timeout_s: float = 120.0
    # This engine's lease on its sequences: renewed every third of it in the background; an
    # engine that stops renewing (it died) loses its sequences within this time.
    lease_ttl_s: float = 30.0
    # Reserve the next decode slots in the block manager while the workers compute (no append round
    # trip between two worker steps); generated tokens' blocks are then not prefix-cached.
    overlap_block_manager: bool = False
    # Appends that fit the blocks a sequence holds wait for the next Step that is needed anyway (a
    # new block, a copy-on-write, an admission, a free, a swap-in), carrying every deferred token
    # id: an iteration in which no block table changes makes no block-manager round trip.
    defer_appends: bool = True
    # With defer_appends: a Step made anyway also grants each running sequence whose held blocks
    # have room for fewer than this many more tokens (and that will generate past them) its next
    # block ahead, so crossing a block boundary needs no Step either; not while a request waits
    # for admission or swap-in (the block is its). None: the block size; 0: never. Costs at most
    # one block per running sequence, and only above the watermark.
    grant_ahead_tokens: int | None = None
    # Multi-step decode: a worker call of decode tokens alone runs up to this many decode steps,
    # each next one on the token the last one drew (SGLang's --num-continuous-decode-steps), while
    # no request waits for admission. Each iteration's fixed cost (block-manager plan, step
    # transport, the engine's own work) is then paid once for that many tokens, which reach the
    # caller that many at a time. 1: one step per iteration.
    decode_steps: int = defaults.DECODE_STEPS
    # How long every worker may stay unreachable (each answered UNAVAILABLE / DEADLINE_EXCEEDED) before
    # a step fails: meanwhile the step is tried again with backoff, so the requests of a stack whose
    # only worker died wait for the one its supervisor starts (frontend/engine/dispatch.py).
    worker_outage_s: float = 60.0
    # How long the block manager may stay unreachable (UNAVAILABLE / DEADLINE_EXCEEDED, retried with
    # backoff) before step() raises BlockManagerUnavailable (`pagedkv serve --block-manager-outage-s`).
    block_manager_outage_s: float = 30.0
    # The deadline of one block-manager call (its own Steps take milliseconds): a hung manager or a
    # silent link is retried (same request id) after this, within block_manager_outage_s.
    block_manager_timeout_s: float = 5.0
    # Speculative decoding (docs/speculative.md): n-gram proposals verified by the workers in one
    # pass, while few sequences run; None: off.
    speculative: SpeculativeConfig | None = None


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    worker_retries: int = 0
    cache_recoveries: int = 0
    # Round trips: block-manager Steps and worker steps (one each per iteration at most),
    # and lease renewals (on their own clock, not per iteration).
    bm_round_trips: int = 0
    worker_steps: int = 0
    lease_renewals: int = 0
    # Idle gap of the engine's synchronous worker calls (decode pipeline): time from the end of one
    # call to the start of the next, summed, and how many gaps (the control plane's share of a step).
    worker_idle_s: float = 0.0
    worker_idle_gaps: int = 0
    prefill_launches: int = 0  # async prefill chunks sent to prefill workers (disaggregated layout)
    slots_reserved_ahead: int = 0  # decode slots reserved while the workers computed (overlap)
    # Multi-step decode: worker calls that ran more than one decode step, and the tokens drawn by
    # the steps after each sequence's first (tokens that needed no iteration of their own).
    multi_step_calls: int = 0
    multi_step_tokens: int = 0
    blocks_granted_ahead: int = 0  # blocks the manager granted running sequences ahead of need
    # Admissions deferred by one iteration because another sequence was computing their prefix.
    admissions_held: int = 0
    # Faults (docs/reliability.md): block-manager calls retried after UNAVAILABLE/DEADLINE_EXCEEDED;
    # resyncs with a manager that lost this engine's sequences (restarted empty, lease expired);
    # tokens whose KV had to be computed again (resyncs and cache-host recoveries); the longest
    # time the engine waited for an unreachable block manager, from its first failed call.
    bm_retries: int = 0
    bm_resyncs: int = 0
    recomputed_tokens: int = 0
    longest_stall_s: float = 0.0
    # Speculative decoding: verification passes, proposed and accepted tokens, and the tokens the
    # passes produced (accepted + the target's own: tokens per pass = spec_emitted / spec_passes).
    spec_passes: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0
