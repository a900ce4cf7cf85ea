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
   Which workers run it is frontend/engine/dispatch.py's decision: several mixed
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
committed, then hits it (frontend/engine/admission.py); requests of other engines that
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

The engine is this package's conductor; each decision is a module of its own: scheduler.py (the
iteration's plan, pure), bm_session.py (the only module that calls the block manager: request ids,
retries, lease, typed deltas), output.py (tokens, stop checks, events), recovery.py (cache host
lost, block manager restarted without the engine's state), types.py (the values).

Preempted sequences are handled as the block manager decides: recompute
victims go back to the front of the waiting queue with everything generated
so far as their prompt (prefix hits usually cover most of it); swapped ones are
swapped back in when room returns.
"""

from __future__ import annotations

import collections
import itertools
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future

import grpc
import structlog

from frontend.clients.block_manager import BlockManagerClient
from frontend.clients.worker import WorkerClient
from frontend.engine import output, recovery, scheduler
from frontend.engine.bm_session import (
    RESOURCE_EXHAUSTED,
    BlockManagerSession,
    ItemError,
    StepDelta,
    StepPlan,
    read_geometry,
)
from frontend.engine.dispatch import CacheLostEverywhere, WorkerPool, WorkerSlot
from frontend.engine.scheduler import Limits, PoolView
from frontend.engine.types import (
    BlockManagerUnavailable,
    CacheHostLost,
    Completion,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    ManagerLostState,
    RequestOutput,
    Seq,
    SeqStatus,
    TokenEvent,
)
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.watermark import admission_room

log = structlog.get_logger("pagedkv.engine")


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
        geometry = read_geometry(self.bm, self.config.timeout_s)
        self.block_size = geometry.block_size
        self.num_gpu_blocks = geometry.num_gpu_blocks
        self._watermark = geometry.watermark_blocks
        self._prefix_caching = geometry.prefix_caching
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
        self._waiting: collections.deque[Seq] = collections.deque()
        self._running: list[Seq] = []
        self._swapped: collections.deque[Seq] = collections.deque()
        self._seqs: dict[str, Seq] = {}
        self._to_free: list[str] = []
        self._pending_ops = pb.CacheOps()
        self._limits = Limits(
            self.config.max_num_seqs,
            self.config.max_batch_tokens,
            self.block_size,
            self._watermark,
            self._prefix_caching,
        )
        self._pool = PoolView(self.num_gpu_blocks, 0)  # from the last Step reply, for admission
        # What recently finished sequences committed: a hint for admission (frontend/engine/admission.py),
        # each with the manager's prefix_cache_drops when it finished; trusted only while that
        # counter has not moved (nothing left the cache since, so their blocks are still cached).
        self._finished_prefixes: collections.deque[tuple[list[int], int, int]] = collections.deque(
            maxlen=self.config.max_num_seqs
        )
        self._step_ids = itertools.count()
        # The prefill pipeline's chunk in flight: its future and (sequence, num_computed at launch, tokens).
        self._prefill: tuple[Future[wpb.WorkerStepResponse], list[tuple[Seq, int, int]]] | None = None
        self._last_call_end: float | None = None
        # Sequences a Step that got no answer may have created (freed in the next Step that does).
        self._maybe_held: list[str] = []
        self.session = BlockManagerSession(self.bm, self.lease_id, self.config, self.stats)

    def _info_or_none(self, w: WorkerClient) -> wpb.WorkerInfo | None:
        try:
            return w.get_info(timeout_s=self.config.timeout_s)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            log.warning("worker_unavailable_at_start", worker=w.target, code=e.code().name)
            return None

    def block_manager_reachable(self, timeout_s: float = 2.0) -> bool:
        """Does the block manager answer now? (After BlockManagerUnavailable.)"""
        return self.session.reachable(timeout_s)

    def close(self) -> None:
        """Wait for a prefill in flight, stop renewing the lease and free every sequence this engine
        holds (one Step), stop the dispatch threads (the clients stay the caller's)."""
        if self._prefill is not None:
            self._prefill[0].exception()
            for s, _, _ in self._prefill[1]:
                s.in_flight = False
            self._prefill = None
        self.pool.close()
        self.session.stop_renewal()
        held = [s.seq_id for s in self._running] + [s.seq_id for s in self._swapped] + self._to_free
        self._running, self._to_free = [], []
        self._swapped.clear()
        held += self._maybe_held
        self._maybe_held = []
        self.session.free_now(held)

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
            raise ValueError(
                f"request {request.request_id}: n={request.n} samples can never run together "
                f"(max_num_seqs={self.config.max_num_seqs})"
            )
        total = len(request.prompt) + request.max_tokens
        if -(-total // self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id}: {total} tokens can never fit in {self.num_gpu_blocks} blocks"
            )
        # The block manager admits a prompt only above its watermark; a prompt that needs more than
        # that would wait forever, so refuse it here rather than fail the iteration later.
        if self._prompt_blocks(request.prompt) > admission_room(self.num_gpu_blocks, self._watermark):
            raise ValueError(
                f"request {request.request_id}: its {len(request.prompt)}-token prompt can never be admitted "
                f"(the pool has {self.num_gpu_blocks} blocks, {self._watermark} held back by the watermark)"
            )
        out = RequestOutput(
            request.request_id, list(request.prompt), [Completion(index=i) for i in range(request.n)]
        )
        self.outputs[request.request_id] = out
        seq = Seq(self._seq_id(request.request_id, 0), request, out, 0, list(request.prompt))
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        self.stats.prompt_tokens += len(request.prompt)
        return out

    def _prompt_blocks(self, tokens: Sequence[int]) -> int:
        return -(-len(tokens) // self.block_size)

    def _seq_id(self, request_id: str, index: int) -> str:
        return f"{self.instance_id}:{request_id}/{index}"

    def running_sequences(self) -> list[Seq]:
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

    def generate(
        self, requests: Iterable[GenerationRequest], max_steps: int = 1_000_000
    ) -> list[RequestOutput]:
        """Run requests to completion; outputs in the order given.

        The engine then forgets them (``release_request``): the caller holds the outputs, and an
        engine that runs batch after batch must not keep every earlier request's bookkeeping.
        """
        outs = [self.add_request(r) for r in requests]
        for _ in self.stream(max_steps):
            pass
        for o in outs:
            self.release_request(o.request_id)
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
            if self.session.lease_lost.is_set():
                raise ManagerLostState("the block manager lost this engine's lease and sequences")
            return self._step()
        except ManagerLostState as e:
            recovery.resync(self, e)
            return []
        except CacheHostLost:
            if not self.config.recover_lost_cache:
                recovery.forget_lost_cache(self)
                raise
            recovery.recover_lost_cache(self)
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
        if self._prefill is not None and any(
            s.status is not SeqStatus.RUNNING for s, _, _ in self._prefill[1]
        ):
            # A sequence being prefilled was preempted: its blocks may be reused or swapped out by
            # this iteration's steps, so its writes must be over first.
            events += self._harvest_prefill(wait=True)
        # Data parallel: max_batch_tokens bounds each worker's step, so N workers take N times as much.
        share = 1 if disaggregated else len(self.pool.workers())
        decode, prefill = scheduler.batches(
            self._running,
            self._limits,
            separate_budgets=disaggregated,
            num_workers=share,
            prefill_busy=self._prefill is not None,
        )
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
        elif (
            self._waiting
            and not self._running
            and not self._swapped
            and not self._to_free
            and self._prefill is None
        ):
            head = self._waiting[0]
            need = self._prompt_blocks(head.tokens)  # samples fork from the prompt and share it
            if need > admission_room(self.num_gpu_blocks, self._watermark):
                raise RuntimeError(
                    f"request {head.request.request_id} cannot be admitted: it needs {need} blocks and "
                    f"the pool has {self.num_gpu_blocks} ({self._watermark} held back by the watermark)"
                )
            # Other frontends hold the room it needs: wait for them, without hammering the manager.
            time.sleep(0.01)

    def _step_disaggregated(
        self, decode: list[tuple[Seq, int]], prefill: list[tuple[Seq, int]], ops: pb.CacheOps
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
            return events + self._harvest_prefill(
                wait=True
            )  # nothing to decode: wait for the prompt, no spinning
        self._idle(pb.CacheOps())
        return events

    @staticmethod
    def _pending_ops_nonempty(ops: pb.CacheOps) -> bool:
        return bool(len(ops.copies) or len(ops.swap_out) or len(ops.swap_in))

    def _finishing(self) -> list[Seq]:
        """Finished sequences whose Free goes into the next Step (their commits go first)."""
        return [self._seqs[x] for x in self._to_free]

    def _admissions(self, grow: list[Seq], swap_in: list[Seq]) -> list[Seq]:
        if self._prefix_caching and self._waiting and self._finished_prefixes and not self._running:
            self._refresh_prefix_cache_drops()
        admit, held = scheduler.admissions(
            self._waiting,
            self._running,
            self._finishing(),
            grow,
            len(swap_in),
            self._pool,
            self._limits,
            self._finished_prefixes,
        )
        self.stats.admissions_held += held
        return admit

    def _refresh_prefix_cache_drops(self) -> None:
        """An idle engine's last Step reply may be old: another frontend or a ResetPrefixCache
        may have dropped cached blocks since. One empty Step reads the counter again before the
        finished sequences' hints decide an admission (an RPC only when idle with hints)."""
        delta = self.session.step(StepPlan())
        self._pool = PoolView(delta.available_blocks, delta.prefix_cache_drops)

    def _block_manager_step(self, ops: pb.CacheOps, *, full: bool = True) -> None:
        """The iteration's one round trip: commits, frees, appends, allocations, forks, swap-ins.
        `full=False` (flush): commits and frees only."""
        grow = [s for s in self._running if s.needs_slot] if full else []
        swap_in = scheduler.swap_ins(self._swapped, len(self._running), self._limits) if full else []
        admit = self._admissions(grow, swap_in) if full else []
        commits = scheduler.commits(itertools.chain(self._running, self._finishing()), self.block_size)
        frees = self._to_free + self._maybe_held
        if not (grow or frees or swap_in or admit or commits):
            return
        forks: list[tuple[Seq, Seq]] = []
        for seq in admit:
            if seq.index == 0 and seq.request.n > 1 and not seq.forked:
                for i in range(1, seq.request.n):
                    child = Seq(
                        self._seq_id(seq.request.request_id, i),
                        seq.request,
                        seq.output,
                        i,
                        list(seq.tokens),
                        forked=True,
                        awaiting_parent=True,
                    )
                    forks.append((seq, child))
        plan = StepPlan(
            commits=commits,
            frees=frees,
            appends=[(s.seq_id, s.tokens[-1]) for s in grow],
            allocs=[(s.seq_id, s.tokens, s.request.priority) for s in admit],
            forks=[(p.seq_id, c.seq_id) for p, c in forks],
            swap_ins=[s.seq_id for s in swap_in],
        )
        created = [s.seq_id for s in admit] + [c.seq_id for _, c in forks]
        try:
            delta = self.session.step(plan)
        except BlockManagerUnavailable:
            self._maybe_held.extend(created)  # the unanswered Step may have allocated them
            raise
        except ManagerLostState as e:
            e.seq_ids.extend(created)
            raise
        self._to_free = []
        self._maybe_held = []
        self._apply_bm_step(delta, grow, swap_in, ops, admit, forks)

    def _reserve_next_slots(self, batch: list[tuple[Seq, int]]) -> tuple[list[Seq], StepDelta | None]:
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
        early = [
            s
            for s, k in batch
            if s.num_computed + k == len(s.tokens)
            and not s.needs_slot
            and s.completion.token_ids
            and len(s.completion.token_ids) + 1 < s.request.max_tokens
            and not any(c.awaiting_parent for c in s.children)
        ]
        if not early:
            return [], None
        delta = self.session.step(StepPlan(appends=[(s.seq_id, None) for s in early]))
        self.stats.slots_reserved_ahead += len(early)
        return early, delta

    def _take_held(self) -> tuple[list[Seq], list[str]]:
        """Every running and swapped sequence, and the ids of everything this engine may hold in
        the block manager (those, finished ones, what an unanswered Step may have created)."""
        victims = list(self._running) + list(self._swapped)
        frees = [s.seq_id for s in victims] + self._to_free + self._maybe_held
        self._to_free, self._maybe_held = [], []
        return victims, frees

    def _drop_prefill_in_flight(self) -> None:
        """Wait for a prefill chunk in flight and drop its results (its sequences are requeued)."""
        if self._prefill is not None:
            self._prefill[0].exception()
            for s, _, _ in self._prefill[1]:
                s.in_flight = False
            self._prefill = None
        self._last_call_end = None

    def _requeue_all(self, victims: list[Seq]) -> None:
        """Every running and swapped sequence back to the head of the queue, in order, to be
        recomputed; no cache op of the old tables may run any more, and no hint of what finished
        sequences committed holds."""
        for s in reversed(victims):  # appendleft: keep their order at the head of the queue
            self.stats.recomputed_tokens += s.num_computed
            if s.status is SeqStatus.SWAPPED:
                self._swapped.remove(s)
            self._requeue(s)
        self._pending_ops = pb.CacheOps()
        self._finished_prefixes.clear()

    def _apply_bm_step(
        self,
        delta: StepDelta,
        grow: list[Seq],
        swap_in: list[Seq],
        ops: pb.CacheOps,
        admit: list[Seq] | None = None,
        forks: list[tuple[Seq, Seq]] | None = None,
    ) -> None:
        """Block tables, cache ops, preemptions, allocations, forks and swap-ins of one Step reply."""
        self._pool = PoolView(delta.available_blocks, delta.prefix_cache_drops)
        for i, block, replaces_last in delta.grown:
            if replaces_last:
                grow[i].block_table[-1] = block
            else:
                grow[i].block_table.append(block)
        ops.copies.extend(delta.ops.copies)
        ops.swap_out.extend(delta.ops.swap_out)
        ops.swap_in.extend(delta.ops.swap_in)
        preempted = self._apply_preemptions(delta)
        errors: dict[str, dict[int, ItemError]] = collections.defaultdict(dict)
        for err in delta.errors:
            errors[err.kind][err.index] = err
        self._apply_allocations(delta, admit or [], errors["alloc"])
        self._apply_forks(forks or [], errors["fork"])
        self._apply_swap_ins(delta, swap_in)
        failed: set[int] = set()
        for err in delta.errors:
            if err.kind in ("alloc", "fork", "swap_in"):
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
                self._preempt_self(grow[err.index])
            else:
                raise RuntimeError(f"block manager refused to grow {err.seq_id}: {err.message}")
        for i, s in enumerate(grow):
            if i not in failed and s.status is SeqStatus.RUNNING:
                s.needs_slot = False

    def _apply_allocations(self, delta: StepDelta, admit: list[Seq], errors: dict[int, ItemError]) -> None:
        for j, seq in enumerate(admit):
            err = errors.get(j)
            if err is not None:
                if err.code == RESOURCE_EXHAUSTED:
                    continue  # no room yet: it keeps its place in the queue
                raise RuntimeError(f"block manager refused to allocate {err.seq_id}: {err.message}")
            self._waiting.remove(seq)
            seq.block_table = delta.alloc_tables[j]
            cached = delta.alloc_cached[j]
            seq.num_computed = seq.num_committed = cached
            if seq.index == 0 and not seq.output.completions[0].token_ids:
                seq.output.num_cached_tokens = cached
            self.stats.prefix_hit_tokens += cached
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)

    def _apply_forks(self, forks: list[tuple[Seq, Seq]], errors: dict[int, ItemError]) -> None:
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

    def _apply_preemptions(self, delta: StepDelta) -> set[str]:
        """Follow the block manager's preemption decisions; returns the victims' ids."""
        victims: set[str] = set()
        for p in delta.preempted:
            victims.add(p.seq_id)
            seq = self._seqs.get(p.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            if p.swap:
                self._running.remove(seq)
                seq.status = SeqStatus.SWAPPED
                seq.block_table = []
                self._swapped.append(seq)
                self.stats.preempted_swap += 1
            else:
                self._requeue(seq)
                self.stats.preempted_recompute += 1
            log.info("preempted", seq_id=seq.seq_id, mode="SWAP" if p.swap else "RECOMPUTE", cost_s=p.cost_s)
        return victims

    def _apply_swap_ins(self, delta: StepDelta, asked: list[Seq]) -> None:
        for _, members in zip(asked, delta.swap_ins, strict=False):
            for seq_id, table in members:
                s = self._seqs.get(seq_id)
                if s is None or s.status is not SeqStatus.SWAPPED:
                    continue
                s.block_table = table
                s.status = SeqStatus.RUNNING
                self._swapped.remove(s)
                self._running.append(s)

    def _preempt_self(self, seq: Seq) -> None:
        """Recompute it later: its Free goes into the next Step, ahead of its re-allocation."""
        self._to_free.append(seq.seq_id)
        self._requeue(seq)
        self.stats.preempted_recompute += 1
        log.info("preempted", seq_id=seq.seq_id, mode="RECOMPUTE", by="engine")

    def _requeue(self, seq: Seq) -> None:
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

    def _step_request(self, batch: list[tuple[Seq, int]], ops: pb.CacheOps | None) -> wpb.WorkerStepRequest:
        req = wpb.WorkerStepRequest(
            request_id=f"step-{self.instance_id}-{next(self._step_ids)}",
            cache_instance_id=self._cache_instance,
        )
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
            output.fill_sampling(item.sampling, s.request.sampling, s.seed)
            # n > 1: the worker draws the forked samples' first tokens from the prompt's last position.
            s.forks_sent = [c for c in s.children if c.awaiting_parent] if final else []
            for c in s.forks_sent:
                output.fill_sampling(item.fork_sampling.add(), s.request.sampling, c.seed)
        return req

    def _run_worker(
        self, batch: list[tuple[Seq, int]], ops: pb.CacheOps, workers: list[WorkerSlot]
    ) -> list[TokenEvent]:
        """One synchronous step (split over ``workers`` by dispatch), then its results."""
        req = self._step_request(batch, ops)
        t0 = time.perf_counter()
        if self._last_call_end is not None:
            self.stats.worker_idle_s += t0 - self._last_call_end
            self.stats.worker_idle_gaps += 1
        items = [(s, s.num_computed, k) for s, k in batch]
        early: list[Seq] = []
        early_delta: StepDelta | None = None
        try:
            if self.config.overlap_block_manager and batch:
                fut = self.pool.submit_step(req, workers)
                try:
                    early, early_delta = self._reserve_next_slots(batch)
                finally:
                    resp = fut.result()  # the worker's writes are over before any block changes hands
            else:
                resp = self.pool.step(req, workers)
        except CacheLostEverywhere as e:
            raise recovery.cache_host_lost(e) from e
        self.stats.worker_steps += 1
        self._last_call_end = time.perf_counter()
        events = self._apply_outputs(items, resp)
        if early_delta is not None:
            self._apply_bm_step(early_delta, early, [], self._pending_ops)
        return events

    def _launch_prefill(self, prefill: list[tuple[Seq, int]]) -> None:
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
            raise recovery.cache_host_lost(e) from e
        self.stats.worker_steps += 1
        # A sequence preempted while its chunk ran has been reset: its results are dropped.
        keep = [
            (i, it)
            for i, it in enumerate(items)
            if it[0].status is SeqStatus.RUNNING and it[0].num_computed == it[1]
        ]
        out = wpb.WorkerStepResponse()
        out.outputs.extend(resp.outputs[i] for i, _ in keep)
        return self._apply_outputs([it for _, it in keep], out)

    def _apply_outputs(
        self, batch: list[tuple[Seq, int, int]], resp: wpb.WorkerStepResponse
    ) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for (s, _, k), out in zip(batch, resp.outputs, strict=False):
            s.num_computed += k
            self.stats.computed_tokens += k
            for c in s.children:
                if c.awaiting_parent:
                    c.num_computed = s.num_computed  # their shared prompt blocks were just written
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk: its sampled token is meaningless
            for child, drawn in output.fork_firsts(s, out.fork_samples):
                events.append(self._accept_token(child, drawn))
            events.append(self._accept_token(s, out))
        return events

    def _accept_token(self, s: Seq, drawn: output.Drawn) -> TokenEvent:
        ev = output.accept_token(s, drawn)
        self.stats.generated_tokens += 1
        if ev.finish_reason is not None:
            self._running.remove(s)
            self._to_free.append(s.seq_id)
            self._finished_prefixes.append((s.tokens, s.num_computed, self._pool.prefix_cache_drops))
        return ev

    def flush(self) -> None:
        """Free what finished in the last step (also done at the start of the next step)."""
        if self._to_free:
            try:
                self._block_manager_step(pb.CacheOps(), full=False)
            except ManagerLostState as e:
                recovery.resync(self, e)
