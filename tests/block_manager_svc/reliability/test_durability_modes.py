"""The fsync modes, told apart by the fsync calls the journal makes (not by a crash).

An in-process crash (or a SIGKILL) keeps the page cache, so a journal that never calls fsync
recovers just as well as one that does: crash tests cannot tell ``always`` from ``off``. Here
``os.fsync`` is wrapped and every call on a journal segment is counted:
- ``always``: each acknowledged mutation was fsynced before its reply (the count grows by at least
  one per call, and a reply waits for a blocked fsync);
- ``batch``: replies do not wait for fsync (one returns while the flusher's fsync is blocked), and
  the flusher syncs the records within its interval;
- ``off``: the journal never calls fsync.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from pagedkv.block_manager_svc.journal import SEGMENT_RE
from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers

N = 12


@dataclass(slots=True)
class FsyncSpy:
    """Counts os.fsync calls on journal segments; ``gate`` (when cleared) holds them."""

    calls: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self) -> int:
        with self.lock:
            return self.calls


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[FsyncSpy]:
    s = FsyncSpy()
    s.gate.set()
    real = os.fsync

    def fsync(fd: int) -> None:
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        if SEGMENT_RE.match(name):
            s.gate.wait(3)  # bounded: a mutated journal that waits here must still end
            with s.lock:
                s.calls += 1
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield s
    s.gate.set()


def _allocate(stub, i: int) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(
        pb.AllocateRequest(seq_id=f"s{i}", num_tokens=5, token_ids=[i, 1, 2, 3, 4], request_id=f"r{i}")
    )


def test_always_fsyncs_every_acknowledged_mutation_before_its_reply(
    servers: Servers, state_dir: str, spy: FsyncSpy
) -> None:
    _, stub = servers.start(state_dir=state_dir, fsync="always")
    for i in range(N):
        before = spy.count()
        _allocate(stub, i)
        assert spy.count() > before, f"mutation {i} was acknowledged without an fsync of the journal"
    # A reply waits for its fsync: with the fsync held, the call does not return.
    spy.gate.clear()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_allocate, stub, N)
        time.sleep(0.5)
        assert not fut.done(), "fsync=always replied before its record was fsynced"
        spy.gate.set()
        fut.result(timeout=10)


def test_batch_replies_without_waiting_and_syncs_within_the_interval(
    servers: Servers, state_dir: str, spy: FsyncSpy
) -> None:
    _, stub = servers.start(state_dir=state_dir, fsync="batch", fsync_interval_ms=20)
    spy.gate.clear()  # the flusher's fsync blocks; replies must not
    t0 = time.monotonic()
    for i in range(N):
        _allocate(stub, i)
    assert time.monotonic() - t0 < 5, "fsync=batch replies waited for the (blocked) fsync"
    spy.gate.set()
    deadline = time.monotonic() + 5
    while spy.count() == 0:
        assert time.monotonic() < deadline, "fsync=batch never synced the journal"
        time.sleep(0.02)
    # Group commit: far fewer fsyncs than mutations (the blocked flusher covered them in one or two).
    assert spy.count() < N


def test_off_never_fsyncs_the_journal(servers: Servers, state_dir: str, spy: FsyncSpy) -> None:
    running, stub = servers.start(state_dir=state_dir, fsync="off")
    for i in range(N):
        _allocate(stub, i)
    time.sleep(0.2)
    assert running.reliability is not None and running.reliability.servicer.journal is not None
    assert running.reliability.servicer.journal.last_seq >= N  # the records were journaled
    assert spy.count() == 0
