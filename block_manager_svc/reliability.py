"""The reliability stage of the block manager's pipeline: idempotent retries,
leases, journal + snapshots with crash recovery, deadlines (docs/reliability.md).

:class:`ReliableStage` sits between the tenancy stage and the core stage
(block_manager_svc/servicer.py shows the order). It runs every mutating RPC
(Allocate, Append, Fork, Free, Commit, Step, SwapIn, Preempt,
ResetPrefixCache) and KeepAlive, which is its own. Commits are journaled like
every mutation, so recovery restores which blocks are in the prefix cache
exactly. Every mutation runs through one path, :meth:`ReliableStage.run`:

1. a request whose deadline already passed is refused (DEADLINE_EXCEEDED)
   without touching the state;
2. with a ``request_id``: a remembered reply is returned as is; a retry of a
   request still in flight waits for it; an id reused for another request is
   INVALID_ARGUMENT;
3. under the state lock: apply (the core stage, `CoreStage.apply`), lease
   bookkeeping, journal append (one ``write``), dedupe entry, all in one
   critical section so journal order is apply order;
4. after the lock is released: wait until the record is durable (fsync
   policy ``always``; group commit), then reply.

A journal that cannot be written (a full disk, a failed fsync) does not stop
the process: the state is rolled back to what the state dir holds (the same
recovery a restart runs, `_journal_failed`), mutations are refused with
UNAVAILABLE while reads go on, and the snapshot thread retries until a snapshot
of that state and a new journal segment can be written (`try_resume`).

With no ``--state-dir``, no ``request_id``, no lease in use and none named,
step 1 and one branch are all that is added to the core stage.

The journal records what a request did, not the request: the explicit core and
lease commands it applied (block_manager_svc/commands.py; the core stage records
its core calls, `_do` this stage's lease bookkeeping) and, for a request with an
id, the reply it got. Recovery loads the snapshot (explicit, versioned state
records, block_manager_svc/records.py and snapshot.py) and applies the same commands again, so block
tables, ref counts, the prefix index, eviction order and the dedupe window come
back exactly.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import structlog

from pagedkv.block_manager_svc import commands as cmds
from pagedkv.block_manager_svc import records
from pagedkv.block_manager_svc import snapshot as snap
from pagedkv.block_manager_svc.commands import Batch, Command, DedupeEntry, ReplayError
from pagedkv.block_manager_svc.core import BlockManager, CoreError
from pagedkv.block_manager_svc.core.results import StepResult
from pagedkv.block_manager_svc.handlers import MUTATIONS, CoreStage
from pagedkv.block_manager_svc.idempotency import DedupeTable, RequestIdReused, WaitTimeout, digest
from pagedkv.block_manager_svc.journal import Journal, JournalFailed, Record, ScanReport, scan
from pagedkv.block_manager_svc.leases import MAX_LEASE_ID_LEN, LeaseTable
from pagedkv.v1 import block_manager_pb2 as pb

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

log = structlog.get_logger("pagedkv.block_manager")

MAX_TTL_MS = 24 * 3600 * 1000
# While the journal cannot be written: how often the snapshot thread tries to write again.
JOURNAL_RETRY_S = 0.5

_SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"]
# Mutations that never add or remove a sequence's lease (with no request id and no journal,
# they go straight to the core stage).
_NO_LEASE_WORK = frozenset({"Append", "Commit", "SwapIn", "Preempt", "ResetPrefixCache"})


def _response_type(method: str) -> Any:
    return getattr(pb, _SERVICE.methods_by_name[method].output_type.name)


__all__ = ["MUTATIONS", "RecoveryReport", "Reliability", "ReliableStage", "ReplayError"]


@dataclass(slots=True)
class RecoveryReport:
    snapshot_seq: int = 0
    snapshot_bytes: int = 0
    snapshot_version: int = 0  # the format it was written in (records.py)
    replayed: int = 0
    journal_bytes: int = 0
    dropped_bytes: int = 0
    dropped_segments: list[str] = field(default_factory=list)
    last_seq: int = 0
    seconds: float = 0.0


def _config_diff(a: Any, b: Any) -> str:
    try:
        return ", ".join(
            f"{f.name}={getattr(a, f.name)!r} (settings say {getattr(b, f.name)!r})"
            for f in fields(a)
            if getattr(a, f.name) != getattr(b, f.name, None)
        )
    except TypeError:
        return f"{a!r} vs {b!r}"


class ReliableStage:
    """Request-id dedupe, leases, journaling and deadlines around the core stage."""

    def __init__(self, core_stage: CoreStage) -> None:
        self.core_stage = core_stage
        self._lock = core_stage.lock  # the state lock (reentrant: the core stage takes it again)
        self.dedupe = DedupeTable()
        self.leases = LeaseTable()
        self.journal: Journal | None = None
        self.state_dir: Path | None = None
        self.snapshot_every_ops = 0
        self._snapshot_wanted = threading.Event()
        self._snapshot_mu = threading.Lock()
        self.last_snapshot_seq = 0
        self.recovery: RecoveryReport | None = None
        self.num_deadline_skipped = 0
        self.fsync_interval_ms = 5.0
        # Why mutations are refused (the journal cannot be written), or None; set and cleared under
        # the state lock.
        self.journal_error: str | None = None
        self.num_journal_failures = 0

    @property
    def _core(self) -> Any:
        """The core the core stage applies to (recovery replaces it)."""
        return self.core_stage.core

    @_core.setter
    def _core(self, core: Any) -> None:
        self.core_stage.core = core

    # --- the one mutation path -----------------------------------------------------
    def run(self, name: str, request: Any, context: Any, tenant: str | None = None) -> Any:
        """Run mutation `name` (or KeepAlive) for `tenant` (None: authentication off)."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            self.num_deadline_skipped += 1
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{name}: the deadline passed before the request was processed; nothing changed",
            )
        rid = request.request_id
        journal = self.journal
        if not rid and journal is None and not self._needs_leases(name, request):
            return self.core_stage.handlers[name](request, context, tenant)  # the hot path: nothing to add
        if self.journal_error is not None:
            self._refuse_unwritable(context, name, applied=False)
        lease_id = getattr(request, "lease_id", "")
        alloc_leases = request.alloc_lease_ids if name == "Step" else ()
        for lid in (lease_id, *alloc_leases) if alloc_leases else (lease_id,):
            if len(lid) > MAX_LEASE_ID_LEN:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"lease_id is {len(lid)} characters long; the limit is {MAX_LEASE_ID_LEN}",
                )
        dig = b""
        if rid:
            dig = digest(name, request.SerializeToString())
            try:
                # gRPC reports "no deadline" as a huge time_remaining; waits take None for that.
                wait = remaining if remaining is not None and remaining < 1e6 else None
                cached = self.dedupe.begin(rid, name, dig, wait)
            except RequestIdReused as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except WaitTimeout as e:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
            if cached is not None:
                if self.journal_error is not None:  # the reply's record may not be on disk
                    self._refuse_unwritable(context, name, applied=False)
                log.debug("retry_answered_from_dedupe", method=name, request_id=rid)
                return _response_type(name).FromString(cached)
        try:
            seq = 0
            with self._lock:
                journal = self.journal  # a new one after a journal failure
                if self.journal_error is not None:
                    self._refuse_unwritable(context, name, applied=False)
                hub = self.core_stage.events_hub if journal is not None else None
                if journal is None:
                    response, changed = self._apply(name, request, context, tenant)
                    commands: list[Command] = []
                else:
                    if hub is not None:
                        hub.hold()  # its KV events go out once its record is written
                    try:
                        with self._recording() as commands:
                            response, changed = self._apply(name, request, context, tenant)
                    except BaseException:
                        if hub is not None:
                            hub.release(publish=False)  # refused: it changed nothing
                        raise
                now = time.time()
                reply = response.SerializeToString() if rid and changed else b""
                if journal is not None and changed:
                    entry = DedupeEntry(rid, name, dig, reply, now) if rid else None
                    try:
                        seq = journal.append(cmds.RECORD_NAME, cmds.encode_batch(Batch(commands, entry)), now)
                    except JournalFailed as e:
                        if hub is not None:
                            hub.release(publish=False)  # rolled back below: never heard of
                        self._journal_failed(journal, e)  # rolls this request back
                        self._refuse_unwritable(context, name, applied=False)
                if hub is not None:
                    hub.release(publish=True)
                if rid and changed:  # a pure lease renewal is not remembered: re-running it is harmless
                    self.dedupe.put(rid, name, dig, reply, now)
            if seq:
                try:
                    journal.wait_durable(seq)  # type: ignore[union-attr]
                except JournalFailed as e:
                    self._journal_failed(journal, e)  # type: ignore[arg-type]
                    self._refuse_unwritable(context, name, applied=True)
                if self.snapshot_every_ops and journal.records_since_rotate >= self.snapshot_every_ops:  # type: ignore[union-attr]
                    self._snapshot_wanted.set()
            return response
        finally:
            if rid:
                self.dedupe.end(rid)

    def _refuse_unwritable(self, context: Any, name: str, applied: bool) -> NoReturn:
        what = (
            "the request may have been applied (its record was written but could not be made durable)"
            if applied
            else "nothing changed"
        )
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{name}: the block manager cannot write its journal ({self.journal_error}); {what}; "
            "reads are served; retry with the same request_id",
        )
        raise AssertionError("unreachable")  # aborting raises

    def _needs_leases(self, name: str, request: Any) -> bool:
        """Whether mutation `name` has lease bookkeeping to do (see `_apply`): it names a
        lease, or it adds or removes sequences while some sequence holds a lease."""
        if name in _NO_LEASE_WORK:
            return False
        if name == "Step":
            return bool(request.alloc_lease_ids) or bool(self.leases.lease_of)
        if name == "KeepAlive":
            return True
        return bool(getattr(request, "lease_id", "")) or bool(self.leases.lease_of)

    def _apply(self, name: str, request: Any, context: Any, tenant: str | None) -> tuple[Any, bool]:
        """Apply one command under the state lock: (reply, whether state changed)."""
        if name == "KeepAlive":
            return self._keepalive(request, context)
        leases = self.leases
        do = self._do
        if name == "Step":
            response, result = self.core_stage.step(request, context, tenant)
            if leases.lease_of:
                frees = [f.seq_id for f in request.frees]
                frees.extend(request.free_seq_ids)
                if frees:
                    do(cmds.LeaseDetachAll(frees))
            self._step_leases(request, result)
            return response, True
        response = self.core_stage.handlers[name](request, context, tenant)
        if name == "Allocate":
            if request.lease_id:
                do(cmds.LeaseAttach(request.seq_id, request.lease_id))
            elif leases.lease_of:
                do(cmds.LeaseDetach(request.seq_id))
        elif name == "Fork":
            lid = request.lease_id or leases.lease_of.get(request.parent_seq_id)
            if lid:
                do(cmds.LeaseAttach(request.child_seq_id, lid))
        elif name == "Free":
            do(cmds.LeaseDetach(request.seq_id))
        return response, True

    def _do(self, cmd: Command) -> Any:
        """Apply a command this stage makes itself (lease bookkeeping, lease expiry) and record it
        when the request is being journaled (under the state lock)."""
        out = cmds.apply(cmd, self._core, self.leases)
        record = self.core_stage.record
        if record is not None:
            record.append(cmd)
        return out

    def _step_leases(self, request: pb.StepRequest, result: StepResult) -> None:
        """Leases of a Step's packed allocations and forks, like Allocate's and Fork's."""
        leases = self.leases
        if not (request.alloc_lease_ids or (request.fork_child_seq_ids and leases.lease_of)):
            return
        failed_allocs = {e.index for e in result.alloc_errors}
        for j, lid in enumerate(request.alloc_lease_ids):
            if lid and j not in failed_allocs:
                self._do(cmds.LeaseAttach(request.alloc_seq_ids[j], lid))
        failed_forks = {e.index for e in result.fork_errors}
        for j, child in enumerate(request.fork_child_seq_ids):
            parent_lease = leases.lease_of.get(request.fork_parent_seq_ids[j])
            if parent_lease and j not in failed_forks:
                self._do(cmds.LeaseAttach(child, parent_lease))

    @contextmanager
    def _recording(self) -> Iterator[list[Command]]:
        """Under the state lock: the commands the request applies are collected for the journal
        (the core stage and `_do` append to this list)."""
        commands: list[Command] = []
        self.core_stage.record = commands
        try:
            yield commands
        finally:
            self.core_stage.record = None

    # --- KeepAlive ------------------------------------------------------------------
    def _keepalive(self, request: pb.KeepAliveRequest, context: Any) -> tuple[pb.KeepAliveResponse, bool]:
        lid = request.lease_id
        if not lid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id must not be empty")
        if len(lid) > MAX_LEASE_ID_LEN:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_id is {len(lid)} characters long; the limit is {MAX_LEASE_ID_LEN}",
            )
        if request.ttl_ms > MAX_TTL_MS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ttl_ms is {request.ttl_ms}; the limit is {MAX_TTL_MS} (24 h)",
            )
        for s in request.attach_seq_ids:
            try:
                self._core.block_table(s)
            except CoreError as e:
                self.core_stage._abort(context, "KeepAlive", e, s)
        created = lid not in self.leases.leases
        lease, changed = self._do(cmds.LeaseTouch(lid, request.ttl_ms / 1000.0 if request.ttl_ms else None))
        for s in request.attach_seq_ids:
            self._do(cmds.LeaseAttach(s, lid))
        resp = pb.KeepAliveResponse(
            ttl_ms=round(lease.ttl_s * 1000), num_sequences=len(lease.seq_ids), created=created
        )
        return resp, changed or bool(request.attach_seq_ids)

    # --- lease expiry -----------------------------------------------------------------
    def _expire_lease(self, lease_id: str) -> tuple[int, int]:
        """Free a lease's sequences in the core (under the lock): (sequences, blocks) freed."""
        seqs = self._do(cmds.LeaseDrop(lease_id))
        freed = released = 0
        for s in seqs:
            try:
                released += self._do(cmds.Free(s))
            except CoreError:
                continue  # already gone (a refused call is not recorded)
            freed += 1
        self._do(cmds.LeaseNoteExpired(freed))
        return freed, released

    def sweep_leases(self) -> int:
        """Expire every lease past its deadline; returns how many expired."""
        seq = 0
        with self._lock:
            journal = self.journal
            if self.journal_error is not None:
                return 0  # an expiry is a mutation: it waits for the journal (leases renew on resume)
            expired = self.leases.expired()
            for lid in expired:
                if journal is None:
                    freed, released = self._expire_lease(lid)
                else:
                    with self._recording() as commands:
                        freed, released = self._expire_lease(lid)
                    try:
                        body = cmds.encode_batch(Batch(commands))
                        seq = journal.append(cmds.RECORD_NAME, body, time.time())
                    except JournalFailed as e:
                        self._journal_failed(journal, e)
                        return 0
                log.info("lease_expired", lease_id=lid, sequences_freed=freed, blocks_released=released)
        if seq:
            try:
                journal.wait_durable(seq)  # type: ignore[union-attr]
            except JournalFailed as e:
                self._journal_failed(journal, e)  # type: ignore[arg-type]
        return len(expired)

    # --- a journal that cannot be written ---------------------------------------------------
    def _journal_failed(self, journal: Journal, err: JournalFailed) -> None:
        """Roll the state back to what the state dir holds and refuse mutations until
        `try_resume` succeeds. The state may hold changes the journal does not (a write failed
        after the core applied them) or that are not durable (an fsync failed): reloading the
        snapshot and the journal, as a restart would, leaves exactly what is on disk, which holds
        every acknowledged mutation."""
        with self._lock:
            if journal is not self.journal or self.journal_error is not None:
                return  # already rolled back (another request saw the same failure first)
            self.journal_error = str(err)
            self.num_journal_failures += 1
            journal.abandon()
            try:
                report = self._reload()
            except BaseException as e:  # noqa: BLE001
                # The files cannot be read back either: only a restart can recover.
                log.critical("journal_reload_failed", error=repr(e))
                os._exit(70)
            log.error(
                "journal_unwritable",
                reason=self.journal_error,
                rolled_back_to_seq=report.last_seq,
                dropped_bytes=report.dropped_bytes,
                sequences=len(self._core.seqs),
            )
        self._snapshot_wanted.set()  # the snapshot thread tries to write again

    def _reload(self) -> RecoveryReport:
        """Under the state lock: the state from the state dir, as at start."""
        assert self.state_dir is not None
        old = self._core
        self._core = BlockManager(old.config)  # replaced by the snapshot's core
        report = self.recover(self.state_dir)
        ledger = old.tenants
        if ledger is not None:
            self._core.enable_tenancy(ledger)
        hub = self.core_stage.events_hub
        if hub is not None:
            hub.resync(self._core)  # watchers may have been told of what the rollback undid
        return report

    def try_resume(self) -> bool:
        """After a journal failure: write a snapshot of the rolled-back state (which makes it
        durable) and open a new journal segment; on success mutations are accepted again."""
        journal, state_dir, recovery = self.journal, self.state_dir, self.recovery
        assert journal is not None and state_dir is not None and recovery is not None
        with self._snapshot_mu:
            with self._lock:
                if self.journal_error is None:
                    return True
                seq = recovery.last_seq
                payload = records.encode(self._state())
            try:
                snap.write(state_dir, seq, payload, sync=journal.policy != "off")
                fresh = Journal(state_dir, seq + 1, journal.policy, self.fsync_interval_ms)
            except OSError as e:
                log.debug("journal_still_unwritable", error=repr(e))
                return False
            with self._lock:
                self.journal = fresh
                self.journal_error = None
                self.last_snapshot_seq = seq
                self.leases.refresh_all()  # holders could not renew while refused
            try:
                fresh.delete_segments_before(seq + 1)
            except OSError as e:
                log.warning("journal_cleanup_failed", error=repr(e))
            log.info("journal_writable", seq=seq, snapshot_bytes=len(payload))
            return True

    # --- stats --------------------------------------------------------------------------
    def add_stats(self, s: pb.Stats) -> pb.Stats:
        """This stage's counters on top of the core's stats."""
        leases = self.leases
        s.num_leases = len(leases.leases)
        s.num_leases_expired = leases.num_expired
        s.num_lease_expired_sequences = leases.num_expired_sequences
        s.num_dedupe_hits = self.dedupe.hits
        s.num_dedupe_entries = len(self.dedupe)
        s.journal_seq = self.journal.last_seq if self.journal is not None else 0
        return s

    # --- snapshots and recovery -----------------------------------------------------------
    def _state(self) -> records.StateRecord:
        return records.to_record(self._core, self.leases, self.dedupe)

    def snapshot_now(self, rewrite: bool = False) -> int:
        """Write a snapshot covering every journaled record; returns its seq.
        `rewrite`: even when the last one covers them (to write it in the current format)."""
        journal, state_dir = self.journal, self.state_dir
        assert journal is not None and state_dir is not None
        with self._snapshot_mu:
            with self._lock:
                if journal.last_seq == self.last_snapshot_seq and self.last_snapshot_seq and not rewrite:
                    return self.last_snapshot_seq
                payload = records.encode(self._state())
                seq = journal.rotate()
            t0 = time.perf_counter()
            snap.write(state_dir, seq, payload, sync=journal.policy != "off")
            journal.delete_segments_before(seq + 1)
            journal.drop_retired()
            self.last_snapshot_seq = seq
            log.debug(
                "snapshot_written", seq=seq, bytes=len(payload), seconds=round(time.perf_counter() - t0, 4)
            )
            return seq

    def recover(self, state_dir: Path) -> RecoveryReport:
        """Load the newest snapshot and replay the journal after it (before serving)."""
        t0 = time.perf_counter()
        report = RecoveryReport()
        loaded = snap.load_latest(state_dir)
        if loaded is not None:
            try:
                st = records.decode(loaded.payload)
                config = records.config_of(st.config)
            except (records.StateError, ValueError) as e:
                raise snap.SnapshotError(f"the snapshot in {state_dir} cannot be loaded: {e}") from e
            self._check_geometry(config, state_dir)  # before building the core
            try:
                core = records.core_from_record(config, st.core)
            except records.StateError as e:
                raise snap.SnapshotError(f"the snapshot in {state_dir} cannot be loaded: {e}") from e
            self._core = core
            records.restore_leases(self.leases, st.leases)
            records.restore_dedupe(self.dedupe, st.dedupe)
            report.snapshot_seq = loaded.seq
            report.snapshot_version = records.version_of(loaded.payload) or 0  # as written: 2 is rewritten
            report.snapshot_bytes = loaded.size
        scan_report = ScanReport()
        for rec in scan(state_dir, report.snapshot_seq, scan_report):
            self._replay(rec)
            report.replayed += 1
        report.journal_bytes = scan_report.bytes
        report.dropped_bytes = scan_report.dropped_bytes
        report.dropped_segments = scan_report.dropped_segments
        report.last_seq = max(report.snapshot_seq, scan_report.last_seq)
        self._core.check_invariants()
        self.leases.refresh_all()
        self.last_snapshot_seq = report.snapshot_seq
        report.seconds = time.perf_counter() - t0
        self.recovery = report
        return report

    def _check_geometry(self, config: Any, state_dir: Path) -> None:
        if config != self._core.config:
            raise snap.SnapshotError(
                f"the state in {state_dir} was written with a different pool geometry: "
                f"{_config_diff(config, self._core.config)}; use the original settings "
                "or another --state-dir"
            )

    def _replay(self, rec: Record) -> None:
        """Apply one journal record: its commands into the core and lease table, its dedupe entry."""
        if rec.name not in (cmds.RECORD_NAME, cmds.RECORD_NAME_V2):
            raise ReplayError(
                f"journal record {rec.seq} ({rec.name}) was written by an older version, which journaled "
                "requests; start that version on this state dir and stop it cleanly (its final snapshot "
                "covers the journal), then start this one"
            )
        try:
            batch = cmds.decode_batch(rec.body, rec.name)
        except ReplayError as e:
            raise ReplayError(f"journal record {rec.seq}: {e}") from None
        for cmd in batch.commands:
            try:
                cmds.replay(cmd, self._core, self.leases)
            except ReplayError as e:
                raise ReplayError(f"journal record {rec.seq}: {e}") from None
        d = batch.dedupe
        if d is not None:
            self.dedupe.put(d.request_id, d.method, d.digest, d.reply, d.wall_time)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, settings: BlockManagerSettings) -> Reliability:
        """Apply the reliability settings, recover from --state-dir, start the background threads."""
        self.dedupe.max_entries = settings.dedupe_max_entries
        self.dedupe.ttl_s = settings.dedupe_ttl_s
        self.leases.default_ttl_s = settings.lease_ttl_s
        rel = Reliability(self, settings.lease_sweep_interval_s, settings.snapshot_interval_s)
        if settings.state_dir:
            state_dir = Path(settings.state_dir)
            state_dir.mkdir(parents=True, exist_ok=True)
            rel.lock_state_dir(state_dir)
            try:
                report = self.recover(state_dir)
            except BaseException:
                rel.close()  # release the state dir for a corrected restart
                raise
            self.state_dir = state_dir
            self.fsync_interval_ms = settings.fsync_interval_ms
            self.journal = Journal(state_dir, report.last_seq + 1, settings.fsync, settings.fsync_interval_ms)
            self.snapshot_every_ops = settings.snapshot_every_ops
            old_format = report.snapshot_bytes and report.snapshot_version != records.VERSION
            if report.replayed or not report.snapshot_bytes or old_format:
                self.snapshot_now(rewrite=bool(old_format))  # bounds the next recovery, records the geometry
            log.info(
                "state_recovered",
                state_dir=str(state_dir),
                snapshot_seq=report.snapshot_seq,
                replayed=report.replayed,
                journal_bytes=report.journal_bytes,
                dropped_bytes=report.dropped_bytes,
                sequences=len(self._core.seqs),
                leases=len(self.leases.leases),
                dedupe_entries=len(self.dedupe),
                seconds=round(report.seconds, 4),
                fsync=settings.fsync,
            )
        rel.start()
        return rel


class Reliability:
    """Background threads (lease sweeper, snapshotter) and shutdown of the journal."""

    def __init__(self, servicer: ReliableStage, sweep_interval_s: float, snapshot_interval_s: float) -> None:
        self.servicer = servicer
        self.sweep_interval_s = sweep_interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock_fd = -1

    def lock_state_dir(self, state_dir: Path) -> None:
        fd = os.open(state_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"state dir {state_dir} is in use by another block manager") from None
        self._lock_fd = fd

    def start(self) -> None:
        self._threads.append(threading.Thread(target=self._sweep_loop, name="bm-lease-sweeper", daemon=True))
        if self.servicer.journal is not None:
            self._threads.append(
                threading.Thread(target=self._snapshot_loop, name="bm-snapshot", daemon=True)
            )
        for t in self._threads:
            t.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.sweep_interval_s):
            try:
                self.servicer.sweep_leases()
            except Exception:
                log.exception("lease_sweep_failed")

    def _snapshot_loop(self) -> None:
        s = self.servicer
        interval = self.snapshot_interval_s or None
        while not self._stop.is_set():
            s._snapshot_wanted.wait(JOURNAL_RETRY_S if s.journal_error is not None else interval)
            s._snapshot_wanted.clear()
            if self._stop.is_set():
                return
            try:
                if s.journal_error is not None:
                    s.try_resume()
                else:
                    s.snapshot_now()
            except Exception:
                log.exception("snapshot_failed")

    def close(self) -> None:
        """Stop the threads, write a final snapshot, close the journal (after the server stopped)."""
        self._stop.set()
        self.servicer._snapshot_wanted.set()
        for t in self._threads:
            t.join()
        s = self.servicer
        if s.journal is not None:
            try:
                if s.journal_error is None:
                    s.snapshot_now()
                elif not s.try_resume():
                    log.warning("final_snapshot_skipped", reason=s.journal_error)  # the files hold the state
            finally:
                s.journal.close()
                s.journal = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
