"""Atomic, checksummed snapshots of the whole block-manager state.

A snapshot is the state as explicit, versioned records (block_manager_svc/records.py:
core, leases, dedupe table, msgpack-encoded) taken under the state lock, tagged
with the journal sequence number it covers. It is written
to a temporary file, fsynced, renamed over its final name and the directory
fsynced, so a crash leaves either the old or the new snapshot, never half of
one. After it is durable, journal segments it covers and older snapshots are
deleted.

File layout: ``MAGIC | u64 seq | u32 crc32(payload) | u64 len(payload) | payload``.
``PKVSNAP2``: the payload is a msgpack state document whose ``version`` field
records.py reads first (and refuses or migrates there). ``PKVSNAP1`` (the first
versions) was a pickle of the manager objects; it is refused, never unpickled: a
state file must not be able to name code to run.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from pagedkv.block_manager_svc.journal import fsync_dir, list_numbered

MAGIC = b"PKVSNAP2"
MAGIC_PICKLE = b"PKVSNAP1"  # format 1 (a pickle): recognised only to be refused with advice
HEADER = struct.Struct("<8sQIQ")
SNAP_RE = re.compile(r"^snapshot-(\d{20})\.snap$")


class SnapshotError(RuntimeError):
    """The state directory holds a snapshot this process cannot read."""


@dataclass(slots=True, frozen=True)
class Snapshot:
    seq: int
    payload: bytes  # checked against its checksum; records.decode reads it
    size: int


def snapshot_name(seq: int) -> str:
    return f"snapshot-{seq:020d}.snap"


def list_snapshots(state_dir: Path) -> list[tuple[int, Path]]:
    return list_numbered(state_dir, SNAP_RE)


def write(state_dir: Path, seq: int, payload: bytes, sync: bool = True) -> Path:
    """Atomically write the encoded `payload` as the snapshot for `seq`; remove older ones."""
    final = state_dir / snapshot_name(seq)
    tmp = final.with_suffix(".tmp")
    header = HEADER.pack(MAGIC, seq, zlib.crc32(payload), len(payload))
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise
    os.replace(tmp, final)
    if sync:
        fsync_dir(state_dir)
    for old_seq, path in list_snapshots(state_dir):
        if old_seq < seq:
            path.unlink(missing_ok=True)
    return final


def load_latest(state_dir: Path) -> Snapshot | None:
    """The newest snapshot, or None if there is none. Raises SnapshotError if it is unreadable."""
    for p in state_dir.glob("snapshot-*.tmp"):
        p.unlink(missing_ok=True)  # an interrupted write; the previous snapshot is intact
    snaps = list_snapshots(state_dir)
    if not snaps:
        return None
    seq, path = snaps[-1]
    buf = path.read_bytes()
    if len(buf) < HEADER.size:
        raise SnapshotError(f"{path} is truncated ({len(buf)} bytes)")
    magic, hdr_seq, crc, length = HEADER.unpack_from(buf, 0)
    payload = buf[HEADER.size :]
    if magic == MAGIC_PICKLE:
        raise SnapshotError(
            f"{path} is a format-1 snapshot (a pickle), which this version does not load: a state file must "
            "not be able to name code to run. Start the release that wrote it and drain it (free every "
            "sequence), then start this one on a new --state-dir"
        )
    if magic != MAGIC or hdr_seq != seq or length != len(payload) or zlib.crc32(payload) != crc:
        raise SnapshotError(f"{path} is corrupt (bad header or checksum)")
    return Snapshot(seq=seq, payload=payload, size=len(buf))
