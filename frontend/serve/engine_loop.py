"""The one thread that owns the engine of `pagedkv serve`.

The engine is not thread-safe and its `step()` blocks on gRPC, so it never runs on the HTTP event
loop. Requests and aborts arrive through one thread-safe queue; the thread drains it between
iterations (so an abort frees a request's blocks in the very next block-manager round trip), steps
the engine while it has work, and hands every token to the request's sink (a callable that is safe
to call from this thread: the server's sinks put into the request's ``Inbox``, frontend/serve/inbox.py,
which wakes the event loop at most once for everything that arrived since it last looked).

A block manager that is unreachable is the engine's to ride out (it retries within
``EngineConfig.block_manager_outage_s``); past that budget the engine raises
``BlockManagerUnavailable`` and this loop ends the requests in flight with 503, refuses new ones
at once (``unavailable``; /health says not ready) and probes the manager every ``idle_wait_s``
until it answers; the failed requests' blocks are freed in the first Step that gets through.
Any other failed iteration fails the requests in flight (the engine's state may be inconsistent).
It also feeds the metrics: TTFT, time per output token, end-to-end
latency, waiting/running requests and how many requests got a token in each iteration.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pagedkv.frontend.engine import (
    BlockManagerUnavailable,
    Engine,
    GenerationRequest,
    PromptLogprob,
    TokenEvent,
)
from pagedkv.frontend.serve.metrics import ServeMetrics

log = structlog.get_logger("pagedkv.serve.loop")

Sink = Callable[[object], None]


@dataclass(slots=True, frozen=True)
class Admitted:
    """The engine accepted the request (first item a sink receives on success)."""


@dataclass(slots=True, frozen=True)
class Failed:
    """The request ended with an error; ``status`` is the HTTP status to answer with."""

    status: int
    message: str


@dataclass(slots=True, frozen=True)
class Finished:
    """Every sample finished; the last item a sink receives."""

    finish_reasons: tuple[str, ...]
    num_cached_tokens: int
    # GenerationRequest.prompt_logprobs: the prompt's scores (RequestOutput.prompt_logprobs).
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


@dataclass(slots=True)
class _Submit:
    request: GenerationRequest
    sink: Sink
    arrival: float


@dataclass(slots=True)
class _Abort:
    request_id: str
    index: int | None
    reason: str


@dataclass(slots=True)
class _Tracked:
    sink: Sink
    arrival: float
    prompt_len: int
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    done: bool = False


class EngineLoop:
    """Owns ``engine``; call ``start()``, then ``submit``/``abort`` from any thread."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServeMetrics,
        idle_wait_s: float = 0.5,
        on_iteration: Callable[[Engine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_iteration = on_iteration  # e.g. `pagedkv demo` sampling the block tables every iteration
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._to_release: list[str] = []
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet handed to the engine
        self._engine_waiting = 0
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine-loop", daemon=True)
        self.error: BaseException | None = None
        # Why requests are refused right now (the block manager stayed unreachable past its budget).
        self.unavailable: str | None = None

    # --- any thread -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def num_waiting(self) -> int:
        """Requests not yet holding blocks: queued here plus waiting in the engine."""
        with self._lock:
            return self._queued + self._engine_waiting

    def submit(self, request: GenerationRequest, sink: Sink, arrival: float | None = None) -> None:
        with self._lock:
            self._queued += 1
        self._commands.put(_Submit(request, sink, time.monotonic() if arrival is None else arrival))

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Finish a request (client gone) or one sample (a stop string matched)."""
        self._commands.put(_Abort(request_id, index, reason))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort everything in flight, free it, and end the thread."""
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self._stop.is_set():
                    break
                if self.unavailable is not None:
                    if self.engine.block_manager_reachable():
                        log.warning("block_manager_back", action="accepting requests")
                        self.unavailable = None
                    else:
                        self._stop.wait(self._idle_wait_s)
                    continue
                if self.engine.has_work():
                    self._step()
                self._after_iteration()
        except BaseException as e:  # noqa: BLE001 - reported to every request, then the thread ends
            self.error = e
            log.error("engine_loop_died", error=repr(e))
            self._fail_all(503, f"the engine stopped: {e}")
            return
        self._shutdown()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            if isinstance(cmd, _Submit):
                self._admit(cmd)
            else:
                self._abort(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
        self._stop.set()  # None: the stop sentinel

    def _admit(self, cmd: _Submit) -> None:
        rid = cmd.request.request_id
        if self.unavailable is not None:
            with self._lock:
                self._queued -= 1
            self._send(cmd.sink, Failed(503, self.unavailable))
            return
        # Counted as waiting in the engine in the same breath as it leaves the queue: between the
        # two counts num_waiting() would read one short and let max_waiting be exceeded.
        with self._lock:
            self._queued -= 1
            self._engine_waiting += 1
        try:
            self.engine.add_request(cmd.request)
        except ValueError as e:
            with self._lock:
                self._engine_waiting -= 1
            self._send(cmd.sink, Failed(400, str(e)))
            return
        self._tracked[rid] = _Tracked(cmd.sink, cmd.arrival, len(cmd.request.prompt))
        self._send(cmd.sink, Admitted())

    def _abort(self, cmd: _Abort) -> None:
        t = self._tracked.get(cmd.request_id)
        if t is None or t.done:
            return
        self.engine.abort_request(cmd.request_id, cmd.index, cmd.reason)
        if cmd.index is None:
            t.done = True  # nobody listens any more: no Finished
            self._to_release.append(cmd.request_id)
            self.metrics.observe_abort()
            log.info("request_aborted", request_id=cmd.request_id, reason=cmd.reason)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except BlockManagerUnavailable as e:
            log.error(
                "block_manager_unavailable",
                error=str(e),
                action="failing requests in flight, refusing new ones",
            )
            self.unavailable = f"the block manager is unreachable: {e}"
            self._fail_all(503, self.unavailable)
            return
        except Exception as e:  # noqa: BLE001 - a failed iteration fails its requests, not the server
            log.error("engine_step_failed", error=repr(e))
            self._fail_all(503, f"engine iteration failed: {e}")
            time.sleep(0.2)  # a block manager or worker that is down: do not spin on it
            return
        # Published before any client sees this step's tokens: a client answered by them may send
        # its next request at once, and the step may have started what was waiting.
        self._count()
        now = time.monotonic()
        requests: set[str] = set()
        for ev in events:
            requests.add(ev.request_id)
            self._on_token(ev, now)
        self.metrics.observe_iteration(len(requests), len(events))
        if self._on_iteration is not None:
            self._on_iteration(self.engine)

    def _on_token(self, ev: TokenEvent, now: float) -> None:
        t = self._tracked.get(ev.request_id)
        if t is None or t.done:
            return
        if t.first_token is None:
            t.first_token = now
            self.metrics.observe_ttft(now - t.arrival)
        prev = t.last_token.get(ev.index)
        if prev is not None:
            self.metrics.observe_tpot(now - prev)
        t.last_token[ev.index] = now
        self._send(t.sink, ev)

    def _after_iteration(self) -> None:
        outputs = self.engine.outputs
        for rid, t in self._tracked.items():
            if t.done:
                continue
            out = outputs.get(rid)
            if out is None or not out.finished:
                continue
            t.done = True
            reasons = tuple(c.finish_reason or "abort" for c in out.completions)
            end = max(t.last_token.values(), default=time.monotonic())
            self.metrics.observe_finished(end - t.arrival, t.prompt_len, out.num_cached_tokens, list(reasons))
            scores = None if out.prompt_logprobs is None else tuple(out.prompt_logprobs)
            self._send(t.sink, Finished(reasons, out.num_cached_tokens, scores))
            self._to_release.append(rid)
        if self._to_release:
            kept = []
            for rid in self._to_release:
                if self.engine.release_request(rid):
                    self._tracked.pop(rid, None)
                else:
                    kept.append(rid)
            self._to_release = kept
        waiting, running = self._count()
        with self._lock:
            queued = self._queued
        self.metrics.set_queues(waiting + queued, running)

    def _count(self) -> tuple[int, int]:
        """The engine's (waiting, running) requests; its waiting count is what num_waiting() reads."""
        waiting, running = self.engine.num_requests()
        with self._lock:
            self._engine_waiting = waiting
        return waiting, running

    def _fail_all(self, status: int, message: str) -> None:
        for rid, t in list(self._tracked.items()):
            if not t.done:
                t.done = True
                self._send(t.sink, Failed(status, message))
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001 - best effort; the lease (if any) frees the rest
                    pass
                self._to_release.append(rid)

    def _shutdown(self) -> None:
        """Fail what is still queued or running and free its blocks before the thread ends."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                self._send(cmd.sink, Failed(503, "the server is shutting down"))
        self._fail_all(503, "the server is shutting down")
        try:
            self.engine.close()  # frees every sequence it holds and ends its lease
        except Exception as e:  # noqa: BLE001 - the lease frees them when it expires
            log.warning("shutdown_free_failed", error=repr(e))

    @staticmethod
    def _send(sink: Sink, item: object) -> None:
        try:
            sink(item)
        except RuntimeError:  # the event loop of that request is gone
            pass
