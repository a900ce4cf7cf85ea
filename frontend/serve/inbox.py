"""Items from the engine thread to one request's coroutine, with at most one loop wake-up pending.

The engine thread hands every running request a token per iteration. Waking the event loop for
each one (``call_soon_threadsafe`` writes the loop's self-pipe and schedules a callback, and
``asyncio.wait_for`` then builds a task per item) costs more CPU than formatting the token's SSE
chunk, on the same cores the worker computes on. Here the producer appends to a deque (atomic in
CPython) and schedules a wake-up only when none is pending; the consumer drains everything that
arrived before awaiting again.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """One producer thread, one consumer coroutine on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[T] = collections.deque()
        self._ready = asyncio.Event()
        self._wake_pending = False

    def put(self, item: T) -> None:
        """From any thread (or the loop itself)."""
        self._items.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending = False  # cleared before the set: a later put schedules its own wake-up
        self._ready.set()

    async def get(self, timeout_s: float | None = None) -> T:
        """The next item, in order; TimeoutError after ``timeout_s`` without one."""
        while not self._items:
            self._ready.clear()
            if self._items:
                break
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)
