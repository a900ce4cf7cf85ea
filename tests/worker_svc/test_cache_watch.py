"""Hung is not dead, for a worker watching its cache host (worker_svc/cache_watch.py): checks that
get no answer in time never declare the host lost, an unreachable host does, and a host declared
lost that answers again as the SAME instance is taken back (its memory never went away), while a
new instance is a replacement."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pagedkv.v1 import cache_host_pb2
from pagedkv.worker_svc.cache_watch import CacheHostWatcher


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Host:
    """A GetCacheInfo stub that plays back a script: an instance id, or a status code to fail with."""

    def __init__(self, script: list[str | grpc.StatusCode]) -> None:
        self._script: Iterator[str | grpc.StatusCode] = iter(script)

    def GetCacheInfo(self, request: object, timeout: float, metadata: object) -> cache_host_pb2.CacheInfo:  # noqa: N802
        step = next(self._script)
        if isinstance(step, grpc.StatusCode):
            raise _Error(step)
        return cache_host_pb2.CacheInfo(instance_id=step)


def _watcher(**kw: object) -> tuple[CacheHostWatcher, list[str]]:
    events: list[str] = []
    w = CacheHostWatcher(
        "host:1",
        "A",
        interval_s=0.001,
        failures=2,
        on_lost=lambda reason, new: events.append(f"lost:{new}"),
        **kw,  # type: ignore[arg-type]
    )
    return w, events


def test_a_host_that_does_not_answer_in_time_is_hung_not_lost() -> None:
    w, _ = _watcher()
    host = _Host([grpc.StatusCode.DEADLINE_EXCEEDED] * 20 + ["A"])
    misses = 0
    for _ in range(20):
        misses, reason, _new = w.check(host, misses)  # type: ignore[arg-type]
        assert reason is None and misses == 0
    assert w.silent_since is not None
    assert w.check(host, misses) == (0, None, "")  # type: ignore[arg-type]
    assert w.silent_since is None


def test_an_unreachable_host_is_lost_and_a_new_instance_is_a_replacement() -> None:
    w, _ = _watcher()
    host = _Host([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "B"])
    misses, reason, _ = w.check(host, 0)  # type: ignore[arg-type]
    assert reason is None and misses == 1
    misses, reason, _ = w.check(host, misses)  # type: ignore[arg-type]
    assert reason is not None and "is gone" in reason
    _, reason, new = w.check(host, 0)  # type: ignore[arg-type]
    assert reason is not None and "replaced" in reason and new == "B"


def test_the_same_instance_answering_after_a_loss_is_resumed() -> None:
    resumed: list[bool] = []
    w, _ = _watcher(on_resumed=lambda: resumed.append(True), on_replaced=lambda info: False)
    host = _Host([grpc.StatusCode.UNAVAILABLE, "A"])
    assert w._await_replacement(host, immediately=False)  # type: ignore[arg-type]
    assert resumed == [True] and w.instance_id == "A"


def test_after_a_replacement_the_old_instance_is_never_resumed() -> None:
    resumed: list[bool] = []
    attached: list[str] = []

    def on_replaced(info: cache_host_pb2.CacheInfo) -> bool:
        attached.append(info.instance_id)
        return True

    w, _ = _watcher(on_resumed=lambda: resumed.append(True), on_replaced=on_replaced)
    host = _Host(["A", "B"])  # a new instance was seen already (immediately=True)
    assert w._await_replacement(host, immediately=True)  # type: ignore[arg-type]
    assert resumed == [] and attached == ["B"] and w.instance_id == "B"
