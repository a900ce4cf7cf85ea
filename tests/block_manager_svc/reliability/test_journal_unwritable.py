"""A journal that cannot be written (a full disk, a failed fsync): mutations are refused with
UNAVAILABLE and the reason, nothing acknowledged is lost, reads go on, writes resume when the disk
does; and a journal cut at any byte of its last record restarts without it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.block_manager_svc.journal import list_segments
from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers, crash
from .full_disk import FullDisk, fd_path, full_disk
from .test_recovery import state_bytes


@pytest.fixture(params=["tmpfs", "injected"])
def disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FullDisk]:
    yield from full_disk(request, tmp_path, monkeypatch)


def _alloc(i: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(seq_id=f"s{i}", num_tokens=5, token_ids=[i, 1, 2, 3, 4], request_id=f"r{i}")


def _until(ok: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _retry_succeeds(stub, req: pb.AllocateRequest) -> Callable[[], bool]:  # type: ignore[no-untyped-def]
    def ok() -> bool:
        try:
            stub.Allocate(req, timeout=2)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            return False
        return True

    return ok


def test_full_disk_refuses_mutations_keeps_reads_and_resumes(servers: Servers, disk: FullDisk) -> None:
    kw = {"state_dir": str(disk.state_dir), "num_gpu_blocks": 1024, "snapshot_interval_s": 0}
    running, stub = servers.start(**kw)
    for i in range(3):
        stub.Allocate(_alloc(i))
    disk.fill()
    # A tmpfs still takes records into the journal's last partly-filled page: go on until refused.
    acked = [0, 1, 2]
    refused = None
    for i in range(3, 400):
        before = state_bytes(running)
        try:
            stub.Allocate(_alloc(i))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot write its journal" in (e.details() or "")
            assert "No space left on device" in (e.details() or "")
            assert "nothing changed" in (e.details() or "")
            refused = i
            break
        acked.append(i)
    assert refused is not None, "the full disk never refused a mutation"
    assert state_bytes(running) == before  # rolled back to the acknowledged state
    # Reads go on; every other mutation is refused (and changes nothing) while the disk is full.
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="s0")).num_tokens == 5
    assert stub.GetStats(pb.GetStatsRequest()).num_sequences == len(acked)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Free(pb.FreeRequest(seq_id="s0", request_id="f0"))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as ei:
        stub.Allocate(_alloc(refused))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert state_bytes(running) == before
    disk.free()
    _until(_retry_succeeds(stub, _alloc(refused)))  # the refused request, same id: applied once
    stub.Allocate(_alloc(refused))  # a dedupe hit
    assert stub.GetStats(pb.GetStatsRequest()).num_sequences == len(acked) + 1
    after = state_bytes(running)
    crash(running)
    running2, stub2 = servers.start(**kw)
    assert state_bytes(running2) == after  # nothing acknowledged was lost, nothing applied twice
    for i in [*acked, refused]:
        assert stub2.GetBlockTable(pb.GetBlockTableRequest(seq_id=f"s{i}")).num_tokens == 5


def test_failed_fsync_refuses_rolls_back_to_disk_and_resumes(
    servers: Servers, state_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, stub = servers.start(state_dir=state_dir, fsync="always", snapshot_interval_s=0)
    stub.Allocate(_alloc(0))
    failing = True
    real = os.fsync

    def fsync(fd: int) -> None:
        if failing and fd_path(fd).startswith(state_dir):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Allocate(_alloc(1))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Input/output error" in (ei.value.details() or "") and "may have been applied" in (
        ei.value.details() or ""
    )
    # The retry is refused too (its reply is not durable), and so is every other mutation.
    for req in (_alloc(1), _alloc(2)):
        with pytest.raises(grpc.RpcError) as ei:
            stub.Allocate(req)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="s0")).num_tokens == 5
    time.sleep(1.2)  # the snapshot thread tried again, and could not
    with pytest.raises(grpc.RpcError):
        stub.Allocate(_alloc(2))
    failing = False
    _until(_retry_succeeds(stub, _alloc(1)))
    _retry_succeeds(stub, _alloc(2))()
    assert stub.GetStats(pb.GetStatsRequest()).num_sequences == 3  # s1 once, whether or not it had been
    after = state_bytes(running)
    crash(running)
    running2, _ = servers.start(state_dir=state_dir, fsync="always")
    assert state_bytes(running2) == after


def test_journal_cut_at_every_byte_of_its_last_record_restarts(servers: Servers, tmp_path: Path) -> None:
    src = tmp_path / "src"
    kw = {"state_dir": str(src), "snapshot_every_ops": 0, "snapshot_interval_s": 0}
    running, stub = servers.start(**kw)
    for i in range(3):
        stub.Allocate(_alloc(i))
    before = state_bytes(running)
    _, seg = list_segments(src)[-1]
    size_before = seg.stat().st_size
    stub.Step(
        pb.StepRequest(
            append_seq_ids=["s0", "s1"], alloc_seq_ids=["s9"], alloc_num_tokens=[7], request_id="st"
        )
    )
    after = state_bytes(running)
    crash(running)
    data = seg.read_bytes()
    assert len(data) > size_before
    for cut in range(size_before, len(data) + 1):
        trial = tmp_path / f"cut{cut}"
        shutil.copytree(src, trial)
        (trial / seg.name).write_bytes(data[:cut])
        r, s = servers.start(**{**kw, "state_dir": str(trial)})
        assert state_bytes(r) == (after if cut == len(data) else before), cut
        crash(r)
        servers.running.remove(r)


class EventView:
    """What a WatchEvents stream says is cached: its events applied in order, on a thread."""

    def __init__(self, stub) -> None:  # type: ignore[no-untyped-def]
        self.cached: set[bytes] = set()
        self.named: set[bytes] = set()  # every hash a BlockStored ever named
        self._stream = stub.WatchEvents(pb.WatchEventsRequest())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for ev in self._stream:
                kind = ev.WhichOneof("event")
                if kind == "all_blocks_cleared":
                    self.cached.clear()
                elif kind == "block_stored":
                    self.cached.update(ev.block_stored.block_hashes)
                    self.named.update(ev.block_stored.block_hashes)
                elif kind == "block_removed":
                    self.cached.difference_update(ev.block_removed.block_hashes)

    def close(self) -> None:
        self._stream.cancel()


def _cached(running) -> set[bytes]:  # type: ignore[no-untyped-def]
    return set(running.servicer._core.pool.index)


def test_kv_event_watchers_never_keep_what_a_journal_rollback_undid(
    servers: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FullDisk(tmp_path, monkeypatch, real=False)  # journal writes fail with ENOSPC while full
    running, stub = servers.start(state_dir=str(disk.state_dir), snapshot_interval_s=0, fsync="always")
    view = EventView(stub)
    try:
        stub.Allocate(pb.AllocateRequest(seq_id="kept", num_tokens=8, token_ids=[1, 2, 3, 4, 5, 6, 7, 8]))
        stub.Commit(pb.CommitRequest(seq_id="kept", num_computed_tokens=8, request_id="c-kept"))
        stub.Allocate(pb.AllocateRequest(seq_id="undone", num_tokens=8, token_ids=[9, 9, 9, 9, 8, 8, 8, 8]))
        _until(lambda: view.cached == _cached(running) and len(view.cached) == 2)
        kept = set(view.cached)

        # A write that fails: the Commit is rolled back, and its blocks were never announced.
        disk.fill()
        with pytest.raises(grpc.RpcError) as ei:
            stub.Commit(pb.CommitRequest(seq_id="undone", num_computed_tokens=8, request_id="c-undone"))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "nothing changed" in (
            ei.value.details() or ""
        )
        assert _cached(running) == kept
        _until(lambda: view.cached == kept)
        time.sleep(0.3)  # anything still in flight to the watcher has arrived
        assert view.cached == kept and view.named == kept
        disk.free()
        _until(_retry_succeeds(stub, pb.AllocateRequest(seq_id="x", num_tokens=1, request_id="x")))
        stub.Commit(pb.CommitRequest(seq_id="undone", num_computed_tokens=8, request_id="c-undone"))
        _until(lambda: view.cached == _cached(running) and len(view.cached) == 4)

        # A record written whose fsync fails: watchers may have heard of it; the rollback corrects them.
        stub.Allocate(
            pb.AllocateRequest(seq_id="maybe", num_tokens=4, token_ids=[5, 5, 5, 5], request_id="m")
        )
        real = os.fsync
        failing = True

        def fsync(fd: int) -> None:
            if failing and fd_path(fd).startswith(str(disk.state_dir)):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Commit(pb.CommitRequest(seq_id="maybe", num_computed_tokens=4, request_id="c-maybe"))
        assert "may have been applied" in (ei.value.details() or "")
        _until(lambda: view.cached == _cached(running))
        failing = False
    finally:
        view.close()
