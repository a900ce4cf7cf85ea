"""A continuous-batching engine on top of the block manager and the workers.

Each `step()` is one scheduler iteration, with one block-manager round trip
and one worker step per pipeline (EngineStats counts both; with
`overlap_block_manager`, a second, overlapped Step reserves the next slots):

1. **Block manager, one `Step`**, everything packed, in the order the manager
   applies it: *commits* (what the previous worker step computed: only now do
   those blocks become prefix-cache hits, for every frontend), *frees* (what
   finished), *appends* (a slot for every running sequence's newly sampled
   token, with its id), *allocations* (admitted requests with their prompts,
   priority, this engine's lease), *forks* (the other samples of an `n > 1`
   request share its prompt blocks), *swap-ins*. Copy-on-write ops,
   preemptions and the new block tables come back as deltas.
2. **Worker step**: decode tokens first (one per running sequence), then
   prefill chunks in arrival order within a token budget (chunked prefill: a
   long prompt never stalls decoding), with all cache ops of the iteration. A
   request admitted in this iteration's Step is prefilled in this iteration.
   Which workers run it is frontend/dispatch.py's decision: several mixed
   workers split the iteration's sequences by tokens and compute at once on the
   one shared cache; with prefill and decode workers (disjoint roles) the
   engine runs two independent pipelines: the prefill chunk is launched on the
   prefill worker and the engine goes on decoding on the decode worker without
   waiting for it; a sequence joins the decode batch at the first iteration
   after its prefill came back (and is committed in that iteration's Step).
3. Sample results are streamed as `TokenEvent`s; the samples of an `n > 1`
   request get their first token from the worker, which draws it from the
   prompt's last position with each sample's own seed
   (`SequenceInput.fork_sampling`), then decode on their own (copy-on-write
   of the shared tail block on their first append).

The block manager is the one place that knows which KV exists: a prefix hit is
a committed block, so the engine keeps no shadow of it. A request whose prefix
another of this engine's sequences is still computing waits until that part is
committed, then hits it (frontend/admission.py); requests of other engines that
arrive meanwhile compute it themselves.

Many engines may share one block manager: sequence ids carry a random
per-engine prefix, and every sequence is under this engine's lease, which a
background thread renews (KeepAlive); an engine that dies loses its sequences
within the lease TTL (`EngineConfig.lease_ttl_s`).

Every block-manager mutation carries a request id, so an unanswered one is retried (UNAVAILABLE,
DEADLINE_EXCEEDED, with backoff, within `EngineConfig.block_manager_outage_s`) and answered from the
manager's dedupe table if it was applied. A manager that came back without this engine's lease
(restarted with no state dir, or the lease expired) is resynced: every sequence is re-allocated and
its KV recomputed (docs/reliability.md, "The engine through block-manager faults").

Preempted sequences are handled as the block manager decides: recompute
victims go back to the front of the waiting queue with everything generated
so far as their prompt (prefix hits usually cover most of it); swapped ones are
swapped back in when room returns.
"""

from __future__ import annotations

import collections
import enum
import itertools
import math
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import structlog

from concurrent.futures import Future

from frontend.admission import PrefixProgress
from frontend.client import BlockManagerClient
from frontend.dispatch import CacheLostEverywhere, WorkerPool, WorkerSlot
from frontend.worker_client import WorkerClient
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb

log = structlog.get_logger("pagedkv.engine")

MAX_TOP_LOGPROBS = 20  # what a worker returns at most per position (worker_svc/model/sampling.py)

T = TypeVar("T")
# A block manager that is restarting (UNAVAILABLE) or hung (DEADLINE_EXCEEDED): retried within the
# outage budget. Every mutation carries a request id, so a retry of one that was applied is answered
# from the manager's dedupe table, never applied twice.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_MAX_BACKOFF_S = 1.0


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


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int = 16
    n: int = 1
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0

    def validate(self) -> None:
        if not self.request_id or "/" in self.request_id:
            raise ValueError(f"request_id must be non-empty and contain no '/': {self.request_id!r}")
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")
        if self.n < 1:
            raise ValueError(f"request {self.request_id}: n must be >= 1")
        self.sampling.validate()
        if self.seed_span_overflows():
            raise ValueError(f"request {self.request_id}: seed + n must stay below 2**63")

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


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: list[int]
    completions: list[Completion]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class _Seq:
    seq_id: str
    request: GenerationRequest
    output: RequestOutput
    index: int
    tokens: list[int]
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    num_committed: int = 0  # what the block manager was told is computed (Commit)
    needs_slot: bool = False  # last token sampled but not yet reserved in the block manager
    forked: bool = False  # n > 1 samples already forked from this sequence
    # An n > 1 sample forked at admission: shares the parent's prompt blocks and
    # waits for the parent's prefill, whose worker step draws its first token.
    awaiting_parent: bool = False
    children: list[_Seq] = field(default_factory=list)
    # The children whose first token the last worker request asked this sequence's step to draw.
    forks_sent: list[_Seq] = field(default_factory=list)
    in_flight: bool = False  # its prefill chunk is running on a prefill worker right now

    @property
    def completion(self) -> Completion:
        return self.output.completions[self.index]

    @property
    def seed(self) -> int | None:
        s = self.request.sampling.seed
        return None if s is None else s + self.index


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
    # How long the block manager may stay unreachable (UNAVAILABLE / DEADLINE_EXCEEDED, retried with
    # backoff) before step() raises BlockManagerUnavailable (`pagedkv serve --block-manager-outage-s`).
    block_manager_outage_s: float = 30.0


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

    @property
    def bm_round_trips_per_step(self) -> float:
        return self.bm_round_trips / self.steps if self.steps else 0.0

    @property
    def worker_steps_per_step(self) -> float:
        return self.worker_steps / self.steps if self.steps else 0.0


def _renew_lease(ref: weakref.ref[Engine], stop: threading.Event, interval_s: float) -> None:
    """Renew the engine's lease until it is closed or garbage-collected (holds no strong ref)."""
    while not stop.wait(interval_s):
        engine = ref()
        if engine is None:
            return
        try:
            engine._keep_alive(timeout_s=min(engine.config.timeout_s, interval_s))
        except grpc.RpcError as e:
            log.warning("lease_renewal_failed", lease_id=engine.lease_id, code=e.code().name)
        except ValueError:  # the client's channel was closed under a live engine: nothing to renew on
            return
        del engine


class Engine:
    def __init__(
        self,
        block_manager: BlockManagerClient,
        workers: Sequence[WorkerClient],
        config: EngineConfig | None = None,
    ) -> None:
        if not workers:
            raise ValueError("the engine needs at least one worker")
        self.bm = block_manager
        self.workers = list(workers)
        self.config = config or EngineConfig()
        if not self.config.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.config.lease_ttl_s}")
        geometry = self.bm.get_config(timeout_s=self.config.timeout_s)
        self.block_size = geometry.block_size
        self.num_gpu_blocks = geometry.num_gpu_blocks
        self._watermark = geometry.watermark_blocks
        self._prefix_caching = geometry.enable_prefix_caching
        infos = [self._info_or_none(w) for w in self.workers]
        info = next((i for i in infos if i is not None), None)
        if info is None:
            info = self.workers[0].get_info(timeout_s=self.config.timeout_s)  # raises the real error
        self.pool = WorkerPool.from_clients(self.workers, infos, timeout_s=self.config.timeout_s * 4)
        if info.geometry.block_size and info.geometry.block_size != self.block_size:
            raise ValueError(
                f"worker block_size {info.geometry.block_size} != block manager block_size {self.block_size}"
            )
        self.vocab_size = info.vocab_size
        self._cache_instance = info.cache_instance_id  # steps name it: a worker on another cache refuses
        # Sequence ids are unique per engine instance, so any number of engines share one manager.
        self.instance_id = uuid.uuid4().hex[:12]
        self.lease_id = f"engine-{self.instance_id}"
        self.stats = EngineStats()
        self.outputs: dict[str, RequestOutput] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._swapped: collections.deque[_Seq] = collections.deque()
        self._seqs: dict[str, _Seq] = {}
        self._to_free: list[str] = []
        self._pending_ops = pb.CacheOps()
        self._available = self.num_gpu_blocks  # from the last Step reply, for admission
        # What recently finished sequences committed: a hint for admission (frontend/admission.py),
        # each with the manager's prefix_cache_drops when it finished; trusted only while that
        # counter has not moved (nothing left the cache since, so their blocks are still cached).
        self._finished_prefixes: collections.deque[tuple[list[int], int, int]] = collections.deque(
            maxlen=self.config.max_num_seqs)
        self._prefix_cache_drops = 0  # from the last Step reply
        self._step_ids = itertools.count()
        # The prefill pipeline's chunk in flight: its future and (sequence, num_computed at launch, tokens).
        self._prefill: tuple[Future[wpb.WorkerStepResponse], list[tuple[_Seq, int, int]]] | None = None
        self._last_call_end: float | None = None
        self._bm_ids = itertools.count()  # request ids of this engine's block-manager mutations
        # Set when a KeepAlive created this engine's lease anew: the manager lost its sequences.
        self._lease_lost = threading.Event()
        # Sequences a Step that got no answer may have created (freed in the next Step that does).
        self._maybe_held: list[str] = []
        self._keep_alive(timeout_s=self.config.timeout_s, first=True)
        self._stop_renewal = threading.Event()
        self._renewer = threading.Thread(
            target=_renew_lease, args=(weakref.ref(self), self._stop_renewal, self.config.lease_ttl_s / 3),
            name=f"engine-lease-{self.instance_id}", daemon=True,
        )
        self._renewer.start()
        weakref.finalize(self, self._stop_renewal.set)

    def _info_or_none(self, w: WorkerClient) -> wpb.WorkerInfo | None:
        try:
            return w.get_info(timeout_s=self.config.timeout_s)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            log.warning("worker_unavailable_at_start", worker=w.target, code=e.code().name)
            return None

    # --- lease ------------------------------------------------------------------
    def _keep_alive(self, timeout_s: float, first: bool = False) -> None:
        """Renew the lease (from the renewal thread or the engine's). A renewal that *created* the
        lease means the manager forgot it, and with it this engine's sequences: the next step resyncs."""
        resp = self.bm.keep_alive(self.lease_id, ttl_ms=round(self.config.lease_ttl_s * 1000),
                                  request_id=self._bm_request_id("lease"), timeout_s=timeout_s)
        self.stats.lease_renewals += 1
        if resp.created and not first:
            # (A renewal racing a resync may set this once more: one more resync, still correct.)
            self._lease_lost.set()
            log.warning("block_manager_lost_lease", lease_id=self.lease_id, action="resync")

    def _bm_request_id(self, kind: str) -> str:
        return f"{self.lease_id}-{kind}-{next(self._bm_ids)}"

    def block_manager_reachable(self, timeout_s: float = 2.0) -> bool:
        """One lease renewal: does the block manager answer now? (After BlockManagerUnavailable.)"""
        try:
            self._keep_alive(timeout_s=timeout_s)
        except grpc.RpcError:
            return False
        return True

    def _bm_call(self, fn: Callable[[float], T], *, needs_state: bool = True) -> T:
        """Run one block-manager call, ``fn(timeout_s)``, riding out an outage: UNAVAILABLE and
        DEADLINE_EXCEEDED are retried with capped exponential backoff (full jitter) until
        ``block_manager_outage_s`` has passed since the first failure, then BlockManagerUnavailable.
        Safe because every mutation carries a request id. Before each retry the lease is renewed:
        a manager that came back without this engine's state (``needs_state``) raises
        ManagerLostState instead of being sent a Step about sequences it never heard of."""
        budget = self.config.block_manager_outage_s
        outage_start: float | None = None
        attempt = 0
        while True:
            now = time.monotonic()
            left = budget if outage_start is None else budget - (now - outage_start)
            timeout_s = max(min(self.config.timeout_s, left), 0.5)
            began = now
            try:
                if outage_start is not None:
                    self._keep_alive(timeout_s=timeout_s)
                if needs_state and self._lease_lost.is_set():
                    raise ManagerLostState("the block manager lost this engine's lease and sequences")
                result = fn(timeout_s)
            except ManagerLostState:
                if outage_start is not None:
                    self._note_stall(outage_start, attempt)
                raise
            except grpc.RpcError as e:
                if e.code() not in _TRANSIENT:
                    raise
                now = time.monotonic()
                if outage_start is None:
                    outage_start = began  # a hung manager's first unanswered call counts
                    log.warning("block_manager_unreachable", code=e.code().name, budget_s=budget)
                waited = now - outage_start
                if waited >= budget:
                    self.stats.longest_stall_s = max(self.stats.longest_stall_s, waited)
                    raise BlockManagerUnavailable(
                        f"the block manager was unreachable for {waited:.1f} s (block_manager_outage_s={budget:g}): "
                        f"{e.code().name} {e.details()}") from e
                attempt += 1
                self.stats.bm_retries += 1
                cap = min(0.05 * 2 ** (attempt - 1), _MAX_BACKOFF_S)
                time.sleep(min(random.uniform(cap / 2, cap), max(budget - waited, 0.0)))
                continue
            if outage_start is not None:
                self._note_stall(outage_start, attempt)
            return result

    def _note_stall(self, outage_start: float, retries: int) -> None:
        stall = time.monotonic() - outage_start
        self.stats.longest_stall_s = max(self.stats.longest_stall_s, stall)
        log.warning("block_manager_reachable", stall_s=round(stall, 3), retries=retries)

    def _bm_step(self, req: pb.StepRequest, *, needs_state: bool = True) -> pb.StepResponse:
        """A Step with a request id (so it may be retried), through the outage budget."""
        if not req.request_id:
            req.request_id = self._bm_request_id("step")
        resp = self._bm_call(lambda t: self.bm.step(req, timeout_s=t), needs_state=needs_state)
        self.stats.bm_round_trips += 1
        return resp

    def close(self) -> None:
        """Wait for a prefill in flight, stop renewing the lease and free every sequence this engine
        holds (one Step), stop the dispatch threads (the clients stay the caller's)."""
        if self._prefill is not None:
            self._prefill[0].exception()
            for s, _, _ in self._prefill[1]:
                s.in_flight = False
            self._prefill = None
        self.pool.close()
        self._stop_renewal.set()
        held = [s.seq_id for s in self._running] + [s.seq_id for s in self._swapped] + self._to_free
        self._running, self._to_free = [], []
        self._swapped.clear()
        held += self._maybe_held
        self._maybe_held = []
        if held:
            self.bm.step(pb.StepRequest(free_seq_ids=held, request_id=self._bm_request_id("close")),
                         timeout_s=self.config.timeout_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- public API -------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> RequestOutput:
        request.validate()
        if request.request_id in self.outputs:
            raise ValueError(f"request {request.request_id!r} was already added")
        if max(request.prompt) >= self.vocab_size or min(request.prompt) < 0:
            raise ValueError(f"request {request.request_id}: token ids must be in [0, {self.vocab_size})")
        if request.n > self.config.max_num_seqs:
            raise ValueError(f"request {request.request_id}: n={request.n} samples can never run together "
                             f"(max_num_seqs={self.config.max_num_seqs})")
        total = len(request.prompt) + request.max_tokens
        if -(-total // self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id}: {total} tokens can never fit in {self.num_gpu_blocks} blocks"
            )
        # The block manager admits a prompt only above its watermark; a prompt that needs more than
        # that would wait forever, so refuse it here rather than fail the iteration later.
        if self._prompt_blocks(request.prompt) > self.num_gpu_blocks - self._watermark:
            raise ValueError(
                f"request {request.request_id}: its {len(request.prompt)}-token prompt can never be admitted "
                f"(the pool has {self.num_gpu_blocks} blocks, {self._watermark} held back by the watermark)"
            )
        out = RequestOutput(request.request_id, list(request.prompt),
                            [Completion(index=i) for i in range(request.n)])
        self.outputs[request.request_id] = out
        seq = _Seq(self._seq_id(request.request_id, 0), request, out, 0, list(request.prompt))
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        self.stats.prompt_tokens += len(request.prompt)
        return out

    def _prompt_blocks(self, tokens: Sequence[int]) -> int:
        return -(-len(tokens) // self.block_size)

    def _seq_id(self, request_id: str, index: int) -> str:
        return f"{self.instance_id}:{request_id}/{index}"

    def running_sequences(self) -> list[_Seq]:
        """Sequences holding blocks right now: running, plus finished ones whose Free is
        batched into the next step (read-only view for monitoring)."""
        return self._running + [self._seqs[s] for s in self._to_free]

    def num_requests(self) -> tuple[int, int]:
        """(waiting, running) requests, vLLM's meaning: a request is running while any of its
        samples holds blocks (running or swapped), waiting while it is only queued."""
        running = {s.request.request_id for s in self._running}
        running.update(s.request.request_id for s in self._swapped)
        waiting = {s.request.request_id for s in self._waiting} - running
        return len(waiting), len(running)

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort") -> bool:
        """Finish a request (or one of its samples) now: a client went away, or a stop string
        matched. Its sequences stop being scheduled and their blocks are freed in the next step's
        block-manager round trip (a waiting sequence holds none). Returns False when there was
        nothing left to finish. Call from the thread that steps the engine."""
        found = False
        for seq in [s for s in self._seqs.values() if s.request.request_id == request_id]:
            if index is not None and seq.index != index:
                continue
            if seq.status is SeqStatus.FINISHED:
                continue
            found = True
            if seq.status is SeqStatus.WAITING:
                self._waiting.remove(seq)
            else:
                if seq.status is SeqStatus.RUNNING:
                    self._running.remove(seq)
                else:
                    self._swapped.remove(seq)
                self._to_free.append(seq.seq_id)
            seq.status = SeqStatus.FINISHED
            seq.completion.finish_reason = reason
        out = self.outputs.get(request_id)
        if out is not None and index is None:
            for c in out.completions:  # samples not forked yet never will be
                if c.finish_reason is None:
                    c.finish_reason = reason
        return found

    def release_request(self, request_id: str) -> bool:
        """Forget a finished request's bookkeeping once its blocks were freed, so a long-running
        server does not grow. Returns False (and keeps everything) while any of its sequences is
        still unfinished or waits for its Free in the next step."""
        seqs = [s for s in self._seqs.values() if s.request.request_id == request_id]
        pending = set(self._to_free)
        if any(s.status is not SeqStatus.FINISHED or s.seq_id in pending for s in seqs):
            return False
        for s in seqs:
            del self._seqs[s.seq_id]
        self.outputs.pop(request_id, None)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._swapped or self._to_free)

    def generate(self, requests: Iterable[GenerationRequest], max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Run requests to completion; outputs in the order given."""
        outs = [self.add_request(r) for r in requests]
        for _ in self.stream(max_steps):
            pass
        return outs

    def stream(self, max_steps: int = 1_000_000) -> Iterator[TokenEvent]:
        """Step until every added request finished, yielding tokens as they come."""
        for _ in range(max_steps):
            if not self.has_work():
                return
            yield from self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    # --- one iteration -------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        self.stats.steps += 1
        try:
            if self._lease_lost.is_set():
                raise ManagerLostState("the block manager lost this engine's lease and sequences")
            return self._step()
        except ManagerLostState as e:
            self._resync(e)
            return []
        except CacheHostLost:
            if not self.config.recover_lost_cache:
                self._forget_lost_cache()
                raise
            self._recover_lost_cache()
            return []
        finally:
            self.stats.worker_retries = self.pool.stats.retries

    def _step(self) -> list[TokenEvent]:
        disaggregated = self.pool.disaggregated()
        # A prefill that came back is committed in this Step and joins this iteration's decode batch.
        events = self._harvest_prefill(wait=not disaggregated)
        ops = self._pending_ops
        self._pending_ops = pb.CacheOps()
        try:
            self._block_manager_step(ops)
        except BlockManagerUnavailable:
            self._pending_ops = ops  # still owed to the workers
            raise
        if self._prefill is not None and any(s.status is not SeqStatus.RUNNING for s, _, _ in self._prefill[1]):
            # A sequence being prefilled was preempted: its blocks may be reused or swapped out by
            # this iteration's steps, so its writes must be over first.
            events += self._harvest_prefill(wait=True)
        # Data parallel: max_batch_tokens bounds each worker's step, so N workers take N times as much.
        share = 1 if disaggregated else len(self.pool.workers())
        decode, prefill = self._schedule(separate_budgets=disaggregated, num_workers=share)
        if disaggregated:
            return events + self._step_disaggregated(decode, prefill, ops)
        batch = decode + prefill
        if not batch:
            self._idle(ops)
            return events
        return events + self._run_worker(batch, ops, self.pool.workers())

    def _idle(self, ops: pb.CacheOps) -> None:
        """Nothing to compute this iteration."""
        self._last_call_end = None
        if self._pending_ops_nonempty(ops):
            self._pending_ops = ops  # carry the ops to the next step
        elif (self._waiting and not self._running and not self._swapped and not self._to_free
              and self._prefill is None):
            head = self._waiting[0]
            need = self._prompt_blocks(head.tokens)  # samples fork from the prompt and share it
            if need > self.num_gpu_blocks - self._watermark:
                raise RuntimeError(
                    f"request {head.request.request_id} cannot be admitted: it needs {need} blocks and "
                    f"the pool has {self.num_gpu_blocks} ({self._watermark} held back by the watermark)"
                )
            # Other frontends hold the room it needs: wait for them, without hammering the manager.
            time.sleep(0.01)

    def _step_disaggregated(
        self, decode: list[tuple[_Seq, int]], prefill: list[tuple[_Seq, int]], ops: pb.CacheOps
    ) -> list[TokenEvent]:
        """Decode on the decode workers now; prefill on the prefill workers without waiting for it.

        Cache ops run before a new prefill is launched (a swap-out must read its blocks before a
        newly admitted prompt may overwrite them), so a launch waits for an ops-carrying decode call."""
        launch = bool(prefill) and self._prefill is None
        has_ops = self._pending_ops_nonempty(ops)
        events: list[TokenEvent] = []
        if decode:
            if launch and not has_ops:
                self._launch_prefill(prefill)
            events += self._run_worker(decode, ops, self.pool.decode_workers())
            if launch and has_ops:
                self._launch_prefill(prefill)
            return events
        if has_ops:
            self._run_worker([], ops, self.pool.decode_workers())
        if launch:
            self._launch_prefill(prefill)
        if self._prefill is not None:
            return events + self._harvest_prefill(wait=True)  # nothing to decode: wait for the prompt, no spinning
        self._idle(pb.CacheOps())
        return events

    def _forget_lost_cache(self) -> None:
        """Before CacheHostLost reaches the caller: the committed blocks name KV that died, so
        drop them from the shared prefix cache (or a later frontend would hit garbage), and free
        this engine's sequences. Best effort: the caller gets CacheHostLost either way."""
        try:
            self.close()
            self.bm.reset_prefix_cache(request_id=f"reset-{uuid.uuid4().hex}", timeout_s=self.config.timeout_s)
        except grpc.RpcError as e:
            log.warning("prefix_cache_reset_failed", code=e.code().name, details=e.details())

    @staticmethod
    def _pending_ops_nonempty(ops: pb.CacheOps) -> bool:
        return bool(len(ops.copies) or len(ops.swap_out) or len(ops.swap_in))

    def _commits(self) -> tuple[list[str], list[int]]:
        """Sequences whose computed KV grew past a block boundary since their last commit
        (only full blocks enter the prefix cache), finished ones included (commits apply
        before frees)."""
        bs = self.block_size
        ids, counts = [], []
        for s in itertools.chain(self._running, (self._seqs[x] for x in self._to_free)):
            if s.num_computed // bs > s.num_committed // bs:
                ids.append(s.seq_id)
                counts.append(s.num_computed)
                s.num_committed = s.num_computed
        return ids, counts

    def _admissions(self, grow: list[_Seq], swap_in: list[_Seq]) -> list[_Seq]:
        """Waiting sequences to allocate in this Step: FIFO within max_num_seqs and the blocks
        the last reply said are available (without hits; the head is always tried)."""
        room = self.config.max_num_seqs - len(self._running) - len(swap_in)
        bs = self.block_size
        budget = self._available - self._watermark - sum(1 for s in grow if (len(s.tokens) - 1) % bs == 0)
        out: list[_Seq] = []
        progress: PrefixProgress | None = None
        for seq in self._waiting:
            width = seq.request.n if seq.index == 0 and not seq.forked else 1
            need = -(-len(seq.tokens) // bs)
            if width > room or (out and need > budget):
                break
            if self._prefix_caching:
                if progress is None:
                    progress = PrefixProgress(bs)
                    for s in itertools.chain(self._running, (self._seqs[x] for x in self._to_free)):
                        progress.add(s.tokens, s.num_computed)
                    # A hint holds while the counter has not moved since it was recorded.
                    if self._finished_prefixes and not self._running:
                        self._refresh_prefix_cache_drops()
                    for tokens, computed, drops in self._finished_prefixes:
                        if drops == self._prefix_cache_drops:
                            progress.add(tokens, computed)
                if progress.should_hold(seq.tokens):
                    self.stats.admissions_held += 1
                    continue
                progress.add(seq.tokens, 0)  # its hits are unknown until the reply
            out.append(seq)
            room -= width
            budget -= need
        return out

    def _refresh_prefix_cache_drops(self) -> None:
        """An idle engine's last Step reply may be old: another frontend or a ResetPrefixCache
        may have dropped cached blocks since. One empty Step reads the counter again before the
        finished sequences' hints decide an admission (an RPC only when idle with hints)."""
        resp = self._bm_step(pb.StepRequest())
        self._available = resp.num_available_blocks
        self._prefix_cache_drops = resp.prefix_cache_drops

    def _block_manager_step(self, ops: pb.CacheOps, *, full: bool = True) -> None:
        """The iteration's one round trip: commits, frees, appends, allocations, forks, swap-ins.
        `full=False` (flush): commits and frees only."""
        grow = [s for s in self._running if s.needs_slot] if full else []
        room = self.config.max_num_seqs - len(self._running)
        swap_in = list(itertools.islice(self._swapped, max(0, room))) if full else []
        admit = self._admissions(grow, swap_in) if full else []
        commit_ids, commit_counts = self._commits()
        frees = self._to_free + self._maybe_held
        if not (grow or frees or swap_in or admit or commit_ids):
            return
        forks: list[tuple[_Seq, _Seq]] = []
        for seq in admit:
            if seq.index == 0 and seq.request.n > 1 and not seq.forked:
                for i in range(1, seq.request.n):
                    child = _Seq(self._seq_id(seq.request.request_id, i), seq.request, seq.output, i,
                                 list(seq.tokens), forked=True, awaiting_parent=True)
                    forks.append((seq, child))
        alloc_tokens: list[int] = []
        for seq in admit:
            alloc_tokens.extend(seq.tokens)
        req = pb.StepRequest(
            commit_seq_ids=commit_ids,
            commit_num_computed_tokens=commit_counts,
            free_seq_ids=frees,
            append_seq_ids=[s.seq_id for s in grow],
            append_token_ids=[s.tokens[-1] for s in grow],
            alloc_seq_ids=[s.seq_id for s in admit],
            alloc_num_tokens=[len(s.tokens) for s in admit],
            alloc_token_ids=alloc_tokens,
            alloc_priorities=[s.request.priority for s in admit] if any(s.request.priority for s in admit) else [],
            alloc_lease_ids=[self.lease_id] * len(admit),
            fork_parent_seq_ids=[p.seq_id for p, _ in forks],
            fork_child_seq_ids=[c.seq_id for _, c in forks],
            swap_in_seq_ids=[s.seq_id for s in swap_in],
        )
        created = [s.seq_id for s in admit] + [c.seq_id for _, c in forks]
        try:
            resp = self._bm_step(req)
        except BlockManagerUnavailable:
            self._maybe_held.extend(created)  # the unanswered Step may have allocated them
            raise
        except ManagerLostState as e:
            e.seq_ids.extend(created)
            raise
        self._to_free = []
        self._maybe_held = []
        lost = self._unknown_sequences(resp)
        if lost:
            raise ManagerLostState(f"the block manager does not know {len(lost)} of this engine's sequences "
                                   f"(e.g. {lost[0]}): it restarted without its state, or the lease expired", created)
        self._apply_bm_step(resp, grow, swap_in, ops, admit, forks)

    def _reserve_next_slots(self, batch: list[tuple[_Seq, int]]) -> tuple[list[_Seq], pb.StepResponse | None]:
        """Overlap (EngineConfig.overlap_block_manager): while the worker computes this iteration,
        reserve the slot of the token it is sampling for every sequence that will go on, so the next
        iteration needs no append before its worker call (vLLM v1's async scheduling).

        The token is not known yet, so the append carries no token id: the block manager stops
        hashing the sequence there (no prefix-cache hits on generated text). So a sequence whose
        prompt's last chunk is in this step is left out: its last prompt blocks are committed only
        in the next Step, and a reservation now would keep them out of the prefix cache (a burst
        sharing a system prompt then got almost no hits). Sequences that finish by length, and
        parents whose samples wait for this step's logits, are left out too; one that stops on a
        stop token frees its reservation with itself."""
        early = [s for s, k in batch
                 if s.num_computed + k == len(s.tokens) and not s.needs_slot
                 and s.completion.token_ids
                 and len(s.completion.token_ids) + 1 < s.request.max_tokens
                 and not any(c.awaiting_parent for c in s.children)]
        if not early:
            return [], None
        resp = self._bm_step(pb.StepRequest(append_seq_ids=[s.seq_id for s in early]))
        if self._unknown_sequences(resp):
            raise ManagerLostState("the block manager does not know this engine's sequences")
        self.stats.slots_reserved_ahead += len(early)
        return early, resp

    @staticmethod
    def _unknown_sequences(resp: pb.StepResponse) -> list[str]:
        """Sequences this engine holds that the manager answered NOT_FOUND for (commits, appends,
        swap-ins; not a victim preempted in this very Step): it no longer has the engine's state."""
        victims = {p.seq_id for p in resp.preempted}
        kinds = (pb.StepItemError.COMMIT, pb.StepItemError.PACKED_APPEND, pb.StepItemError.SWAP_IN)
        return [e.seq_id for e in resp.errors
                if e.kind in kinds and e.code == grpc.StatusCode.NOT_FOUND.value[0] and e.seq_id not in victims]

    def _resync(self, lost: ManagerLostState) -> None:
        """The block manager lost this engine's sequences: free whatever it may still hold of them
        (a Step that reached the new manager may have allocated some), renew the lease, and
        recompute every running and swapped sequence from its prompt + generated tokens (the
        recompute-preemption path: they are re-allocated in the next Step, with prefix-cache hits
        where the manager still has committed blocks). Greedy outputs stay identical."""
        self._drop_prefill_in_flight()
        victims = list(self._running) + list(self._swapped)
        frees = [s.seq_id for s in victims] + self._to_free + self._maybe_held + lost.seq_ids
        self._to_free, self._maybe_held = [], []
        self._lease_lost.clear()
        try:
            # Renew first (creating the lease is expected here), then free what the manager may hold.
            self._bm_call(lambda t: self._keep_alive(timeout_s=t, first=True), needs_state=False)
            resp = self._bm_step(pb.StepRequest(free_seq_ids=frees), needs_state=False)
        except BlockManagerUnavailable:
            self._maybe_held = frees  # freed by the first Step that gets through
            self._lease_lost.set()  # and the resync starts over then
            raise
        self._available = resp.num_available_blocks
        self._prefix_cache_drops = resp.prefix_cache_drops
        self._finished_prefixes.clear()
        self._requeue_all(victims)
        self.stats.bm_resyncs += 1
        log.warning("block_manager_resync", reason=str(lost), requeued=len(victims), freed=len(frees),
                    action="re-allocating and recomputing")

    def _drop_prefill_in_flight(self) -> None:
        """Wait for a prefill chunk in flight and drop its results (its sequences are requeued)."""
        if self._prefill is not None:
            self._prefill[0].exception()
            for s, _, _ in self._prefill[1]:
                s.in_flight = False
            self._prefill = None
        self._last_call_end = None

    def _requeue_all(self, victims: list[_Seq]) -> None:
        """Every running and swapped sequence back to the head of the queue, in order, to be
        recomputed; no cache op of the old tables may run any more."""
        for s in reversed(victims):  # appendleft: keep their order at the head of the queue
            self.stats.recomputed_tokens += s.num_computed
            if s.status is SeqStatus.SWAPPED:
                self._swapped.remove(s)
            self._requeue(s)
        self._pending_ops = pb.CacheOps()

    def _apply_bm_step(
        self, resp: pb.StepResponse, grow: list[_Seq], swap_in: list[_Seq], ops: pb.CacheOps,
        admit: list[_Seq] | None = None, forks: list[tuple[_Seq, _Seq]] | None = None,
    ) -> None:
        """Block tables, cache ops, preemptions, allocations, forks and swap-ins of one Step reply."""
        self._available = resp.num_available_blocks
        self._prefix_cache_drops = resp.prefix_cache_drops
        replaced = set(resp.packed_replaced_index)
        seen_replace: set[int] = set()
        for i, block in zip(resp.packed_new_block_index, resp.packed_new_block_ids):
            seq = grow[i]
            if i in replaced and i not in seen_replace:
                seen_replace.add(i)
                seq.block_table[-1] = block
            else:
                seq.block_table.append(block)
        ops.copies.extend(resp.ops.copies)
        ops.swap_out.extend(resp.ops.swap_out)
        ops.swap_in.extend(resp.ops.swap_in)
        preempted = self._apply_preemptions(resp.preempted)
        errors = collections.defaultdict(dict)
        for err in resp.errors:
            errors[err.kind][err.index] = err
        self._apply_allocations(resp, admit or [], errors[pb.StepItemError.ALLOCATE])
        self._apply_forks(forks or [], errors[pb.StepItemError.FORK])
        self._apply_swap_ins(resp.swap_ins, swap_in)
        failed: set[int] = set()
        for kind, items in errors.items():
            for err in items.values():
                if kind in (pb.StepItemError.ALLOCATE, pb.StepItemError.FORK, pb.StepItemError.SWAP_IN):
                    continue  # handled above (a swap-in without room stays swapped)
                if err.seq_id in preempted:
                    failed.add(err.index)
                    continue  # its own later item: expected after its preemption
                if kind != pb.StepItemError.PACKED_APPEND:
                    log.warning("step_item_error", kind=pb.StepItemError.Kind.Name(kind), seq_id=err.seq_id,
                                message=err.message)
                    continue
                failed.add(err.index)
                if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                    # Nothing left to preempt for it: preempt it ourselves (freed in the next Step,
                    # before its re-allocation there, so it may hit its own committed blocks).
                    self._preempt_self(grow[err.index])
                else:
                    raise RuntimeError(f"block manager refused to grow {err.seq_id}: {err.message}")
        for i, s in enumerate(grow):
            if i not in failed and s.status is SeqStatus.RUNNING:
                s.needs_slot = False

    def _apply_allocations(self, resp: pb.StepResponse, admit: list[_Seq], errors: dict[int, pb.StepItemError]) -> None:
        tables: list[list[int]] = [[] for _ in admit]
        for i, block in zip(resp.packed_alloc_block_index, resp.packed_alloc_block_ids):
            tables[i].append(block)
        for j, seq in enumerate(admit):
            err = errors.get(j)
            if err is not None:
                if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                    continue  # no room yet: it keeps its place in the queue
                raise RuntimeError(f"block manager refused to allocate {err.seq_id}: {err.message}")
            self._waiting.remove(seq)
            seq.block_table = tables[j]
            cached = resp.alloc_num_cached_tokens[j]
            seq.num_computed = seq.num_committed = cached
            if seq.index == 0 and not seq.output.completions[0].token_ids:
                seq.output.num_cached_tokens = cached
            self.stats.prefix_hit_tokens += cached
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)

    def _apply_forks(self, forks: list[tuple[_Seq, _Seq]], errors: dict[int, pb.StepItemError]) -> None:
        for j, (parent, child) in enumerate(forks):
            err = errors.get(j)
            if err is not None and parent.status is not SeqStatus.RUNNING:
                continue  # the parent was not admitted: it forks again when it is
            parent.forked = True
            if err is not None:
                # E.g. a tenant's sequence quota: this sample becomes a request of its own, later.
                log.info("fork_refused", seq_id=child.seq_id, code=err.code, message=err.message)
                child.awaiting_parent = False
                self._seqs[child.seq_id] = child
                self._waiting.append(child)
                continue
            parent.children.append(child)
            child.block_table = list(parent.block_table)
            child.num_computed = child.num_committed = parent.num_computed
            child.status = SeqStatus.RUNNING
            self._seqs[child.seq_id] = child
            self._running.append(child)

    def _apply_preemptions(self, preemptions: Iterable[pb.Preemption]) -> set[str]:
        """Follow the block manager's preemption decisions; returns the victims' ids."""
        victims: set[str] = set()
        for p in preemptions:
            victims.add(p.seq_id)
            seq = self._seqs.get(p.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            if p.mode == pb.Preemption.SWAP:
                self._running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                seq.block_table = []
                self._swapped.append(seq)
                self.stats.preempted_swap += 1
            else:
                self._requeue(seq)
                self.stats.preempted_recompute += 1
            log.info("preempted", seq_id=seq.seq_id, mode=pb.Preemption.Mode.Name(p.mode), cost_s=p.cost_s)
        return victims

    def _apply_swap_ins(self, results: Sequence[pb.SwapInResponse], asked: list[_Seq]) -> None:
        for seq, res in zip(asked, results):
            for member in res.sequences:
                s = self._seqs.get(member.seq_id)
                if s is None or s.status is not SeqStatus.SWAPPED:
                    continue
                s.block_table = list(member.block_ids)
                s.status = SeqStatus.RUNNING
                self._swapped.remove(s)
                self._running.append(s)

    def _preempt_self(self, seq: _Seq) -> None:
        """Recompute it later: its Free goes into the next Step, ahead of its re-allocation."""
        self._to_free.append(seq.seq_id)
        self._requeue(seq)
        self.stats.preempted_recompute += 1
        log.info("preempted", seq_id=seq.seq_id, mode="RECOMPUTE", by="engine")

    def _requeue(self, seq: _Seq) -> None:
        """Back to the front of the queue; everything generated so far becomes its prompt.
        A sample still waiting for its parent's prompt becomes a request of its own."""
        if seq in self._running:
            self._running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.block_table = []
        seq.num_computed = seq.num_committed = 0
        seq.needs_slot = False
        seq.awaiting_parent = False
        self._waiting.appendleft(seq)

    def _schedule(
        self, separate_budgets: bool = False, num_workers: int = 1
    ) -> tuple[list[tuple[_Seq, int]], list[tuple[_Seq, int]]]:
        """(sequence, number of tokens to compute) for this iteration: the decode batch and the
        prefill chunks. ``separate_budgets``: each gets max_batch_tokens (they run on different
        workers); else they share it, decode first. ``num_workers`` mixed workers split the iteration,
        so the budget is that many times max_batch_tokens, and no chunk exceeds max_batch_tokens
        (one sequence's chunk runs on one worker). Sequences whose prefill is in flight wait."""
        budget = self.config.max_batch_tokens * num_workers
        decode_batch: list[tuple[_Seq, int]] = []
        decode = [s for s in self._running
                  if s.num_computed == len(s.tokens) - 1 and not s.needs_slot and not s.awaiting_parent
                  and not s.in_flight]
        for s in decode[:budget]:
            decode_batch.append((s, 1))
        budget = budget if separate_budgets else budget - len(decode_batch)
        if separate_budgets and self._prefill is not None:
            return decode_batch, []  # the prefill pipeline is busy
        batch: list[tuple[_Seq, int]] = []
        for s in self._running:
            if s.needs_slot or s.awaiting_parent or s.in_flight or budget <= 0:
                continue
            remaining = len(s.tokens) - s.num_computed
            if remaining <= 1:
                continue
            chunk = min(remaining, budget, self.config.max_batch_tokens)
            batch.append((s, chunk))
            budget -= chunk
        return decode_batch, batch

    def _step_request(self, batch: list[tuple[_Seq, int]], ops: pb.CacheOps | None) -> wpb.WorkerStepRequest:
        req = wpb.WorkerStepRequest(request_id=f"step-{self.instance_id}-{next(self._step_ids)}",
                                    cache_instance_id=self._cache_instance)
        if ops is not None:
            req.ops.CopyFrom(ops)
        for s, k in batch:
            start = s.num_computed
            final = start + k == len(s.tokens)
            item = req.sequences.add(
                seq_id=s.seq_id,
                token_ids=s.tokens[start : start + k],
                block_ids=s.block_table,
                num_cached_tokens=start,
            )
            _fill_sampling(item.sampling, s.request.sampling, s.seed)
            # n > 1: the worker draws the forked samples' first tokens from the prompt's last position.
            s.forks_sent = [c for c in s.children if c.awaiting_parent] if final else []
            for c in s.forks_sent:
                _fill_sampling(item.fork_sampling.add(), s.request.sampling, c.seed)
        return req

    def _run_worker(
        self, batch: list[tuple[_Seq, int]], ops: pb.CacheOps, workers: list[WorkerSlot]
    ) -> list[TokenEvent]:
        """One synchronous step (split over ``workers`` by dispatch), then its results."""
        req = self._step_request(batch, ops)
        t0 = time.perf_counter()
        if self._last_call_end is not None:
            self.stats.worker_idle_s += t0 - self._last_call_end
            self.stats.worker_idle_gaps += 1
        items = [(s, s.num_computed, k) for s, k in batch]
        early: list[_Seq] = []
        early_resp: pb.StepResponse | None = None
        try:
            if self.config.overlap_block_manager and batch:
                fut = self.pool.submit_step(req, workers)
                try:
                    early, early_resp = self._reserve_next_slots(batch)
                finally:
                    resp = fut.result()  # the worker's writes are over before any block changes hands
            else:
                resp = self.pool.step(req, workers)
        except CacheLostEverywhere as e:
            raise self._cache_host_lost(e) from e
        self.stats.worker_steps += 1
        self._last_call_end = time.perf_counter()
        events = self._apply_outputs(items, resp)
        if early_resp is not None:
            self._apply_bm_step(early_resp, early, [], self._pending_ops)
        return events

    def _launch_prefill(self, prefill: list[tuple[_Seq, int]]) -> None:
        """Send the prefill chunks to the prefill workers and return at once (prefill pipeline)."""
        # A slot reservation made during the decode call (overlap) may have preempted one of them.
        prefill = [(s, k) for s, k in prefill if s.status is SeqStatus.RUNNING]
        if not prefill:
            return
        req = self._step_request(prefill, None)
        for s, _ in prefill:
            s.in_flight = True
        fut = self.pool.submit_step(req, self.pool.prefill_workers())
        self._prefill = (fut, [(s, s.num_computed, k) for s, k in prefill])
        self.stats.prefill_launches += 1

    def _harvest_prefill(self, wait: bool) -> list[TokenEvent]:
        """Results of the prefill in flight, once it is done (or now, waiting, with ``wait``)."""
        if self._prefill is None or (not wait and not self._prefill[0].done()):
            return []
        fut, items = self._prefill
        self._prefill = None
        for s, _, _ in items:
            s.in_flight = False
        try:
            resp = fut.result()
        except CacheLostEverywhere as e:
            raise self._cache_host_lost(e) from e
        self.stats.worker_steps += 1
        # A sequence preempted while its chunk ran has been reset: its results are dropped.
        keep = [(i, it) for i, it in enumerate(items) if it[0].status is SeqStatus.RUNNING and it[0].num_computed == it[1]]
        out = wpb.WorkerStepResponse()
        out.outputs.extend(resp.outputs[i] for i, _ in keep)
        return self._apply_outputs([it for _, it in keep], out)

    def _apply_outputs(self, batch: list[tuple[_Seq, int, int]], resp: wpb.WorkerStepResponse) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for (s, _, k), out in zip(batch, resp.outputs):
            s.num_computed += k
            self.stats.computed_tokens += k
            for c in s.children:
                if c.awaiting_parent:
                    c.num_computed = s.num_computed  # their shared prompt blocks were just written
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk: its sampled token is meaningless
            events.extend(self._accept_fork_samples(s, out.fork_samples))
            events.append(self._accept_token(s, out))
        return events

    @staticmethod
    def _cache_host_lost(e: CacheLostEverywhere) -> CacheHostLost:
        """Every worker tried says the cache host is gone (dispatch.py)."""
        return CacheHostLost(
            f"the cache host was lost, and with it the KV of every sequence ({'; '.join(e.details)}). "
            "Restart the cache host and the workers (a worker exits with code 3 after a lost cache host "
            "and re-attaches when restarted), then resubmit the requests, or run the engine with "
            "EngineConfig(recover_lost_cache=True) to wait for a re-attached worker, reset the block "
            "manager's prefix cache and re-prefill every running sequence"
        )

    def _recover_lost_cache(self) -> None:
        """After CacheHostLost: wait for a worker on a new cache instance, forget all cached KV
        (the block manager's prefix cache, pending ops) and recompute every running and
        swapped sequence from its prompt + generated tokens (the recompute-preemption path)."""
        self._drop_prefill_in_flight()  # its KV went with the cache host
        old = self._cache_instance
        deadline = time.monotonic() + self.config.cache_recovery_timeout_s
        log.warning("cache_host_lost", cache_instance_id=old, action="waiting for a re-attached worker",
                    timeout_s=self.config.cache_recovery_timeout_s)
        new = ""
        while not new:
            for w in self.workers:
                try:
                    info = w.get_info(timeout_s=2.0)
                except grpc.RpcError:
                    continue
                if info.cache_instance_id and info.cache_instance_id != old and (
                    info.cache_state != wpb.CACHE_STATE_LOST
                ):
                    new = info.cache_instance_id
                    break
            if not new:
                if time.monotonic() > deadline:
                    raise CacheHostLost(
                        f"the cache host (instance {old}) was lost and no worker re-attached to a new one "
                        f"within {self.config.cache_recovery_timeout_s:.0f} s (cache_recovery_timeout_s): restart "
                        "the cache host and the workers"
                    )
                time.sleep(0.2)
        victims = list(self._running) + list(self._swapped)
        # Finished ones too: what they computed died with the cache host and must never be committed.
        frees = [s.seq_id for s in victims] + self._to_free
        self._to_free = []
        frees += self._maybe_held
        self._maybe_held = []
        if frees:
            # One round trip; a sequence the block manager no longer has is simply reported.
            self._bm_step(pb.StepRequest(free_seq_ids=frees), needs_state=False)
        reset_id = self._bm_request_id("reset")
        self._bm_call(lambda t: self.bm.reset_prefix_cache(request_id=reset_id, timeout_s=t), needs_state=False)
        self._finished_prefixes.clear()
        self._requeue_all(victims)
        self._cache_instance = new
        self.stats.cache_recoveries += 1
        log.warning("cache_recovered", old_cache_instance_id=old, cache_instance_id=new,
                    requeued=len(victims), action="re-prefilling")

    def _accept_fork_samples(self, parent: _Seq, samples: Sequence[wpb.Sample]) -> list[TokenEvent]:
        """n > 1: the samples forked at admission take the first tokens the worker drew for them
        from the prompt's last position (``SequenceInput.fork_sampling``)."""
        events = []
        sent, parent.forks_sent = parent.forks_sent, []
        if len(samples) != len(sent):  # else those samples would wait for a first token forever
            raise RuntimeError(f"the worker drew {len(samples)} first tokens for the {len(sent)} samples forked from "
                               f"{parent.seq_id} (a worker that predates SequenceInput.fork_sampling?)")
        for child, drawn in zip(sent, samples):
            if not child.awaiting_parent or child.status is not SeqStatus.RUNNING:
                continue  # preempted meanwhile: it re-prefills as a request of its own
            child.awaiting_parent = False
            child.num_computed = parent.num_computed
            events.append(self._accept_token(child, drawn))
        return events

    def _accept_token(self, s: _Seq, drawn: wpb.SequenceOutput | wpb.Sample) -> TokenEvent:
        c = s.completion
        token, logprob = drawn.token_id, drawn.logprob
        top: tuple[tuple[int, float], ...] = ()
        if s.request.sampling.logprobs:
            top = tuple(zip(drawn.top_token_ids, drawn.top_logprobs))
            c.top_logprobs.append(top)
        c.token_ids.append(token)
        c.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        s.tokens.append(token)
        reason = None
        if token in s.request.stop_token_ids:
            reason = "stop"
        elif len(c.token_ids) >= s.request.max_tokens:
            reason = "length"
        if reason is None:
            s.needs_slot = True
        else:
            c.finish_reason = reason
            s.status = SeqStatus.FINISHED
            self._running.remove(s)
            self._to_free.append(s.seq_id)
            self._finished_prefixes.append((s.tokens, s.num_computed, self._prefix_cache_drops))
        return TokenEvent(s.request.request_id, s.index, token, logprob, reason, top)

    def flush(self) -> None:
        """Free what finished in the last step (also done at the start of the next step)."""
        if self._to_free:
            try:
                self._block_manager_step(pb.CacheOps(), full=False)
            except ManagerLostState as e:
                self._resync(e)


def _fill_sampling(msg: wpb.SamplingParams, opts: SamplingOptions, seed: int | None) -> None:
    msg.temperature = opts.temperature
    msg.top_p = opts.top_p
    msg.top_k = opts.top_k
    msg.num_top_logprobs = opts.logprobs
    if seed is not None:
        msg.seed = seed
