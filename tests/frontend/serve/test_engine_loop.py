"""The engine loop's bookkeeping, against a scripted engine (no server, no workers)."""

from __future__ import annotations

import threading
from typing import Any

from pagedkv.frontend.engine import GenerationRequest, TokenEvent
from pagedkv.frontend.serve.engine_loop import EngineLoop
from pagedkv.frontend.serve.metrics import ServeMetrics


class _HeldEngine:
    """Admits requests, schedules none until ``run_one`` is set (then one a step, which makes one
    token), and records num_waiting() at every step."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.run_one = False
        self.loop: EngineLoop | None = None
        self.seen_at_step: list[int] = []
        self.stepped = threading.Event()
        self.outputs: dict[str, Any] = {}

    def add_request(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise ValueError("empty prompt")
        self.waiting.append(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting) and (self.run_one or not self.seen_at_step)

    def step(self) -> list[Any]:
        assert self.loop is not None
        self.seen_at_step.append(self.loop.num_waiting())
        self.stepped.set()
        if not (self.run_one and self.waiting):
            return []
        rid = self.waiting.pop(0)
        self.running.append(rid)
        return [TokenEvent(rid, 0, 7, 0.0, None)]

    def num_requests(self) -> tuple[int, int]:
        return len(self.waiting), len(self.running)

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        for queue in (self.waiting, self.running):
            if request_id in queue:
                queue.remove(request_id)

    def close(self) -> None:
        self.waiting.clear()
        self.running.clear()

    def release_request(self, request_id: str) -> bool:
        return True

    def block_manager_reachable(self) -> bool:
        return True


def test_a_request_handed_to_the_engine_is_still_counted_waiting_before_the_next_step() -> None:
    # The server refuses past max_waiting by num_waiting(): a request between leaving the loop's
    # queue and the engine's next count must not read as zero, or a burst slips past the limit.
    engine = _HeldEngine()
    loop = EngineLoop(engine, ServeMetrics("m", lambda: None), idle_wait_s=0.01)  # type: ignore[arg-type]
    engine.loop = loop
    replies: list[object] = []
    loop.start()
    try:
        loop.submit(GenerationRequest("bad", []), replies.append)  # refused: counts nowhere
        loop.submit(GenerationRequest("a", [1, 2]), replies.append)
        assert engine.stepped.wait(10)
        assert engine.seen_at_step[0] == 1
        assert loop.num_waiting() == 1
        assert [type(r).__name__ for r in replies] == ["Failed", "Admitted"]
    finally:
        loop.stop()


def test_a_request_the_step_started_no_longer_counts_waiting_when_its_client_sees_its_token() -> None:
    # A client answered by a request's first token may send the next one at once: the count it then
    # meets must already say that the step started the first (it did not before the loop's refresh).
    engine = _HeldEngine()
    loop = EngineLoop(engine, ServeMetrics("m", lambda: None), idle_wait_s=0.01)  # type: ignore[arg-type]
    engine.loop = loop
    seen: list[tuple[str, int]] = []
    got_token = threading.Event()

    def sink(item: object) -> None:
        seen.append((type(item).__name__, loop.num_waiting()))
        if isinstance(item, TokenEvent):
            got_token.set()

    loop.start()
    try:
        loop.submit(GenerationRequest("a", [1, 2]), sink)
        assert engine.stepped.wait(10)
        engine.run_one = True
        assert got_token.wait(10)
        assert seen == [("Admitted", 1), ("TokenEvent", 0)]
    finally:
        loop.stop()
