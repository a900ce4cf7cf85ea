"""A continuous-batching engine on top of the block manager and the workers.

Each `step()` is one iteration, conducted as vLLM v1's ``EngineCore.step()`` is: plan, call, apply.

1. **Block manager, one `Step`** (scheduler.py plans it, bm_session.py sends it), everything packed,
   in the order the manager applies it: *commits* (what the last worker step computed: only now do
   those blocks become prefix-cache hits, for every frontend), *frees*, beam search's forks (beam.py),
   *appends* (a slot for each running sequence's new token), *allocations* (admitted requests, under
   this engine's lease), *forks* (the other samples of an `n > 1` request share its prompt blocks),
   *swap-ins*. Copy-on-write ops, preemptions and the new block tables come back as deltas.
2. **Worker step**: decode tokens first, then prefill chunks within a token budget (chunked
   prefill), with the iteration's cache ops. Which workers run it is frontend/engine/dispatch.py's
   decision: mixed workers split the iteration and compute at once on the one shared cache; with
   prefill and decode workers the engine runs two pipelines, and a sequence joins the decode batch
   at the first iteration after its prefill came back. With `overlap_block_manager`, a second Step
   reserves the next slots while the workers compute. An iteration of decode tokens alone, with
   nobody waiting for admission, runs up to `decode_steps` decode steps in the one worker call
   (multi-step decode: Scheduler.decode_steps, policy.decode_steps).
3. Sampled tokens come back as `TokenEvent`s; an `n > 1` request's samples get their first token
   from the prompt's last position in the parent's prefill step (`SequenceInput.fork_sampling`).

The block manager is the one place that knows which KV exists: the engine keeps no shadow of the
prefix cache (a request whose prefix another of its sequences is still computing waits until it is
committed: frontend/engine/admission.py). Sequence ids carry a per-engine prefix and every sequence is
under this engine's lease, renewed in the background, so many engines share one manager. Every
mutation carries a request id and is retried within `block_manager_outage_s`; a manager that lost
this engine's state is resynced, and a lost cache host recovered (recovery.py, docs/reliability.md).

The engine owns only the I/O (the block-manager session, the worker pool, the prefill in flight);
scheduler.py owns the queues and every transition, policy.py decides who goes, output.py builds
the worker's messages and reads its results, types.py holds the values.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future

import grpc
import structlog

from pagedkv.defaults import MAX_DECODE_STEPS
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import output, recovery, speculate
from pagedkv.frontend.engine.bm_session import BlockManagerSession, read_geometry
from pagedkv.frontend.engine.dispatch import CacheLostEverywhere, WorkerPool, WorkerSlot
from pagedkv.frontend.engine.policy import Limits
from pagedkv.frontend.engine.remote_table import BlockManagerPlan
from pagedkv.frontend.engine.scheduler import PrefillItem, Scheduler
from pagedkv.frontend.engine.step_messages import StepDelta, StepPlan
from pagedkv.frontend.engine.types import (
    BlockManagerUnavailable,
    CacheHostLost,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    ManagerLostState,
    RequestOutput,
    Seq,
    SeqStatus,
    TokenEvent,
)
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.watermark import never_admitted

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
        if not 1 <= self.config.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(
                f"decode_steps must be in [1, {MAX_DECODE_STEPS}], got {self.config.decode_steps}"
            )
        geometry = read_geometry(self.bm, self.config.timeout_s)
        self.block_size = geometry.block_size
        self.num_gpu_blocks = geometry.num_gpu_blocks
        self._watermark = geometry.watermark_blocks
        infos = [self._info_or_none(w) for w in self.workers]
        info = next((i for i in infos if i is not None), None)
        if info is None:
            info = self.workers[0].get_info(timeout_s=self.config.timeout_s)  # raises the real error
        self.pool = WorkerPool.from_clients(
            self.workers, infos, timeout_s=self.config.timeout_s * 4, outage_s=self.config.worker_outage_s
        )
        if info.geometry.block_size and info.geometry.block_size != self.block_size:
            raise ValueError(
                f"worker block_size {info.geometry.block_size} != block manager block_size {self.block_size}"
            )
        self.vocab_size = info.vocab_size
        speculate.check_drafts(self.config.speculative, zip(self.workers, infos, strict=True))
        self.cache_instance = info.cache_instance_id  # steps name it: a worker on another cache refuses
        # Sequence ids are unique per engine instance, so any number of engines share one manager.
        self.instance_id = uuid.uuid4().hex[:12]
        self.lease_id = f"engine-{self.instance_id}"
        self.stats = EngineStats()
        limits = Limits(
            self.config.max_num_seqs,
            self.config.max_batch_tokens,
            self.block_size,
            self._watermark,
            geometry.prefix_caching,
            len(geometry.kv_groups),
        )
        self.scheduler = Scheduler(
            limits,
            self.num_gpu_blocks,
            self.instance_id,
            self.stats,
            defer_appends=self.config.defer_appends,
            grant_ahead_tokens=self.config.grant_ahead_tokens if len(geometry.kv_groups) == 1 else 0,
            # Not with overlap: its reservation holds one slot per sequence, not 1 + k.
            speculative=None if self.config.overlap_block_manager else self.config.speculative,
        )
        self.scheduler.remote.kv_groups = geometry.kv_groups  # window tables shrink at commits; no grants
        self._step_ids = itertools.count()
        # The prefill pipeline's chunk in flight: its future and its items.
        self._prefill: tuple[Future[wpb.WorkerStepResponse], list[PrefillItem]] | None = None
        self._last_call_end: float | None = None
        # Overlap: the Step that reserved the next slots during the worker call, and its reply.
        self._reserved: tuple[BlockManagerPlan, StepDelta] | None = None
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
        self.drop_prefill_in_flight()
        self.pool.close()
        self.session.stop_renewal()
        self.session.free_now(self.scheduler.forget_all())

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- public API -------------------------------------------------------------
    @property
    def outputs(self) -> dict[str, RequestOutput]:
        """The outputs of every request added and not yet released, by request id."""
        return self.scheduler.outputs

    def add_request(self, request: GenerationRequest) -> RequestOutput:
        request.validate(self.vocab_size)
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
        if blocks_for_tokens(total, self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id}: {total} tokens can never fit in {self.num_gpu_blocks} blocks"
            )
        # The block manager admits a prompt only above its watermark; a prompt that needs more than
        # that would wait forever, so refuse it here rather than fail the iteration later.
        lim = self.scheduler.limits  # with KV-cache groups a prompt takes its blocks in each group
        why = never_admitted(
            len(request.prompt), lim.block_size, self.num_gpu_blocks, lim.watermark, lim.kv_groups
        )
        if why is not None:
            raise ValueError(f"request {request.request_id}: {why}")
        return self.scheduler.add(request)

    def running_sequences(self) -> list[Seq]:
        """Sequences holding blocks right now: running, plus finished ones whose Free is
        batched into the next step (read-only view for monitoring)."""
        return self.scheduler.running + self.scheduler.remote.finishing()

    def num_requests(self) -> tuple[int, int]:
        """(waiting, running) requests, vLLM's meaning: a request is running while any of its
        samples holds blocks (running or swapped), waiting while it is only queued."""
        return self.scheduler.num_requests()

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort") -> bool:
        """Finish a request (or one of its samples) now: a client went away, or a stop string
        matched. Its sequences stop being scheduled and their blocks are freed in the next step's
        block-manager round trip (a waiting sequence holds none). Returns False when there was
        nothing left to finish. Call from the thread that steps the engine."""
        return self.scheduler.abort(request_id, index, reason)

    def release_request(self, request_id: str) -> bool:
        """Forget a finished request's bookkeeping once its blocks were freed, so a long-running
        server does not grow. Returns False (and keeps everything) while any of its sequences is
        still unfinished or waits for its Free in the next step."""
        return self.scheduler.release(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

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
            self.drop_prefill_in_flight()
            recovery.resync(self.scheduler, self.session, e)
            return []
        except CacheHostLost:
            self.drop_prefill_in_flight()  # its KV went with the cache host
            if not self.config.recover_lost_cache:
                recovery.forget_lost_cache(self.close, self.session)
                raise
            self.cache_instance = recovery.recover_lost_cache(
                self.scheduler, self.session, self.workers, self.cache_instance, self.config
            )
            return []
        finally:
            self.stats.worker_retries = self.pool.stats.retries

    def _step(self) -> list[TokenEvent]:
        """Plan, call, apply: the block manager's Step, then the worker step(s) on its tables."""
        disaggregated = self.pool.disaggregated()
        # A prefill that came back is committed in this Step and joins this iteration's decode batch.
        events = self._harvest_prefill(wait=not disaggregated)
        self._block_manager_step()
        if self._prefill is not None and any(
            it.seq.status is not SeqStatus.PREFILLING for it in self._prefill[1]
        ):
            # A sequence being prefilled was preempted: its blocks may be reused or swapped out by
            # this iteration's steps, so its writes must be over first.
            events += self._harvest_prefill(wait=True)
        # Data parallel: max_batch_tokens bounds each worker's step, so N workers take N times as much.
        decode, prefill = self.scheduler.batches(
            separate_budgets=disaggregated,
            num_workers=1 if disaggregated else len(self.pool.workers()),
            prefill_busy=self._prefill is not None,
        )
        if disaggregated:
            return events + self._step_disaggregated(decode, prefill)
        batch = decode + prefill
        if not batch:
            self._idle()
            return events
        return events + self._run_worker(batch, self.pool.workers(), self._decode_steps(batch))

    def _decode_steps(self, batch: list[tuple[Seq, int]]) -> list[int] | None:
        """Multi-step decode (EngineConfig.decode_steps, Scheduler.decode_steps): not while a
        prefill is in flight, nor with overlap_block_manager (its reservation covers one slot)."""
        if self.config.overlap_block_manager or self._prefill is not None:
            return None
        return self.scheduler.decode_steps(batch, self.config.decode_steps)

    def _block_manager_step(self, *, full: bool = True) -> None:
        """The iteration's one round trip: commits, frees, appends, allocations, forks, swap-ins.
        `full=False` (flush): commits and frees only."""
        sched = self.scheduler
        sched.remote.held = self.pool.fences.held()  # a fenced step's sequences keep their blocks
        if full and sched.needs_pool_refresh():
            sched.remote.note_pool(self.session.step(StepPlan()))  # one empty Step reads the counter again
        plan = sched.plan(full=full)
        if plan is None:
            return
        try:
            delta = self.session.step(plan.step)
        except BlockManagerUnavailable:
            sched.step_unanswered(plan)
            raise
        except ManagerLostState as e:
            e.seq_ids.extend(plan.created)
            raise
        sched.apply_block_manager(plan, delta)

    def _idle(self) -> None:
        """Nothing to compute this iteration: pause rather than spin while the scheduler only waits
        for a fence to lift or for room other frontends hold (Scheduler.should_back_off)."""
        self._last_call_end = None
        if self.scheduler.should_back_off(prefill_in_flight=self._prefill is not None):
            time.sleep(0.01)

    def _step_disaggregated(
        self, decode: list[tuple[Seq, int]], prefill: list[tuple[Seq, int]]
    ) -> list[TokenEvent]:
        """Decode on the decode workers now; prefill on the prefill workers without waiting for it.

        Cache ops run before a new prefill is launched (a swap-out must read its blocks before a
        newly admitted prompt may overwrite them), so a launch waits for an ops-carrying decode call."""
        launch = bool(prefill) and self._prefill is None
        has_ops = self.scheduler.remote.has_pending_ops()
        events: list[TokenEvent] = []
        if decode:
            if launch and not has_ops:
                self._launch_prefill(prefill)
            events += self._run_worker(decode, self.pool.decode_workers())
            if launch and has_ops:
                self._launch_prefill(prefill)
            return events
        if has_ops:
            self._run_worker([], self.pool.decode_workers())
        if launch:
            self._launch_prefill(prefill)
        if self._prefill is not None:
            return events + self._harvest_prefill(wait=True)  # nothing to decode: wait, no spinning
        self._idle()
        return events

    def _reserve_next_slots(self, batch: list[tuple[Seq, int]]) -> None:
        """Overlap (EngineConfig.overlap_block_manager): while the workers compute ``batch``, the Step
        that reserves the next slots (Scheduler.reservation); its reply is applied after the step."""
        plan = self.scheduler.reservation(batch)
        if plan is not None:
            self._reserved = (plan, self.session.step(plan.step))

    def _worker_request(
        self, batch: list[tuple[Seq, int]], ops: pb.CacheOps | None, steps: list[int] | None = None
    ) -> wpb.WorkerStepRequest:
        rid = f"step-{self.instance_id}-{next(self._step_ids)}"
        return output.worker_request(batch, ops, rid, self.cache_instance, self.scheduler.fork_draws, steps)

    def _run_worker(
        self, batch: list[tuple[Seq, int]], workers: list[WorkerSlot], steps: list[int] | None = None
    ) -> list[TokenEvent]:
        """One synchronous step (split over ``workers`` by dispatch) with the cache ops owed, then
        its results; ``steps``: decode steps per sequence (multi-step decode)."""
        req = self._worker_request(batch, self.scheduler.remote.take_ops(), steps)
        t0 = time.perf_counter()
        if self._last_call_end is not None:
            self.stats.worker_idle_s += t0 - self._last_call_end
            self.stats.worker_idle_gaps += 1
        items = [PrefillItem(s, s.num_computed, k, s.blocks.attempt) for s, k in batch]
        self._reserved = None
        try:
            if self.config.overlap_block_manager and batch:
                fut = self.pool.submit_step(req, workers)
                try:
                    self._reserve_next_slots(batch)
                finally:
                    resp = fut.result()  # the worker's writes are over before any block changes hands
            else:
                resp = self.pool.step(req, workers)
        except CacheLostEverywhere as e:
            raise recovery.cache_host_lost(e) from e
        self.stats.worker_steps += 1
        self.stats.multi_step_calls += steps is not None
        self._last_call_end = time.perf_counter()
        events = self.scheduler.apply_outputs(items, resp.outputs)
        if self._reserved is not None:
            self.scheduler.apply_reservation(*self._reserved)
            self._reserved = None
        return events

    def _launch_prefill(self, prefill: list[tuple[Seq, int]]) -> None:
        """Send the prefill chunks to the prefill workers and return at once (prefill pipeline)."""
        # A slot reservation made during the decode call (overlap) may have preempted one of them.
        prefill = [(s, k) for s, k in prefill if s.status is SeqStatus.RUNNING]
        if not prefill:
            return
        req = self._worker_request(prefill, None)
        items = self.scheduler.start_prefill(prefill)
        self._prefill = (self.pool.submit_step(req, self.pool.prefill_workers()), items)
        self.stats.prefill_launches += 1

    def _harvest_prefill(self, wait: bool) -> list[TokenEvent]:
        """Results of the prefill in flight, once it is done (or now, waiting, with ``wait``)."""
        if self._prefill is None or (not wait and not self._prefill[0].done()):
            return []
        fut, items = self._prefill
        self._prefill = None
        keep = self.scheduler.end_prefill(items)
        try:
            resp = fut.result()
        except CacheLostEverywhere as e:
            raise recovery.cache_host_lost(e) from e
        self.stats.worker_steps += 1
        # A sequence preempted while its chunk ran has been reset: its results are dropped.
        kept = [(it, out) for it, out in zip(items, resp.outputs, strict=False) if it in keep]
        return self.scheduler.apply_outputs([it for it, _ in kept], [out for _, out in kept])

    def drop_prefill_in_flight(self) -> None:
        """Wait for a prefill chunk in flight and drop its results (its sequences are requeued or freed)."""
        if self._prefill is not None:
            self._prefill[0].exception()
            self.scheduler.end_prefill(self._prefill[1])
            self._prefill = None
        self._last_call_end = None

    def flush(self) -> None:
        """Free what finished in the last step (also done at the start of the next step): two
        Steps when a finished sequence's deferred appends must go before its commit."""
        for _ in range(2):
            if not self.scheduler.remote.frees_due():
                return
            try:
                self._block_manager_step(full=False)
            except ManagerLostState as e:
                self.drop_prefill_in_flight()
                recovery.resync(self.scheduler, self.session, e)
