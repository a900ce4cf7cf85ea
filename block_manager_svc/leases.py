"""Leases: sequences of a client that vanishes are freed after a TTL.

A lease is a named group of sequences with a TTL. A client creates or renews
it with ``KeepAlive`` (which can also attach existing sequences) or by
naming it in ``Allocate.lease_id``; a forked child joins its parent's lease
unless ``Fork.lease_id`` names another. Freed sequences leave their lease.
When a lease is not renewed for its TTL, the sweeper frees all its
sequences through the same locked and journaled path as a client's Free.
Sequences that were never attached to a lease live until freed.

This table is plain bookkeeping and is only touched under the servicer's
state lock. Deadlines use the monotonic clock and are not persisted: after a
restart every recovered lease gets a fresh full TTL, so clients have one TTL
to reconnect and renew (expiries that happened before the crash were
journaled and are replayed exactly).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_LEASE_ID_LEN = 256


@dataclass(slots=True)
class Lease:
    lease_id: str
    ttl_s: float
    deadline: float
    seq_ids: set[str] = field(default_factory=set)


class LeaseTable:
    def __init__(self, default_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_ttl_s = default_ttl_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.lease_of: dict[str, str] = {}
        self.num_expired = 0
        self.num_expired_sequences = 0

    def __bool__(self) -> bool:
        return bool(self.leases)

    def touch(self, lease_id: str, ttl_s: float | None = None) -> tuple[Lease, bool]:
        """Create or renew a lease; returns (lease, structurally changed)."""
        now = self.clock()
        lease = self.leases.get(lease_id)
        if lease is None:
            ttl = ttl_s or self.default_ttl_s
            lease = self.leases[lease_id] = Lease(lease_id, ttl, now + ttl)
            return lease, True
        changed = ttl_s is not None and ttl_s != lease.ttl_s
        if ttl_s is not None:
            lease.ttl_s = ttl_s
        lease.deadline = now + lease.ttl_s
        return lease, changed

    def attach(self, seq_id: str, lease_id: str) -> None:
        self.detach(seq_id)
        lease, _ = self.touch(lease_id)
        lease.seq_ids.add(seq_id)
        self.lease_of[seq_id] = lease_id

    def detach(self, seq_id: str) -> None:
        lease_id = self.lease_of.pop(seq_id, None)
        if lease_id is not None:
            lease = self.leases.get(lease_id)
            if lease is not None:
                lease.seq_ids.discard(seq_id)

    def detach_all(self, seq_ids: Iterable[str]) -> None:
        if self.lease_of:
            for s in seq_ids:
                self.detach(s)

    def expired(self) -> list[str]:
        now = self.clock()
        return [lid for lid, lease in self.leases.items() if lease.deadline <= now]

    def drop(self, lease_id: str) -> list[str]:
        """Remove a lease; returns its sequences (the caller frees them)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return []
        for s in lease.seq_ids:
            self.lease_of.pop(s, None)
        return sorted(lease.seq_ids)

    def note_expired(self, num_sequences: int) -> None:
        """Count one expired lease and the sequences its expiry freed (a journaled command)."""
        self.num_expired += 1
        self.num_expired_sequences += num_sequences

    # --- snapshots (block_manager_svc/records.py): ttl and members; deadlines restart fresh ----
    def export(self) -> dict:
        """The table as plain data, for comparing states (tests, fault scenarios)."""
        return {
            "leases": {lid: (lease.ttl_s, sorted(lease.seq_ids)) for lid, lease in self.leases.items()},
            "num_expired": self.num_expired,
            "num_expired_sequences": self.num_expired_sequences,
        }

    def restore(
        self, leases: Iterable[tuple[str, float, Iterable[str]]], num_expired: int, num_expired_sequences: int
    ) -> None:
        """Replace the table with (lease id, ttl, members) from a snapshot (records.py); every
        lease gets a fresh full TTL."""
        now = self.clock()
        self.leases.clear()
        self.lease_of.clear()
        for lid, ttl, seqs in leases:
            self.leases[lid] = Lease(lid, ttl, now + ttl, set(seqs))
            for s in seqs:
                self.lease_of[s] = lid
        self.num_expired = num_expired
        self.num_expired_sequences = num_expired_sequences

    def refresh_all(self) -> None:
        """Give every lease a fresh full TTL (after recovery)."""
        now = self.clock()
        for lease in self.leases.values():
            lease.deadline = now + lease.ttl_s
