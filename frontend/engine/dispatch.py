"""Which worker runs what, and running it on several workers at once.

All workers attach to one KV cache, so any worker can run any sequence's step: the split is only
about compute. The rules:

- Roles (``pagedkv worker --role``, reported in ``GetWorkerInfo``): decode steps go to workers that
  are not prefill-only, prefill chunks to workers that are not decode-only. When no live worker of
  the wanted kind is left, every live worker is a candidate (failover beats role purity: a dead
  decode worker's share runs on the prefill worker, outputs stay exact).
- ``disaggregated()``: the live prefill set and decode set are disjoint (e.g. one prefill and one
  decode worker). The engine then runs two independent pipelines (frontend/engine/engine.py), so a decode
  step never waits for a prefill chunk.
- Otherwise the iteration's sequences are split across the candidates, balanced by tokens (longest
  first onto the least loaded worker), and the calls run in parallel threads (gRPC releases the
  GIL while it waits).
- Cache ops (copy-on-write copies, swaps) must finish before any step that reads their blocks, and
  the workers of one iteration run concurrently: with more than one part, the ops go first as an
  ops-only step on one worker.
- A worker that answers UNAVAILABLE / DEADLINE_EXCEEDED (dead, or hung: its channel's keepalive
  closes a connection whose pings go unanswered, frontend/clients/worker.py) is benched and its part
  is re-run on the next candidate (a step only rewrites the KV of its own tokens with the same
  values, so a re-run is safe). The unanswered step is fenced (frontend/engine/fencing.py): the
  worker may still run it, so its sequences' blocks are not freed until the worker says it runs
  no such step, or nothing listens at its address any more. A benched worker is taken back when
  it answers again: a thread probes it (GetWorkerInfo, ``probe_timeout_s``) every
  ``probe_interval_s``. With every worker benched, all are tried again, with backoff, for up to
  ``outage_s``: the requests wait for one to return (a supervisor restarts a dead one) rather than
  fail.
  FAILED_PRECONDITION with the CACHE_HOST_LOST error detail
  (pagedkv/errors.py) from every worker tried is
  ``CacheLostEverywhere``, which the engine turns into ``CacheHostLost``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import structlog

from pagedkv import errors
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine.fencing import Fences
from pagedkv.v1 import worker_pb2 as wpb

log = structlog.get_logger("pagedkv.dispatch")

PREFILL, DECODE, MIXED = wpb.WORKER_ROLE_PREFILL, wpb.WORKER_ROLE_DECODE, wpb.WORKER_ROLE_MIXED


class CacheLostEverywhere(RuntimeError):
    """Every worker tried said its cache host was lost; ``details`` lists them."""

    def __init__(self, details: list[str]) -> None:
        super().__init__("; ".join(details))
        self.details = details


@dataclass(slots=True, eq=False)
class WorkerSlot:
    client: WorkerClient
    role: int = MIXED
    benched: bool = False  # it failed a step; skipped until it answers a probe
    busy_s: float = 0.0  # time inside Step calls, for utilisation figures
    steps: int = 0

    @property
    def target(self) -> str:
        return self.client.target

    def alive(self) -> bool:
        return not self.benched


@dataclass(slots=True)
class DispatchStats:
    retries: int = 0
    ops_only_steps: int = 0
    parallel_steps: int = 0


@dataclass(slots=True)
class WorkerPool:
    """The engine's workers with their roles; splits work and runs it, with failover."""

    slots: list[WorkerSlot]
    timeout_s: float = 120.0
    outage_s: float = 60.0  # every worker unreachable this long: the step fails
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 1.0
    stats: DispatchStats = field(default_factory=DispatchStats)
    fences: Fences = field(default_factory=Fences)
    _executor: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _prober: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_clients(
        cls,
        clients: Sequence[WorkerClient],
        infos: Sequence[wpb.WorkerInfo | None],
        timeout_s: float = 120.0,
        outage_s: float = 60.0,
    ) -> WorkerPool:
        slots = [
            WorkerSlot(c, (i.role if i is not None and i.role else MIXED))
            for c, i in zip(clients, infos, strict=False)
        ]
        return cls(slots, timeout_s=timeout_s, outage_s=outage_s)

    # -------------------------------------------------------------- who does what
    def _alive(self) -> list[WorkerSlot]:
        alive = [s for s in self.slots if s.alive()]
        return alive or list(self.slots)  # all benched: try them all again rather than give up

    def bench(self, slot: WorkerSlot, reason: str) -> None:
        """Take a worker that did not answer out of the pool until it answers a probe."""
        with self._lock:
            if not slot.benched:
                slot.benched = True
                log.warning("worker_benched", worker=slot.target, reason=reason)
        self._ensure_prober()

    def _ensure_prober(self) -> None:
        with self._lock:
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe_loop, name="worker-probe", daemon=True)
                self._prober.start()

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval_s):
            for client in self.fences.clients():
                try:
                    self.fences.check(client, self.probe_timeout_s)
                except ValueError:  # its channel was closed: the engine is shutting down
                    return
            for slot in [s for s in self.slots if s.benched]:
                try:
                    slot.client.get_info(timeout_s=self.probe_timeout_s)
                except grpc.RpcError:
                    continue
                except ValueError:  # its channel was closed: the engine is shutting down
                    return
                slot.benched = False
                log.warning("worker_back", worker=slot.target)

    def workers(self) -> list[WorkerSlot]:
        """Every live worker (all of them when every one is benched)."""
        return self._alive()

    def decode_workers(self) -> list[WorkerSlot]:
        alive = self._alive()
        return [s for s in alive if s.role != PREFILL] or alive

    def prefill_workers(self) -> list[WorkerSlot]:
        alive = self._alive()
        return [s for s in alive if s.role != DECODE] or alive

    def disaggregated(self) -> bool:
        """Prefill and decode run on disjoint live workers: two independent pipelines."""
        p, d = self.prefill_workers(), self.decode_workers()
        return bool(p and d) and not (set(map(id, p)) & set(map(id, d)))

    @staticmethod
    def split(costs: Sequence[int], n: int) -> list[list[int]]:
        """Indices of ``costs`` in ``n`` groups of near-equal total (longest first onto the lightest)."""
        groups: list[list[int]] = [[] for _ in range(n)]
        loads = [0] * n
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            g = min(range(n), key=lambda j: (loads[j], j))
            groups[g].append(i)
            loads[g] += costs[i]
        return [sorted(g) for g in groups if g]

    # -------------------------------------------------------------- running steps
    def step(self, req: wpb.WorkerStepRequest, workers: Sequence[WorkerSlot]) -> wpb.WorkerStepResponse:
        """Split ``req``'s sequences over ``workers`` by tokens, run the parts at once, merge the
        outputs back into request order."""
        seqs = list(req.sequences)
        n = min(len(workers), len(seqs)) if seqs else 1
        if n <= 1:
            return self.call(req, workers)
        has_ops = bool(len(req.ops.copies) or len(req.ops.swap_out) or len(req.ops.swap_in))
        if has_ops:
            self.call(
                wpb.WorkerStepRequest(
                    ops=req.ops, request_id=f"{req.request_id}-ops", cache_instance_id=req.cache_instance_id
                ),
                workers,
                holds=[s.seq_id for s in seqs],  # the ops' blocks belong to the step's sequences
            )
            self.stats.ops_only_steps += 1
        groups = self.split([len(s.token_ids) for s in seqs], n)
        parts: list[wpb.WorkerStepRequest] = []
        for j, g in enumerate(groups):
            part = wpb.WorkerStepRequest(
                request_id=f"{req.request_id}.{j}", cache_instance_id=req.cache_instance_id
            )
            part.sequences.extend(seqs[i] for i in g)
            parts.append(part)
        order = list(workers)
        futures = [self.submit(p, order[j:] + order[:j]) for j, p in enumerate(parts)]
        self.stats.parallel_steps += 1
        resps = [f.result() for f in futures]
        out = wpb.WorkerStepResponse()
        by_index: dict[int, wpb.SequenceOutput] = {}
        for g, r in zip(groups, resps, strict=True):
            for i, o in zip(g, r.outputs, strict=False):
                by_index[i] = o
            out.num_tokens += r.num_tokens
            out.forward_ms = max(out.forward_ms, r.forward_ms)
            out.cache_ops_ms += r.cache_ops_ms
        out.outputs.extend(by_index[i] for i in range(len(seqs)))
        return out

    def submit_step(
        self, req: wpb.WorkerStepRequest, workers: Sequence[WorkerSlot]
    ) -> Future[wpb.WorkerStepResponse]:
        """``step`` on a pool thread (the engine's prefill pipeline): the caller goes on decoding."""
        return self._pool().submit(self.step, req, workers)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                # A step thread, its parts, and the decode pipeline's parts can all be running.
                self._executor = ThreadPoolExecutor(
                    max_workers=2 * len(self.slots) + 4, thread_name_prefix="worker-call"
                )
            return self._executor

    def submit(
        self, req: wpb.WorkerStepRequest, workers: Sequence[WorkerSlot]
    ) -> Future[wpb.WorkerStepResponse]:
        """``call`` on a pool thread: the caller goes on while the worker computes."""
        return self._pool().submit(self.call, req, workers)

    def call(
        self,
        req: wpb.WorkerStepRequest,
        workers: Sequence[WorkerSlot],
        holds: Sequence[str] | None = None,
    ) -> wpb.WorkerStepResponse:
        """One step on the first of ``workers`` that answers, then on any other live worker.

        A worker that did not answer may still run the step: it is fenced, holding the blocks of
        ``holds`` (default: the step's sequences) until that worker is known not to run it."""
        first_failure: float | None = None
        backoff = 0.05
        attempt = req
        for n in itertools.count(1):
            try:
                return self._call_once(attempt, workers, holds)
            except grpc.RpcError as e:
                # Every worker was unreachable: wait for one to come back, within the outage budget.
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                    log.warning("no_worker_answers", request_id=req.request_id, outage_s=self.outage_s)
                if now - first_failure >= self.outage_s or self._closed.is_set():
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                # A new request id for the next pass: the one tried is fenced (a worker that comes
                # back refuses to start it), and the next pass is a new attempt at the same step.
                attempt = wpb.WorkerStepRequest()
                attempt.CopyFrom(req)
                attempt.request_id = f"{req.request_id}-retry{n}"
        raise AssertionError("unreachable")

    def _call_once(
        self, req: wpb.WorkerStepRequest, workers: Sequence[WorkerSlot], holds: Sequence[str] | None
    ) -> wpb.WorkerStepResponse:
        """One pass over the candidates: the first that answers, else the last UNAVAILABLE /
        DEADLINE_EXCEEDED error (or CacheLostEverywhere)."""
        tried: set[int] = set()
        lost: list[str] = []
        last: grpc.RpcError | None = None
        candidates = list(workers) + [s for s in self._alive() if s not in workers]
        candidates += [s for s in self.slots if s not in candidates]
        for slot in candidates:
            if id(slot) in tried:
                continue
            tried.add(id(slot))
            t0 = time.perf_counter()
            try:
                resp = slot.client.step(req, timeout_s=self.timeout_s)
            except grpc.RpcError as e:
                if errors.reason_of(e) == errors.CACHE_HOST_LOST:
                    lost.append(f"{slot.target}: {e.details()}")
                    continue
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = e
                self.stats.retries += 1
                self.fences.note(
                    slot.client,
                    req.request_id,
                    holds if holds is not None else [s.seq_id for s in req.sequences],
                )
                self.bench(slot, e.code().name)
                continue
            slot.busy_s += time.perf_counter() - t0
            slot.steps += 1
            return resp
        if lost:
            raise CacheLostEverywhere(lost)
        assert last is not None
        raise last

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
