"""Deadlines and retries for unary gRPC calls: the one retry rule of every pagedkv client
(the frontend's clients, and a role waiting for its peers at start-up, worker_svc/peers.py).

Why a client-side loop and not gRPC's service-config retry policy: the service
config is static per method, so it can only say "retry Append" or "never retry
Append". Our rule depends on the request: a mutation (Allocate, Append, Fork,
Free, Step, KeepAlive, SwapIn, Preempt) may only be retried when the caller gave
it a ``request_id``: the server deduplicates by request id (docs/reliability.md) and answers
a repeat with the first reply, while a retry without one, of a request the
server already applied, would apply it twice. Reads (GetBlockTable,
GetStats, GetConfig, health) are always safe to retry. The same loop serves the
sync and the asyncio clients and any future stub (the worker client) through
:func:`call_with_retry` / :func:`async_call_with_retry`.

Semantics (the same as gRPC's retry design, gRFC A6):

* Only ``UNAVAILABLE`` is retried (the server was not reached or went away).
  ``DEADLINE_EXCEEDED`` is not: the deadline covers the whole call, all
  attempts and backoff sleeps included.
* Attempt ``n`` (n >= 1 failed attempts so far) sleeps
  ``uniform(0, min(initial_backoff * multiplier**(n-1), max_backoff))``
  ("full jitter"), so clients that failed together do not retry together.
* At most ``max_attempts`` attempts; a sleep that would run past the deadline
  is not taken and the last error is raised instead.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter. ``max_attempts=1`` disables retries."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    retryable_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")

    def backoff_s(self, failed_attempts: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep after ``failed_attempts`` (>= 1) failures."""
        cap = min(self.initial_backoff_s * self.multiplier ** (failed_attempts - 1), self.max_backoff_s)
        return (rng or random).uniform(0.0, cap)


NO_RETRY = RetryPolicy(max_attempts=1)


class Attempts:
    """The retry rule's state for one call, shared by the sync and the asyncio loop: the
    deadline over all attempts, the attempt count, and the pause before the next attempt."""

    __slots__ = ("policy", "retry_allowed", "deadline", "attempt")

    def __init__(self, policy: RetryPolicy, timeout_s: float | None, retry_allowed: bool) -> None:
        self.policy = policy
        self.retry_allowed = retry_allowed
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.attempt = 0

    def next_timeout(self) -> float | None:
        """Start an attempt: the time left to the overall deadline (None: no deadline)."""
        self.attempt += 1
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def pause_after(self, err: grpc.RpcError) -> float | None:
        """Seconds to sleep before retrying after `err`, or None: give up and raise it."""
        policy = self.policy
        if not self.retry_allowed or self.attempt >= policy.max_attempts:
            return None
        code = err.code() if hasattr(err, "code") else None
        if code not in policy.retryable_codes:
            return None
        pause = policy.backoff_s(self.attempt)
        if self.deadline is not None and time.monotonic() + pause >= self.deadline:
            return None
        return pause


def call_with_retry(
    method: Callable[..., T],
    request: Any,
    *,
    timeout_s: float | None,
    policy: RetryPolicy,
    retry_allowed: bool,
    metadata: Metadata | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call a sync unary stub method with an overall deadline and the retry rule above."""
    attempts = Attempts(policy, timeout_s, retry_allowed)
    while True:
        try:
            return method(request, timeout=attempts.next_timeout(), metadata=metadata)
        except grpc.RpcError as err:
            pause = attempts.pause_after(err)
            if pause is None:
                raise
            sleep(pause)


async def async_call_with_retry(
    method: Callable[..., Awaitable[T]],
    request: Any,
    *,
    timeout_s: float | None,
    policy: RetryPolicy,
    retry_allowed: bool,
    metadata: Metadata | None = None,
) -> T:
    """The asyncio form of :func:`call_with_retry` (``method`` is a grpc.aio stub method)."""
    attempts = Attempts(policy, timeout_s, retry_allowed)
    while True:
        try:
            return await method(request, timeout=attempts.next_timeout(), metadata=metadata)
        except grpc.RpcError as err:
            pause = attempts.pause_after(err)
            if pause is None:
                raise
            await asyncio.sleep(pause)
