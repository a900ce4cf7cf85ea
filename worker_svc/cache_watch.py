"""Worker-side detection of a lost cache host (docs/worker.md, "Cache host loss").

The cache host's memory is the KV cache: when the host dies, or a new one (new ``instance_id``,
new empty memory) answers at its address, every block this worker could read is gone or stale.
A daemon thread polls ``CacheHost.GetCacheInfo`` every ``interval_s`` and calls ``on_lost`` once,
with a reason, when the host is unreachable (UNAVAILABLE: its port refuses, it is gone) for
``failures`` consecutive checks or answers with another instance id.

Hung is not dead. A check that gets no answer in time (DEADLINE_EXCEEDED: the host accepted the
call and is silent, as a paused process, a stalled disk or a swap storm is) is not a loss: its
memory, the KV, is intact as long as its process lives, so the worker goes on computing and logs
``cache_host_not_answering`` / ``cache_host_answering``. And when a loss was declared but the SAME
instance answers again (a pause long enough for keepalive to close the connection, a dropped link),
``on_resumed`` un-declares it: the memory never went away.

On a loss the servicer turns health NOT_SERVING and refuses steps with FAILED_PRECONDITION
carrying the CACHE_HOST_LOST error detail (pagedkv/errors.py), which is what the engine recognises;
the message (prefix :data:`CACHE_LOST_PREFIX`) is for people.

With ``on_replaced`` the thread keeps polling after a loss: as soon as a cache host with another
instance id answers at the same address (a supervisor restarted it), ``on_replaced(info)`` re-attaches
the worker to it (worker_svc/reattach.py) and, when that worked, watching starts over on the new
instance. Why the worker does this itself rather than exiting: a worker that stayed up (nothing
restarts a process that did not exit) would otherwise refuse every step until restarted by hand.
"""

from __future__ import annotations

import threading
import time
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
    "a new cache host (it does so by itself when one answers at the same address; without one it exits with "
    "code 3 after --cache-lost-exit-after-s, unless that is 0)"
)


def lost_message(reason: str) -> str:
    return f"{CACHE_LOST_PREFIX}{reason}; {REPREFILL_HINT}"


class CacheHostWatcher:
    """Polls the cache host; ``on_lost(reason, new_instance_id)`` is called once per attached instance,
    ``on_replaced(info)`` (optional) for each new instance seen after a loss, until it returns True."""

    def __init__(
        self,
        target: str,
        instance_id: str,
        interval_s: float,
        failures: int,
        on_lost: Callable[[str, str], None],
        dialer: Dialer = PLAIN,
        on_replaced: Callable[[cache_host_pb2.CacheInfo], bool] | None = None,
        on_resumed: Callable[[], None] | None = None,
    ) -> None:
        self.target = target
        self.dialer = dialer
        self.instance_id = instance_id
        self.interval_s = interval_s
        self.failures = max(1, failures)
        self.on_lost = on_lost
        self.on_replaced = on_replaced
        self.on_resumed = on_resumed
        self.silent_since: float | None = None  # monotonic; set while the host does not answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-host-watch", daemon=True)

    def start(self) -> CacheHostWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 2.0)

    def _info(self, stub: cache_host_pb2_grpc.CacheHostStub) -> cache_host_pb2.CacheInfo:
        return stub.GetCacheInfo(
            cache_host_pb2.GetCacheInfoRequest(),
            timeout=max(min(self.interval_s, 5.0), 0.5),
            metadata=self.dialer.metadata,
        )

    def check(self, stub: cache_host_pb2_grpc.CacheHostStub, misses: int) -> tuple[int, str | None, str]:
        """One check: (consecutive misses, reason if lost, the new instance id if replaced)."""
        try:
            info = self._info(stub)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # hung, not dead: wait for it
                if self.silent_since is None:
                    self.silent_since = time.monotonic()
                    log.warning(
                        "cache_host_not_answering", cache_host=self.target, instance_id=self.instance_id
                    )
                return misses, None, ""
            misses += 1
            if misses >= self.failures:
                return (
                    misses,
                    (
                        f"the cache host at {self.target} is gone ({misses} consecutive checks "
                        f"failed, last: {e.code().name}; instance {self.instance_id})"
                    ),
                    "",
                )
            return misses, None, ""
        if self.silent_since is not None:
            log.info(
                "cache_host_answering",
                cache_host=self.target,
                silent_s=round(time.monotonic() - self.silent_since, 2),
                same_instance=info.instance_id == self.instance_id,
            )
            self.silent_since = None
        if info.instance_id != self.instance_id:
            return (
                0,
                (
                    f"the cache host at {self.target} was replaced (instance {self.instance_id} -> "
                    f"{info.instance_id}, pid {info.host_pid}): the new one holds new, empty memory"
                ),
                info.instance_id,
            )
        return 0, None, ""

    def _run(self) -> None:
        misses = 0
        with self.dialer.channel(self.target) as channel:
            stub = cache_host_pb2_grpc.CacheHostStub(channel)
            while not self._stop.wait(self.interval_s):
                misses, reason, new_id = self.check(stub, misses)
                if reason is None:
                    continue
                try:
                    self.on_lost(reason, new_id)
                except Exception:  # a watcher must not die silently
                    log.exception("cache_host_lost_handler_failed")
                if self.on_replaced is None and self.on_resumed is None:
                    return
                if not self._await_replacement(stub, immediately=bool(new_id)):
                    return
                misses = 0

    def _await_replacement(self, stub: cache_host_pb2_grpc.CacheHostStub, immediately: bool) -> bool:
        """Poll until a cache host with a new instance id answers and ``on_replaced`` took it, or the
        lost instance itself answers again and ``on_resumed`` took it back (True: watch that instance
        now), or the watcher is stopped (False). An instance that could not
        be attached (say, another geometry) is not tried again: the worker stays NOT_SERVING and exits
        after its grace, and a restarted worker reports the mismatch at start-up."""
        if not immediately and self._stop.wait(self.interval_s):
            return False
        refused: set[str] = set()
        replaced = immediately  # another instance answered already: the lost one cannot come back
        while True:
            try:
                info = self._info(stub)
            except grpc.RpcError:
                info = None
            if info is not None and info.instance_id == self.instance_id and not replaced:
                if self.on_resumed is not None:
                    log.warning("cache_host_resumed", cache_host=self.target, instance_id=self.instance_id)
                    self.on_resumed()
                    return True
            elif info is not None and info.instance_id not in ("", self.instance_id, *refused):
                replaced = True
                if self.on_replaced is None:
                    refused.add(info.instance_id)
                    continue
                try:
                    attached = self.on_replaced(info)
                except Exception:  # noqa: BLE001 - logged; this instance is not tried again
                    log.exception(
                        "cache_host_reattach_failed", cache_host=self.target, new_instance_id=info.instance_id
                    )
                    attached = False
                if attached:
                    self.instance_id = info.instance_id
                    return True
                refused.add(info.instance_id)
            if self._stop.wait(self.interval_s):
                return False
