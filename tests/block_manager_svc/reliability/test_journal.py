"""Journal framing, torn/corrupt tails, group commit, and atomic snapshots."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pagedkv.block_manager_svc import snapshot
from pagedkv.block_manager_svc.journal import (
    Journal,
    JournalFailed,
    ScanReport,
    encode_record,
    list_segments,
    scan,
    segment_name,
)


def _write(tmp: Path, n: int, policy: str = "off") -> Journal:
    j = Journal(tmp, 1, policy)  # type: ignore[arg-type]
    for i in range(n):
        j.append("Free", f"body-{i}".encode() * (i % 5 + 1), 1000.0 + i)
    return j


def _records(tmp: Path, after: int = 0, repair: bool = True) -> tuple[list, ScanReport]:
    rep = ScanReport()
    return list(scan(tmp, after, rep, repair=repair)), rep


def test_roundtrip_in_order(tmp_path: Path) -> None:
    j = _write(tmp_path, 50)
    j.close()
    recs, rep = _records(tmp_path)
    assert [r.seq for r in recs] == list(range(1, 51))
    assert recs[7].name == "Free" and recs[7].body == b"body-7" * 3 and recs[7].wall_time == 1007.0
    assert rep.dropped_bytes == 0 and rep.last_seq == 50
    recs, _ = _records(tmp_path, after=40)
    assert [r.seq for r in recs] == list(range(41, 51))


@pytest.mark.parametrize("cut", [1, 4, 8, 9, 20, -1])
def test_torn_tail_is_dropped_and_truncated(tmp_path: Path, cut: int) -> None:
    j = _write(tmp_path, 10)
    j.close()
    path = tmp_path / segment_name(1)
    data = path.read_bytes()
    last = encode_record(10, 1009.0, "Free", b"body-9" * 5)
    assert data.endswith(last)
    keep = len(data) - len(last) + (cut if cut > 0 else len(last) + cut)
    path.write_bytes(data[:keep])  # a write cut short at any byte
    recs, rep = _records(tmp_path)
    assert [r.seq for r in recs] == list(range(1, 10))
    assert rep.dropped_bytes == keep - (len(data) - len(last))
    assert path.stat().st_size == len(data) - len(last)  # truncated: a later append starts clean
    recs, rep = _records(tmp_path)
    assert len(recs) == 9 and rep.dropped_bytes == 0


def test_corrupt_record_drops_it_and_everything_after(tmp_path: Path) -> None:
    j = _write(tmp_path, 10)
    j.rotate()
    for i in range(5):
        j.append("Free", b"later", 2000.0 + i)
    j.close()
    first = tmp_path / segment_name(1)
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit in the middle of segment 1
    first.write_bytes(bytes(data))
    recs, rep = _records(tmp_path)
    assert recs and recs[-1].seq < 10
    assert all(r.seq == i + 1 for i, r in enumerate(recs))
    assert rep.dropped_segments == [segment_name(11)]
    assert [p.name for _, p in list_segments(tmp_path)] == [segment_name(1)]
    assert (tmp_path / (segment_name(11)[:-4] + ".corrupt")).exists()


def test_group_commit_covers_concurrent_writers(tmp_path: Path) -> None:
    j = Journal(tmp_path, 1, "always")
    lock = threading.Lock()

    def writer(k: int) -> None:
        for i in range(40):
            with lock:  # the state lock
                seq = j.append("Append", f"{k}-{i}".encode(), 0.0)
            j.wait_durable(seq)
            assert j._durable >= seq

    ts = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert j.last_seq == 320
    assert 1 <= j.num_fsyncs <= 320
    j.close()
    assert len(_records(tmp_path)[0]) == 320


def test_write_failure_fails_the_journal_for_good(tmp_path: Path) -> None:
    j = Journal(tmp_path, 1, "always")
    j.append("Free", b"a", 0.0)
    real_fd = j._fd
    j._fd = os.open(tmp_path / "elsewhere", os.O_RDONLY | os.O_CREAT)  # the next write fails (EBADF)
    with pytest.raises(JournalFailed, match="journal write failed"):
        j.append("Free", b"x", 0.0)
    os.close(j._fd)
    j._fd = real_fd
    # Failed for good: no later record, and no durability promise, even if the disk looks fine again.
    with pytest.raises(JournalFailed):
        j.append("Free", b"y", 0.0)
    with pytest.raises(JournalFailed):
        j.wait_durable(1)
    assert j.last_seq == 1
    j.abandon()
    assert [r.body for r in _records(tmp_path)[0]] == [b"a"]


def test_snapshot_atomic_and_checked(tmp_path: Path) -> None:
    snapshot.write(tmp_path, 5, b"payload 5")
    snapshot.write(tmp_path, 9, b"payload 9")
    (tmp_path / "snapshot-00000000000000000012.tmp").write_bytes(b"half a snapshot")
    got = snapshot.load_latest(tmp_path)
    assert got is not None and got.seq == 9 and got.payload == b"payload 9"
    assert [s for s, _ in snapshot.list_snapshots(tmp_path)] == [9]  # older removed, tmp ignored
    assert not list(tmp_path.glob("*.tmp"))
    path = tmp_path / snapshot.snapshot_name(9)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(snapshot.SnapshotError, match="corrupt"):
        snapshot.load_latest(tmp_path)
