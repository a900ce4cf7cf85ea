"""Request-id deduplication: a retried mutation returns the original result.

Rules (documented in docs/reliability.md):

* Only *successful* replies are remembered (the whole reply, serialized; for Step that
  includes per-item errors, because the Step itself succeeded). A request
  that failed as a whole changed nothing (the core is all-or-nothing), so a
  retry of it is evaluated again and may now succeed.
* A retry that arrives while the original is still being processed waits for
  it (up to its own deadline) and then returns the remembered reply, or, if
  the original failed, is evaluated itself.
* A request id reused for a different method or a different request body is
  refused with INVALID_ARGUMENT (the body is compared by a BLAKE2b digest of
  the serialized request).
* The window is bounded: at most ``max_entries`` ids (oldest dropped first)
  and none older than ``ttl_s`` seconds (wall clock, so ages survive a
  restart). A retry after its entry left the window is treated as new.
* Entries are created under the state lock in apply order, together with the
  journal record, and are rebuilt by journal replay on restart.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def digest(method: str, body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16, person=method.encode()[:16]).digest()


@dataclass(slots=True)
class Entry:
    method: str
    digest: bytes
    response: bytes
    wall_time: float


class RequestIdReused(Exception):
    def __init__(self, request_id: str, method: str, previous: str) -> None:
        what = "a different request body" if method == previous else f"another method ({previous})"
        super().__init__(
            f"request_id {request_id!r} was already used for {what}; "
            f"a retry must repeat the original {previous} request exactly"
        )


class WaitTimeout(Exception):
    pass


class DedupeTable:
    def __init__(self, max_entries: int = 100_000, ttl_s: float = 600.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._inflight: set[str] = set()
        self._cv = threading.Condition(threading.Lock())
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, request_id: str, method: str, dig: bytes, timeout: float | None) -> Any | None:
        """The remembered reply for a retry, or None if the caller now owns `request_id`.

        A caller that gets None must call :meth:`end` when done (success or not).
        """
        cv = self._cv
        with cv:
            while True:
                e = self._entries.get(request_id)
                if e is not None:
                    if time.time() - e.wall_time > self.ttl_s:
                        del self._entries[request_id]
                    else:
                        if e.method != method or e.digest != dig:
                            raise RequestIdReused(request_id, method, e.method)
                        self.hits += 1
                        return e.response
                if request_id not in self._inflight:
                    self._inflight.add(request_id)
                    return None
                if not cv.wait(timeout):
                    raise WaitTimeout(f"the original request {request_id!r} is still in progress")

    def put(self, request_id: str, method: str, dig: bytes, response: Any, wall_time: float) -> None:
        """Remember a successful reply (under the state lock, in apply order)."""
        entries = self._entries
        with self._cv:
            entries.pop(request_id, None)
            entries[request_id] = Entry(method, dig, response, wall_time)
            self._prune(wall_time)

    def end(self, request_id: str) -> None:
        with self._cv:
            self._inflight.discard(request_id)
            self._cv.notify_all()

    def _prune(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        cutoff = now - self.ttl_s
        while entries:
            first = next(iter(entries.values()))
            if first.wall_time >= cutoff:
                break
            entries.popitem(last=False)

    # --- snapshots ----------------------------------------------------------------
    def export(self) -> list[tuple[str, str, bytes, Any, float]]:
        with self._cv:
            self._prune(time.time())
            return [(k, e.method, e.digest, e.response, e.wall_time) for k, e in self._entries.items()]

    def restore(self, items: list[tuple[str, str, bytes, Any, float]]) -> None:
        with self._cv:
            self._entries.clear()
            for k, m, d, r, t in items:
                self._entries[k] = Entry(m, d, r, t)
            self._prune(time.time())
