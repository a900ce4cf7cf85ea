"""Append-only journal of applied mutations, with checksummed records and
group-committed fsync.

The block manager's core is deterministic, so its state is a pure function of
the commands applied to it. The journal records each applied command (method
name + serialized request, plus internal events such as lease expiries) in
the order the state lock applied them; recovery replays them through the same
code path.

On-disk layout, inside the state directory::

    journal-<first seq, 20 digits>.log   one segment per snapshot interval
    snapshot-<seq, 20 digits>.snap       see snapshot.py

Record framing (little-endian)::

    u32 payload length | u32 zlib.crc32(payload) | payload
    payload = u64 seq | f64 wall time | u8 len(name) | name (ascii) | body

A record is valid only if the whole frame is present and the CRC matches.
Recovery stops at the first invalid record, truncates the segment there and
drops any later segment (logged with the byte counts): a torn or corrupt tail
is never half-applied. With ``fsync=always`` only the unacknowledged tail can
be torn.

Threading: :meth:`Journal.append` is called under the servicer's state lock
(it is one ``os.write`` of an already framed record, so records are in apply
order and never interleave); :meth:`Journal.wait_durable` is called *after*
the lock is released. With ``always`` it group-commits: the first waiter runs
one ``fsync`` that covers every record written so far, the others wait for
it.

A write or fsync error (a full disk: ENOSPC; a failing one: EIO) *fails* the
journal: that call raises :class:`JournalFailed` and so does every later
``append`` and ``wait_durable`` (after a failed fsync the kernel may have
dropped the dirty pages, so a later fsync that succeeds would prove nothing).
The caller (reliability.py) then rolls its in-memory state back to what the
files hold and opens a new journal once the disk takes writes again. A failed
journal is never written to again, so a torn record can only be its last one,
which recovery drops.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog

FsyncPolicy = Literal["always", "batch", "off"]

FRAME = struct.Struct("<II")
HEAD = struct.Struct("<QdB")
MAX_RECORD_BYTES = 256 * 1024 * 1024
SEGMENT_RE = re.compile(r"^journal-(\d{20})\.log$")

log = structlog.get_logger("pagedkv.block_manager.journal")


class JournalFailed(OSError):
    """A journal write or fsync failed: the journal takes no more records."""


def segment_name(first_seq: int) -> str:
    return f"journal-{first_seq:020d}.log"


def encode_record(seq: int, wall_time: float, name: str, body: bytes) -> bytes:
    name_b = name.encode("ascii")
    payload = HEAD.pack(seq, wall_time, len(name_b)) + name_b + body
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass(slots=True, frozen=True)
class Record:
    seq: int
    wall_time: float
    name: str
    body: bytes


@dataclass(slots=True)
class ScanReport:
    """What recovery found in the journal."""

    segments: int = 0
    records: int = 0
    bytes: int = 0
    dropped_bytes: int = 0
    dropped_segments: list[str] = field(default_factory=list)
    last_seq: int = 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_numbered(state_dir: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    """Files of `state_dir` whose name matches `pattern` (one group: a sequence number), by number."""
    out = []
    for p in state_dir.iterdir():
        m = pattern.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    out.sort()
    return out


def list_segments(state_dir: Path) -> list[tuple[int, Path]]:
    return list_numbered(state_dir, SEGMENT_RE)


def _parse(buf: bytes, pos: int) -> tuple[Record | None, int]:
    """The record at `pos` and the offset after it, or (None, pos) if torn/corrupt."""
    if len(buf) - pos < FRAME.size:
        return None, pos
    length, crc = FRAME.unpack_from(buf, pos)
    start = pos + FRAME.size
    end = start + length
    if length < HEAD.size or length > MAX_RECORD_BYTES or end > len(buf):
        return None, pos
    payload = buf[start:end]
    if zlib.crc32(payload) != crc:
        return None, pos
    seq, wall, name_len = HEAD.unpack_from(payload, 0)
    name_end = HEAD.size + name_len
    if name_end > length:
        return None, pos
    try:
        name = payload[HEAD.size : name_end].decode("ascii")
    except UnicodeDecodeError:
        return None, pos
    return Record(seq, wall, name, payload[name_end:]), end


def scan(state_dir: Path, after_seq: int, report: ScanReport, repair: bool = True) -> Iterator[Record]:
    """Yield every valid record with seq > after_seq, in order.

    At the first invalid record (torn write, bad CRC, a gap in sequence
    numbers) the segment is truncated there and later segments are renamed
    to ``*.corrupt`` (when ``repair``), so the journal afterwards holds exactly
    the records that were yielded.
    """
    segments = list_segments(state_dir)
    expected = after_seq + 1
    for i, (_first, path) in enumerate(segments):
        buf = path.read_bytes()
        report.segments += 1
        pos = 0
        bad = False
        while pos < len(buf):
            rec, nxt = _parse(buf, pos)
            if rec is None or (rec.seq > after_seq and rec.seq != expected):
                bad = True
                break
            pos = nxt
            report.records += 1
            if rec.seq > after_seq:
                expected = rec.seq + 1
                report.last_seq = rec.seq
                yield rec
        report.bytes += pos
        if bad:
            report.dropped_bytes += len(buf) - pos
            log.warning("journal_tail_dropped", segment=path.name, offset=pos, dropped_bytes=len(buf) - pos)
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    f.flush()
                    try:
                        os.fsync(f.fileno())
                    except OSError as e:  # a failing disk: the tail is dropped again at the next start
                        log.warning("journal_truncate_not_synced", segment=path.name, error=repr(e))
            for _, later in segments[i + 1 :]:
                report.dropped_bytes += later.stat().st_size
                report.dropped_segments.append(later.name)
                log.warning("journal_segment_dropped", segment=later.name)
                if repair:
                    later.rename(later.with_suffix(".corrupt"))
            if repair:
                try:
                    fsync_dir(state_dir)
                except OSError as e:
                    log.warning("journal_dir_not_synced", error=repr(e))
            return


class Journal:
    """The writer. One open segment; older ones are deleted after a snapshot covers them."""

    def __init__(
        self,
        state_dir: Path,
        next_seq: int,
        policy: FsyncPolicy = "always",
        interval_ms: float = 5.0,
    ) -> None:
        self.state_dir = state_dir
        self.policy = policy
        self.interval_s = max(interval_ms, 0.1) / 1000.0
        self.failed: JournalFailed | None = None  # set by the first failed write or fsync
        self._next_seq = next_seq
        self.last_seq = next_seq - 1  # written (handed to the OS)
        self._durable = next_seq - 1
        self._cv = threading.Condition(threading.Lock())
        self._syncing = False
        self._retired: list[int] = []  # fds of rotated segments not yet fsynced
        self._fd = -1
        self.segment_first_seq = next_seq
        self.bytes_written = 0
        self.records_since_rotate = 0
        self.num_fsyncs = 0
        self._closed = False
        self._open_segment(next_seq)
        self._flusher: threading.Thread | None = None
        if policy == "batch":
            self._stop = threading.Event()
            self._flusher = threading.Thread(target=self._flush_loop, name="bm-journal-flush", daemon=True)
            self._flusher.start()

    # --- writing (under the state lock) ---------------------------------------
    def _open_segment(self, first_seq: int) -> None:
        path = self.state_dir / segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if self.policy != "off":
                fsync_dir(self.state_dir)  # the new name must survive a crash too
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self.segment_first_seq = first_seq
        self.records_since_rotate = 0

    def _fail(self, what: str, err: BaseException) -> JournalFailed:
        """Mark the journal failed (the first error is kept) and return the error to raise."""
        if self.failed is None:
            self.failed = JournalFailed(f"journal {what} failed: {err}")
            log.error("journal_failed", what=what, error=repr(err), last_seq=self.last_seq)
        return self.failed

    def append(self, name: str, body: bytes, wall_time: float) -> int:
        """Write one record (call under the state lock); returns its seq. Raises JournalFailed
        (and takes no more records) if the write fails: part of the record may be on disk."""
        if self.failed is not None:
            raise self.failed
        seq = self._next_seq
        frame = encode_record(seq, wall_time, name, body)
        try:
            view, done = memoryview(frame), 0
            while done < len(frame):  # after a short write the next one says why (ENOSPC, EIO)
                n = os.write(self._fd, view[done:])
                if n <= 0:
                    raise OSError(f"short write to the journal ({done} of {len(frame)} bytes)")
                done += n
        except OSError as e:
            raise self._fail("write", e) from e
        self._next_seq = seq + 1
        self.last_seq = seq
        self.bytes_written += len(frame)
        self.records_since_rotate += 1
        return seq

    def rotate(self) -> int:
        """Start a new segment (call under the state lock); returns the last seq of the old ones.
        If the new segment cannot be created the journal goes on in the old one."""
        if self.failed is not None:
            raise self.failed
        old = self._fd
        self._open_segment(self._next_seq)
        with self._cv:
            if self.policy == "off":
                os.close(old)
            else:
                self._retired.append(old)
        return self._next_seq - 1

    # --- durability (outside the state lock) -----------------------------------
    def wait_durable(self, seq: int) -> None:
        """Return once record `seq` is on disk (``always``); immediately otherwise.
        Raises JournalFailed if the journal failed before `seq` was on disk."""
        if self.policy != "always":
            return
        self._sync_upto(seq)

    def _sync_upto(self, seq: int) -> None:
        cv = self._cv
        with cv:
            while self._durable < seq:
                if self.failed is not None:
                    raise self.failed
                if self._syncing:
                    cv.wait()
                    continue
                self._syncing = True
                target = self.last_seq
                fds = [*self._retired, self._fd]
                cv.release()
                err: BaseException | None = None
                try:
                    for fd in fds:
                        os.fsync(fd)
                except BaseException as e:  # noqa: BLE001
                    err = e
                finally:
                    cv.acquire()
                    self._syncing = False
                    cv.notify_all()
                if err is not None:
                    raise self._fail("fsync", err) from err
                self.num_fsyncs += 1
                for fd in fds[:-1]:
                    if fd in self._retired:  # (drop_retired may have closed it)
                        self._retired.remove(fd)
                        os.close(fd)
                self._durable = max(self._durable, target)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.last_seq > self._durable or self._retired:
                try:
                    self._sync_upto(self.last_seq)
                except OSError:
                    return  # failed: the next append raises

    def drop_retired(self) -> None:
        """Close rotated segments without syncing them: a durable snapshot covers them (their files
        are deleted, and a full disk gets their space back only once they are closed)."""
        with self._cv:
            while self._syncing:
                self._cv.wait()
            for fd in self._retired:
                os.close(fd)
            self._retired.clear()

    def delete_segments_before(self, first_seq: int) -> int:
        """Remove segments that start before `first_seq` (a snapshot covers them)."""
        removed = 0
        for start, path in list_segments(self.state_dir):
            if start < first_seq:
                path.unlink(missing_ok=True)
                removed += 1
        if removed and self.policy != "off":
            fsync_dir(self.state_dir)
        return removed

    def abandon(self) -> None:
        """Close the files without syncing and take no more records (after a failure; tests use it
        to stand in for a crash). Waits for an fsync in progress, so no fd is closed under it."""
        self._closed = True
        if self._flusher is not None:
            self._stop.set()
            if self._flusher is not threading.current_thread():
                self._flusher.join()
        with self._cv:
            while self._syncing:
                self._cv.wait()
            if self.failed is None:
                self.failed = JournalFailed("journal closed")
            for fd in [*self._retired, self._fd]:
                os.close(fd)
            self._retired.clear()
            self._cv.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._flusher is not None:
            self._stop.set()
            self._flusher.join()
        if self.policy != "off" and self.failed is None:
            self._sync_upto(self.last_seq)
        with self._cv:
            for fd in self._retired:
                os.close(fd)
            self._retired.clear()
            os.close(self._fd)
