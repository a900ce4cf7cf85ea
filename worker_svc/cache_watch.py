"""Worker-side detection of a lost cache host (docs/worker.md, "Cache host loss").

The cache host's memory is the KV cache: when the host dies, or a new one (new ``instance_id``,
new empty memory) answers at its address, every block this worker could read is gone or stale.
A daemon thread polls ``CacheHost.GetCacheInfo`` every ``interval_s`` and calls ``on_lost`` once,
with a reason, when the host stops answering for ``failures`` consecutive checks or answers with
another instance id. The servicer then turns health NOT_SERVING and refuses steps with
FAILED_PRECONDITION carrying the CACHE_HOST_LOST error detail (pagedkv/errors.py), which is what the
engine recognises; the message (prefix :data:`CACHE_LOST_PREFIX`) is for people.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import structlog

from pagedkv.dial import PLAIN, Dialer
from pagedkv.v1 import cache_host_pb2, cache_host_pb2_grpc

log = structlog.get_logger("pagedkv.worker")

CACHE_LOST_PREFIX = "cache host lost: "
EXIT_CACHE_LOST = 3  # the worker's exit code after a lost cache host (a supervisor restarts it)
REPREFILL_HINT = (
    "the KV cache content is gone: every sequence must be re-prefilled after this worker re-attaches to "
    "a new cache host (restart the worker; it exits by itself with code 3 unless --cache-lost-exit-after-s 0)"
)


def lost_message(reason: str) -> str:
    return f"{CACHE_LOST_PREFIX}{reason}; {REPREFILL_HINT}"


class CacheHostWatcher:
    """Polls the cache host; ``on_lost(reason, new_instance_id)`` is called at most once."""

    def __init__(
        self,
        target: str,
        instance_id: str,
        interval_s: float,
        failures: int,
        on_lost: Callable[[str, str], None],
        dialer: Dialer = PLAIN,
    ) -> None:
        self.target = target
        self.dialer = dialer
        self.instance_id = instance_id
        self.interval_s = interval_s
        self.failures = max(1, failures)
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-host-watch", daemon=True)

    def start(self) -> CacheHostWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 2.0)

    def check(self, stub: cache_host_pb2_grpc.CacheHostStub, misses: int) -> tuple[int, str | None, str]:
        """One check: (consecutive misses, reason if lost, the new instance id if replaced)."""
        try:
            info = stub.GetCacheInfo(cache_host_pb2.GetCacheInfoRequest(),
                                     timeout=max(min(self.interval_s, 5.0), 0.5), metadata=self.dialer.metadata)
        except grpc.RpcError as e:
            misses += 1
            if misses >= self.failures:
                return misses, (f"the cache host at {self.target} is gone ({misses} consecutive checks "
                                f"failed, last: {e.code().name}; instance {self.instance_id})"), ""
            return misses, None, ""
        if info.instance_id != self.instance_id:
            return 0, (f"the cache host at {self.target} was replaced (instance {self.instance_id} -> "
                       f"{info.instance_id}, pid {info.host_pid}): the new one holds new, empty memory"), \
                info.instance_id
        return 0, None, ""

    def _run(self) -> None:
        misses = 0
        with self.dialer.channel(self.target) as channel:
            stub = cache_host_pb2_grpc.CacheHostStub(channel)
            while not self._stop.wait(self.interval_s):
                misses, reason, new_id = self.check(stub, misses)
                if reason is not None:
                    try:
                        self.on_lost(reason, new_id)
                    except Exception:  # a watcher must not die silently
                        log.exception("cache_host_lost_handler_failed")
                    return
