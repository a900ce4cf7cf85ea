"""Reaching the other roles at start-up: the block manager and the cache host.

Why wait rather than fail: in a deployment the roles start in any order. A cache host or worker
started before its peer logs one ``waiting_for_<peer>`` line per attempt (address, attempt, the
gRPC status of the last try, when it retries) and carries on as soon as the peer answers. After
``timeout_s`` it gives up with an error that names the peer's address and the last status, so a
wrong ``--block-manager`` / ``--cache-host`` is obvious. Statuses that retrying cannot fix
(UNAUTHENTICATED, PERMISSION_DENIED, ...) end the wait at once. Every call goes through the role's
:class:`pagedkv.dial.Dialer` (TLS, client certificate, bearer token).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import structlog

from pagedkv.dial import PLAIN, Dialer
from pagedkv.retry import Attempts, RetryPolicy
from pagedkv.v1 import block_manager_pb2, block_manager_pb2_grpc, cache_host_pb2, cache_host_pb2_grpc
from pagedkv.worker_svc.geometry import PoolConfig, fetch_pool_config

log = structlog.get_logger("pagedkv.worker_svc")

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
ATTEMPT_TIMEOUT_S = 5.0
# Until the deadline (or forever), backoff from 0.2 s doubling up to 5 s, with jitter.
PEER_RETRY = RetryPolicy(
    max_attempts=sys.maxsize, initial_backoff_s=0.2, max_backoff_s=5.0, retryable_codes=frozenset(RETRYABLE)
)


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived before the peer answered."""


class PeerUnreachable(ConnectionError):
    """The peer refused the call for a reason retrying cannot fix (bad token, TLS, ...)."""


def wait_for(
    peer: str, target: str, call: Callable[[float], T], timeout_s: float, stop: threading.Event | None = None
) -> T:
    """``call(attempt_timeout_s)`` retried with backoff (pagedkv/retry.py's rule, :data:`PEER_RETRY`)
    until it answers or ``timeout_s`` passes (0 = forever)."""
    attempts = Attempts(PEER_RETRY, None if timeout_s == 0 else timeout_s, retry_allowed=True)
    while True:
        remaining = attempts.next_timeout()
        per_try = ATTEMPT_TIMEOUT_S if remaining is None else max(0.2, min(ATTEMPT_TIMEOUT_S, remaining))
        try:
            return call(per_try)
        except grpc.RpcError as e:
            code = e.code()
            last = f"{code.name}: {e.details()}"
            if code not in RETRYABLE:
                raise PeerUnreachable(f"{peer} at {target} refused the call: {last}") from e
            delay = attempts.pause_after(e)
            if delay is None:
                raise TimeoutError(
                    f"{peer} at {target} did not answer within {timeout_s:.0f} s "
                    f"({attempts.attempt} attempts, last: {last})"
                ) from e
            key = peer.replace(" ", "_")
            log.info(
                f"waiting_for_{key}",
                **{key: target},
                attempt=attempts.attempt,
                retry_in_s=round(delay, 2),
                reason=code.name,
            )
            if stop is not None and stop.wait(delay):
                raise StopRequested() from e
            if stop is None:
                time.sleep(delay)


def wait_for_cache_host(
    target: str, timeout_s: float, stop: threading.Event | None = None, dialer: Dialer = PLAIN
) -> cache_host_pb2.CacheInfo:
    """The cache host's GetCacheInfo, waiting for it as above."""
    with dialer.channel(target) as channel:
        stub = cache_host_pb2_grpc.CacheHostStub(channel)
        return wait_for(
            "cache host",
            target,
            lambda t: stub.GetCacheInfo(
                cache_host_pb2.GetCacheInfoRequest(), timeout=t, metadata=dialer.metadata
            ),
            timeout_s,
            stop,
        )


def wait_for_block_manager(
    target: str, timeout_s: float, stop: threading.Event | None = None, dialer: Dialer = PLAIN
) -> PoolConfig:
    """The block manager's geometry (GetConfig), waiting for it as above."""
    return wait_for("block manager", target, lambda t: fetch_pool_config(target, t, dialer), timeout_s, stop)


def forget_stale_prefixes(target: str, instance_id: str, timeout_s: float, dialer: Dialer = PLAIN) -> bool:
    """A new cache host instance has new, empty memory: every block the block manager's prefix cache
    holds as committed names KV that is gone, and a later request hitting it would read garbage.
    The cache host resets that prefix cache once (``ResetPrefixCache``, request id from its instance,
    so a retry is not applied twice) before it serves its descriptor, so no worker can attach, and no
    engine step can run, before the reset. Best effort: False (and a warning) when refused, e.g. a
    token that is not an admin's."""
    try:
        with dialer.channel(target) as channel:
            stub = block_manager_pb2_grpc.BlockManagerStub(channel)
            reply = stub.ResetPrefixCache(
                block_manager_pb2.ResetPrefixCacheRequest(request_id=f"cache-host-{instance_id}"),
                timeout=timeout_s,
                metadata=dialer.metadata,
            )
    except grpc.RpcError as e:
        log.warning(
            "prefix_cache_reset_failed",
            block_manager=target,
            code=e.code().name,
            details=e.details(),
            hint="blocks committed on the previous cache host stay prefix hits until an engine resets "
            "them (give the cache host an admin token)",
        )
        return False
    log.info(
        "prefix_cache_reset",
        block_manager=target,
        instance_id=instance_id,
        num_blocks_cleared=reply.num_blocks_cleared,
    )
    return True
