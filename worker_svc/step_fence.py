"""Which steps this worker is running, and which it must never start: the worker's half of fencing.

Why: an engine that got no answer from this worker in time (it was paused, or its link was silent)
runs the step on another worker and goes on. This worker may still be running that step, or may
not even have started it (the request can sit in a socket buffer through a pause), and its KV
writes land whenever it gets to them. The engine therefore keeps the step's blocks from being
reused, and asks (the ``Fence`` RPC) until the answer shows the step is not running. For that
answer to stay true, a fenced step must never start afterwards: ``fence`` and ``begin`` take the
same lock, so a step either began before the fence (and is reported running until it ends) or is
refused. (Docs: docs/reliability.md, "Fencing a paused worker's late writes".)
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable


class StepFence:
    """Steps in flight and fenced step ids, by request id (bounded: the oldest fenced ids go first)."""

    def __init__(self, remember: int = 65_536) -> None:
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()
        self._fenced: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def begin(self, request_id: str) -> bool:
        """A step starts; False (and nothing recorded) when its id was fenced."""
        with self._lock:
            if request_id in self._fenced:
                return False
            self._running[request_id] += 1
            return True

    def end(self, request_id: str) -> None:
        with self._lock:
            left = self._running[request_id] - 1
            if left > 0:
                self._running[request_id] = left
            else:
                del self._running[request_id]

    def fence(self, request_ids: Iterable[str]) -> list[str]:
        """Refuse these steps from now on; return those of them running now."""
        with self._lock:
            running = []
            for rid in request_ids:
                if not rid:
                    continue  # a step without an id cannot be named, so it cannot be fenced
                self._fenced[rid] = None
                self._fenced.move_to_end(rid)
                if rid in self._running:
                    running.append(rid)
            while len(self._fenced) > self._remember:
                self._fenced.popitem(last=False)
            return running

    def running(self) -> list[str]:
        with self._lock:
            return list(self._running)
