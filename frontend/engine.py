"""A continuous-batching engine on top of the block manager and the workers.

Each `step()` is one scheduler iteration:

1. **Block manager, one round trip** (`Step`): free the sequences that finished
   last iteration and reserve a slot for every running sequence's newly sampled
   token (packed arrays with the token ids, so full blocks enter the prefix
   cache). Copy-on-write ops and preemptions come back in the reply.
2. **Swap-in** swapped sequences while room allows, oldest first (in the
   same block-manager Step).
3. **Admission**: waiting requests are allocated with their token ids, so
   prefix-cache hits skip prefill work; admission stops at the first request
   that does not fit (FIFO, no overtaking).
4. **Worker step**: decode tokens first (one per running sequence), then
   prefill chunks in arrival order within a token budget (chunked prefill: a
   long prompt never stalls decoding), with all cache ops of the iteration.
5. Sample results are streamed as `TokenEvent`s; `n > 1` samples fork from the
   prompt once it is computed (sharing every block, copy-on-write later).

Preempted sequences are handled as the block manager decides: recompute
victims go back to the front of the waiting queue with everything generated
so far as their prompt (prefix hits usually cover most of it); swapped ones are
swapped back in when room returns.

Prefix hits on blocks whose KV is not computed yet: the block manager
registers a prompt's full blocks at Allocate, before any worker has written
them. The engine tracks which physical blocks hold computed KV; a request whose
hits include a block that another running sequence is still prefilling waits
for it, and a hit on a block nobody will compute (its owner was preempted) is
recomputed by the request itself.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from frontend.client import BlockManagerClient
from frontend.worker_client import WorkerClient
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb
from worker_svc.cache_watch import CACHE_LOST_PREFIX

log = structlog.get_logger("pagedkv.engine")


class CacheHostLost(RuntimeError):
    """Every worker says the cache host (and so every sequence's KV) is gone (docs/reliability.md)."""


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    """Sampling parameters of a request (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


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


@dataclass(slots=True)
class TokenEvent:
    """One generated token of one sample, as it is produced."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    finish_reason: str | None  # None while running, else "stop" or "length"


@dataclass(slots=True)
class Completion:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


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
    needs_slot: bool = False  # last token sampled but not yet reserved in the block manager
    forked: bool = False  # n > 1 samples already forked from this sequence

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
        geometry = self.bm.get_config(timeout_s=self.config.timeout_s)
        self.block_size = geometry.block_size
        self.num_gpu_blocks = geometry.num_gpu_blocks
        info = self.workers[0].get_info(timeout_s=self.config.timeout_s)
        if info.geometry.block_size and info.geometry.block_size != self.block_size:
            raise ValueError(
                f"worker block_size {info.geometry.block_size} != block manager block_size {self.block_size}"
            )
        self.vocab_size = info.vocab_size
        self._cache_instance = info.cache_instance_id  # steps name it: a worker on another cache refuses
        self.stats = EngineStats()
        self.outputs: dict[str, RequestOutput] = {}
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._swapped: collections.deque[_Seq] = collections.deque()
        self._seqs: dict[str, _Seq] = {}
        self._to_free: list[str] = []
        self._pending_ops = pb.CacheOps()
        self._computed: set[int] = set()  # physical blocks holding valid KV
        self._worker_index = 0
        self._step_ids = itertools.count()

    # --- public API -------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> RequestOutput:
        request.validate()
        if request.request_id in self.outputs:
            raise ValueError(f"request {request.request_id!r} was already added")
        if max(request.prompt) >= self.vocab_size or min(request.prompt) < 0:
            raise ValueError(f"request {request.request_id}: token ids must be in [0, {self.vocab_size})")
        total = len(request.prompt) + request.max_tokens
        if -(-total // self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id}: {total} tokens can never fit in {self.num_gpu_blocks} blocks"
            )
        out = RequestOutput(request.request_id, list(request.prompt),
                            [Completion(index=i) for i in range(request.n)])
        self.outputs[request.request_id] = out
        seq = _Seq(f"{request.request_id}/0", request, out, 0, list(request.prompt))
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        self.stats.prompt_tokens += len(request.prompt)
        return out

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
        ops = self._pending_ops
        self._pending_ops = pb.CacheOps()
        self._block_manager_step(ops)
        self._admit()
        batch = self._schedule()
        if not batch:
            if self._pending_ops_nonempty(ops):
                self._pending_ops = ops  # nothing to compute: carry the ops to the next step
            elif self._waiting and not self._running and not self._swapped and not self._to_free:
                head = self._waiting[0]
                raise RuntimeError(
                    f"request {head.request.request_id} cannot be admitted: the pool has no room even "
                    "with nothing running"
                )
            return []
        try:
            return self._run_worker(batch, ops)
        except CacheHostLost:
            if not self.config.recover_lost_cache:
                raise
            self._recover_lost_cache()
            return []

    @staticmethod
    def _pending_ops_nonempty(ops: pb.CacheOps) -> bool:
        return bool(len(ops.copies) or len(ops.swap_out) or len(ops.swap_in))

    def _block_manager_step(self, ops: pb.CacheOps) -> None:
        """One round trip: free finished, reserve slots for new tokens, swap sequences back in."""
        grow = [s for s in self._running if s.needs_slot]
        room = self.config.max_num_seqs - len(self._running)
        swap_in = list(itertools.islice(self._swapped, max(0, room)))
        if not grow and not self._to_free and not swap_in:
            return
        req = pb.StepRequest(
            append_seq_ids=[s.seq_id for s in grow],
            append_token_ids=[s.tokens[-1] for s in grow],
            free_seq_ids=self._to_free,
            swap_in_seq_ids=[s.seq_id for s in swap_in],
        )
        resp = self.bm.step(req, timeout_s=self.config.timeout_s)
        self._to_free = []
        replaced = set(resp.packed_replaced_index)
        seen_replace: set[int] = set()
        for i, block in zip(resp.packed_new_block_index, resp.packed_new_block_ids):
            seq = grow[i]
            self._computed.discard(block)
            if i in replaced and i not in seen_replace:
                seen_replace.add(i)
                seq.block_table[-1] = block
            else:
                seq.block_table.append(block)
        ops.copies.extend(resp.ops.copies)
        ops.swap_out.extend(resp.ops.swap_out)
        ops.swap_in.extend(resp.ops.swap_in)
        for c in resp.ops.copies:
            self._computed.discard(c.dst)
        preempted = self._apply_preemptions(resp.preempted)
        self._apply_swap_ins(resp.swap_ins, swap_in)
        failed: set[int] = set()
        for err in resp.errors:
            if err.seq_id in preempted:
                failed.add(err.index)
                continue  # its own later item: expected after its preemption
            if err.kind == pb.StepItemError.SWAP_IN:
                continue  # no room yet: it stays swapped
            if err.kind != pb.StepItemError.PACKED_APPEND:
                log.warning("step_item_error", kind=err.kind, seq_id=err.seq_id, message=err.message)
                continue
            failed.add(err.index)
            if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                # Nothing left to preempt for it: preempt it ourselves (recompute later).
                self._preempt_self(grow[err.index])
            else:
                raise RuntimeError(f"block manager refused to grow {err.seq_id}: {err.message}")
        for i, s in enumerate(grow):
            if i not in failed and s.status is SeqStatus.RUNNING:
                s.needs_slot = False

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
        for c in (c for r in results for c in r.ops.swap_in):
            self._computed.add(c.dst)  # restored by the swap_in op, which runs before compute

    def _preempt_self(self, seq: _Seq) -> None:
        try:
            self.bm.free(seq.seq_id, timeout_s=self.config.timeout_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        self._requeue(seq)
        self.stats.preempted_recompute += 1
        log.info("preempted", seq_id=seq.seq_id, mode="RECOMPUTE", by="engine")

    def _requeue(self, seq: _Seq) -> None:
        """Back to the front of the queue; everything generated so far becomes its prompt."""
        if seq in self._running:
            self._running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.block_table = []
        seq.num_computed = 0
        seq.needs_slot = False
        self._waiting.appendleft(seq)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            try:
                resp = self.bm.allocate(seq.seq_id, len(seq.tokens), seq.tokens,
                                        priority=seq.request.priority, timeout_s=self.config.timeout_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return
                raise
            self._waiting.popleft()
            seq.block_table = list(resp.block_ids)
            hits = resp.num_cached_tokens // self.block_size
            for b in seq.block_table[hits:]:
                self._computed.discard(b)
            computed_hits = 0
            while computed_hits < hits and seq.block_table[computed_hits] in self._computed:
                computed_hits += 1
            seq.num_computed = computed_hits * self.block_size
            if seq.index == 0 and not seq.output.completions[0].token_ids:
                seq.output.num_cached_tokens = resp.num_cached_tokens
            self.stats.prefix_hit_tokens += seq.num_computed
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)

    def _inflight_blocks(self) -> dict[int, _Seq]:
        """Full blocks that a running sequence will compute in its own prefill."""
        bs = self.block_size
        owners: dict[int, _Seq] = {}
        for s in self._running:
            first = s.num_computed // bs
            last = (len(s.tokens) - 1) // bs  # blocks before the one holding the last token
            for i in range(first, last):
                owners.setdefault(s.block_table[i], s)
        return owners

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """(sequence, number of tokens to compute) for this worker step."""
        budget = self.config.max_batch_tokens
        batch: list[tuple[_Seq, int]] = []
        decode = [s for s in self._running if s.num_computed == len(s.tokens) - 1 and not s.needs_slot]
        for s in decode[:budget]:
            batch.append((s, 1))
        budget -= len(batch)
        owners: dict[int, _Seq] | None = None
        bs = self.block_size
        for s in self._running:
            if s.needs_slot or budget <= 0:
                continue
            self._skip_computed_blocks(s)
            remaining = len(s.tokens) - s.num_computed
            if remaining <= 1:
                continue
            block = s.block_table[s.num_computed // bs]
            if s.num_computed % bs == 0 and block not in self._computed:
                owners = owners if owners is not None else self._inflight_blocks()
                owner = owners.get(block)
                if owner is not None and owner is not s and self._runs_before(owner, s):
                    continue  # another sequence is computing this shared prefix block: wait for it
            chunk = min(remaining, budget)
            batch.append((s, chunk))
            budget -= chunk
        return batch

    def _skip_computed_blocks(self, s: _Seq) -> None:
        """Advance over leading blocks that now hold this sequence's KV (shared prefix
        blocks another sequence finished computing), never past the last token."""
        bs = self.block_size
        while s.num_computed % bs == 0 and s.num_computed + bs < len(s.tokens):
            if s.block_table[s.num_computed // bs] not in self._computed:
                return
            s.num_computed += bs
            self.stats.prefix_hit_tokens += bs

    def _runs_before(self, a: _Seq, b: _Seq) -> bool:
        return self._running.index(a) < self._running.index(b)

    def _run_worker(self, batch: list[tuple[_Seq, int]], ops: pb.CacheOps) -> list[TokenEvent]:
        req = wpb.WorkerStepRequest(ops=ops, request_id=f"step-{next(self._step_ids)}",
                                    cache_instance_id=self._cache_instance)
        for s, k in batch:
            start = s.num_computed
            final = start + k == len(s.tokens)
            sampling = s.request.sampling
            item = req.sequences.add(
                seq_id=s.seq_id,
                token_ids=s.tokens[start : start + k],
                block_ids=s.block_table,
                num_cached_tokens=start,
                return_logits=final and s.request.n > 1 and not s.forked and s.index == 0,
            )
            item.sampling.temperature = sampling.temperature
            item.sampling.top_p = sampling.top_p
            item.sampling.top_k = sampling.top_k
            if s.seed is not None:
                item.sampling.seed = s.seed
        resp = self._call_worker(req)
        events: list[TokenEvent] = []
        bs = self.block_size
        for (s, k), out in zip(batch, resp.outputs):
            s.num_computed += k
            self.stats.computed_tokens += k
            for i in range(s.num_computed // bs):
                self._computed.add(s.block_table[i])
            if s.num_computed < len(s.tokens):
                continue  # a prefill chunk: its sampled token is meaningless
            if s.request.n > 1 and s.index == 0 and not s.forked:
                events.extend(self._fork_samples(s, list(out.logits)))
            events.append(self._accept_token(s, out.token_id, out.logprob))
        return events

    def _call_worker(self, req: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
        """Run the step on a worker; on UNAVAILABLE try the next one (the cache host keeps the KV).
        When every worker that answered says the cache host was lost: CacheHostLost."""
        last: grpc.RpcError | None = None
        lost: list[str] = []
        for attempt in range(len(self.workers)):
            worker = self.workers[(self._worker_index + attempt) % len(self.workers)]
            try:
                resp = worker.step(req, timeout_s=self.config.timeout_s * 4)
                self._worker_index = (self._worker_index + attempt) % len(self.workers)
                return resp
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and (e.details() or "").startswith(
                    CACHE_LOST_PREFIX
                ):
                    lost.append(f"{worker.target}: {e.details()}")
                    continue
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = e
                self.stats.worker_retries += 1
                log.warning("worker_unavailable", worker=worker.target, code=e.code().name)
        if lost:
            raise CacheHostLost(
                f"the cache host was lost, and with it the KV of every sequence ({'; '.join(lost)}). "
                "Restart the cache host and the workers (a worker exits with code 3 after a lost cache host "
                "and re-attaches when restarted), then resubmit the requests, or run the engine with "
                "EngineConfig(recover_lost_cache=True) to wait for a re-attached worker, reset the block "
                "manager's prefix cache and re-prefill every running sequence"
            )
        assert last is not None
        raise last

    def _recover_lost_cache(self) -> None:
        """After CacheHostLost: wait for a worker on a new cache instance, forget all cached KV
        (block manager prefix cache, our computed set, pending ops) and recompute every running and
        swapped sequence from its prompt + generated tokens (the recompute-preemption path)."""
        import time
        import uuid

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
        if victims:
            # One round trip; a sequence the block manager no longer has is simply reported.
            self.bm.step(pb.StepRequest(free_seq_ids=[s.seq_id for s in victims]), timeout_s=self.config.timeout_s)
        self.bm.reset_prefix_cache(request_id=f"reset-{uuid.uuid4().hex}", timeout_s=self.config.timeout_s)
        for s in reversed(victims):  # appendleft: keep their order at the head of the queue
            if s.status is SeqStatus.SWAPPED:
                self._swapped.remove(s)
            self._requeue(s)
        self._computed.clear()
        self._pending_ops = pb.CacheOps()
        self._cache_instance = new
        self.stats.cache_recoveries += 1
        log.warning("cache_recovered", old_cache_instance_id=old, cache_instance_id=new,
                    requeued=len(victims), action="re-prefilling")

    def _fork_samples(self, parent: _Seq, logits: list[float]) -> list[TokenEvent]:
        """n > 1: the other samples share the computed prompt and draw their own first token."""
        import torch

        from worker_svc.model.sampling import SamplingParams, sample

        parent.forked = True
        opts = parent.request.sampling
        events = []
        row = torch.tensor(logits, dtype=torch.float32)
        for i in range(1, parent.request.n):
            child = _Seq(f"{parent.request.request_id}/{i}", parent.request, parent.output, i,
                         list(parent.tokens), status=SeqStatus.RUNNING, forked=True)
            seed = None if opts.seed is None else opts.seed + i
            params = SamplingParams(opts.temperature, opts.top_p, opts.top_k, seed)
            res = sample(row[None, :], [params], [len(parent.tokens)])
            fork = self.bm.fork(parent.seq_id, child.seq_id, timeout_s=self.config.timeout_s)
            child.block_table = list(fork.block_ids)
            child.num_computed = parent.num_computed
            self._seqs[child.seq_id] = child
            self._running.append(child)
            events.append(self._accept_token(child, int(res.token_ids[0]), float(res.logprobs[0])))
        return events

    def _accept_token(self, s: _Seq, token: int, logprob: float) -> TokenEvent:
        c = s.completion
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
        return TokenEvent(s.request.request_id, s.index, token, logprob, reason)

    def flush(self) -> None:
        """Free what finished in the last step (also done at the start of the next step)."""
        if self._to_free:
            self._block_manager_step(pb.CacheOps())
