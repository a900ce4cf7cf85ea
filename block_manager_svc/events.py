"""KV events for cache-aware routers: the ``WatchEvents`` stream (docs/observability.md).

The core's block pool appends a typed record (block_manager_svc/core/kv_events.py)
for each registered block (BlockStored), each evicted registered block
(BlockRemoved) and each reset (AllBlocksCleared) to a plain list, ``pool.events``;
after every call the servicer's core stage
(block_manager_svc/handlers.py) takes that list (``BlockManager.take_events``)
and hands it to :meth:`EventHub.publish` together with the calling tenant, as
data. The hub runs under the servicer's state lock and never blocks: every
subscriber has a bounded queue, and one that falls behind is dropped (its
stream ends with RESOURCE_EXHAUSTED) instead of slowing the state lock down.

Cost: with authentication off the core records events only while at least one
watcher or sink is connected (``pool.events is None`` otherwise: one test per
registered block). With authentication on it records them always, because the
hub remembers which tenant stored each hash (a tenant sees only its own events).

Besides gRPC watchers the hub feeds *sinks*: callables registered with
``add_sink`` (the ZeroMQ publisher of block_manager_svc/kv_events_zmq.py is
one). A sink is called under the state lock with every event of every tenant,
including the stored block's token ids, and must not block.

Every stream starts with AllBlocksCleared and a BlockStored snapshot of what
is cached now, then live events; versions rise by one per event.
ResetPrefixCache sends AllBlocksCleared to every watcher (the hashes it
named are gone: the cache host that held their KV was replaced).

Only what stays applied is published. While a request is journaled its events
are held (``hold``) and fanned out once its record is written (``release``);
a request whose write fails is rolled back and its events are dropped. A
rollback (block_manager_svc/reliability.py, a journal that cannot be written)
may also undo what watchers were already told (a record written whose fsync
then failed), so it ends with ``resync``: AllBlocksCleared and a BlockStored
for every block cached in the restored state, what a new stream starts with.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from pagedkv.auth import current_tenant  # the consumer side: which tenant is watching
from pagedkv.block_manager_svc.core.kv_events import (
    ALL_BLOCKS_CLEARED,
    AllBlocksCleared,
    BlockStored,
    PoolEvent,
)
from pagedkv.block_manager_svc.core.kv_groups import group_key, split_key
from pagedkv.v1 import block_manager_pb2 as pb

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.core import BlockManager

log = structlog.get_logger("pagedkv.block_manager")

UNKNOWN_TENANT = "?"  # blocks restored from a snapshot and never referenced since: admins only
_END = object()

# (version, the event): called under the state lock for every event of every tenant.
Sink = Callable[[int, PoolEvent], None]
# A subscriber's queue holds (version, tenant, event), and _END when it was dropped.
_Item = tuple[int, str, PoolEvent]


class _Subscriber:
    __slots__ = ("dropped", "q", "tenant")

    def __init__(self, tenant: str | None, size: int) -> None:
        self.q: queue.Queue[Any] = queue.Queue(size)
        self.tenant = tenant  # None = every tenant (admin, or authentication off)
        self.dropped = False


class EventHub:
    def __init__(
        self, lock: Any, max_watchers: int = 4, queue_size: int = 10_000, tenancy: bool = False
    ) -> None:
        self.lock = lock  # the servicer's state lock (events are produced under it)
        self.max_watchers = max_watchers
        self.queue_size = queue_size
        self.tenancy = tenancy
        self.version = 0
        self.owner: dict[bytes, str] = {}  # hash -> tenant (tenancy only)
        self.subs: list[_Subscriber] = []
        self.sinks: list[Sink] = []
        self.num_dropped = 0
        self._core: BlockManager | None = None
        self._mu = threading.Lock()  # subscriber list changes (also taken under `lock`)
        # Events of the request being journaled, held until its record is written (see `hold`).
        self._held: list[tuple[list[PoolEvent], str | None]] | None = None

    # --- wiring -----------------------------------------------------------------
    def attach(self, core: BlockManager) -> None:
        """Point at a (new) core; with tenancy, learn the owners of what is cached now."""
        with self.lock:
            self._core = core
            if self.tenancy:
                block_hash = core.pool.block_hash
                self.owner = {}
                for seq in core.seqs.values():
                    t = seq.tenant
                    for b in seq.block_ids:
                        h = block_hash[b]
                        if h is not None:
                            self.owner[h] = t
                for h in core.pool.index:
                    self.owner.setdefault(h, UNKNOWN_TENANT)
                core.enable_events(True)
            else:
                core.enable_events(bool(self.subs or self.sinks))

    def add_sink(self, sink: Sink) -> None:
        """Feed `sink` every event from now on (the pool stays attached while any sink exists)."""
        with self.lock:
            self.sinks.append(sink)
            if self._core is not None:
                self._core.enable_events(True)

    # --- producer side (under the state lock) ---------------------------------------
    def publish(self, events: list[PoolEvent], tenant: str | None) -> None:
        """Events one core call produced, in order; `tenant` made the call (None:
        authentication off, or an internal call such as a lease expiry)."""
        if self._held is not None:
            self._held.append((events, tenant))
            return
        for ev in events:
            self._one(ev, tenant)

    def hold(self) -> None:
        """Keep what `publish` gets until `release`: a journaled request's events wait for its
        record to be written (under the state lock, like `publish`)."""
        self._held = []

    def release(self, publish: bool) -> None:
        """End `hold`: fan the held events out (the record was written), or drop them (the
        request was rolled back: watchers must never hear of what did not stay applied)."""
        held, self._held = self._held, None
        if publish and held:
            for events, tenant in held:
                for ev in events:
                    self._one(ev, tenant)

    def resync(self, core: BlockManager) -> None:
        """After the state was rolled back to `core`: tell every watcher and sink to forget what
        it was told (AllBlocksCleared) and what is cached now (a BlockStored per block, chained
        as in the index; token ids are not kept for cached blocks, so a sink gets none)."""
        with self.lock:
            self._held = None
            self._one(ALL_BLOCKS_CLEARED, None)
            self.attach(core)  # with tenancy: who owns each cached hash, from the restored state
            pool = core.pool
            if not (self.subs or self.sinks):
                return
            owners = dict(self.owner)
            for key, b in pool.index.items():
                self._one(_stored(b, key, pool.parent_hash[b]), owners.get(key, UNKNOWN_TENANT))

    def _one(self, ev: PoolEvent, caller: str | None) -> None:
        self.version += 1
        version = self.version
        for sink in self.sinks:
            sink(version, ev)
        if isinstance(ev, AllBlocksCleared):  # ResetPrefixCache: every tenant's blocks are gone
            self.owner.clear()
            if self.subs:
                for s in tuple(self.subs):
                    try:
                        s.q.put_nowait((version, s.tenant or "", ev))
                    except queue.Full:
                        self._drop(s)
            return
        if self.tenancy:
            key = group_key(ev.block_hash, ev.group)  # the pool's index key
            if isinstance(ev, BlockStored):
                tenant = caller if caller is not None else UNKNOWN_TENANT
                self.owner[key] = tenant
            else:
                tenant = self.owner.pop(key, UNKNOWN_TENANT)
        else:
            tenant = ""
        if not self.subs:
            return
        item = (version, tenant, ev)
        for s in tuple(self.subs):  # _drop may remove one
            if s.tenant is not None and s.tenant != tenant:
                continue
            try:
                s.q.put_nowait(item)
            except queue.Full:
                self._drop(s)

    def _drop(self, s: _Subscriber) -> None:
        if s.dropped:
            return
        s.dropped = True
        self.num_dropped += 1
        with self._mu:
            if s in self.subs:
                self.subs.remove(s)
        if not self.subs and not self.sinks and not self.tenancy and self._core is not None:
            self._core.enable_events(False)
        try:
            s.q.get_nowait()  # room for the end marker
        except queue.Empty:
            pass
        s.q.put_nowait(_END)

    # --- consumer side (one gRPC thread per stream) -------------------------------------
    def watch(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.KvEvent]:
        t = current_tenant.get()
        if request.all_tenants and t is not None and not t.admin:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {t.name!r} is not an admin: all_tenants is for admins",
            )
        scope = None if (t is None or (t.admin and request.all_tenants)) else t.name
        if t is not None and t.admin and not request.all_tenants:
            scope = t.name
        sub = _Subscriber(scope, self.queue_size)
        with self.lock:
            if len(self.subs) >= self.max_watchers:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.max_watchers} event watchers are connected already (max_event_watchers)",
                )
            core = self._core
            assert core is not None
            version = self.version
            snapshot = [
                (h, b, core.pool.parent_hash[b])
                for h, b in core.pool.index.items()
                if scope is None or self.owner.get(h) == scope
            ]
            with self._mu:
                self.subs.append(sub)
            core.enable_events(True)
        log.info("event_watcher_connected", tenant=scope, snapshot_blocks=len(snapshot), version=version)
        done = threading.Event()

        def on_done() -> None:
            done.set()
            self._leave(sub)

        context.add_callback(on_done)
        try:
            yield pb.KvEvent(version=version, tenant=scope or "", all_blocks_cleared=pb.AllBlocksCleared())
            for i in range(0, len(snapshot), 256):
                chunk = snapshot[i : i + 256]
                for key, b, parent in chunk:
                    ev = _stored(b, key, parent)
                    yield pb.KvEvent(
                        version=version,
                        tenant=(scope or self.owner.get(key, "")),
                        block_stored=pb.BlockStored(
                            block_hashes=[ev.block_hash],
                            parent_block_hash=ev.parent_hash or b"",
                            block_ids=[b],
                            group=ev.group,
                        ),
                    )
            while not done.is_set():
                try:
                    item = sub.q.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if item is _END:
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this watcher fell more than {self.queue_size} events behind and was dropped; "
                        "reconnect (the stream restarts with a snapshot)",
                    )
                yield from self._coalesce(item, sub.q)
        finally:
            self._leave(sub)

    def _coalesce(self, first: _Item, q: queue.Queue[Any]) -> Iterator[pb.KvEvent]:
        """One KvEvent per run of consecutive events of one kind and tenant (a stored chain)."""
        item: _Item = first
        while True:
            version, tenant, ev = item
            if isinstance(ev, AllBlocksCleared):
                yield pb.KvEvent(version=version, tenant=tenant, all_blocks_cleared=pb.AllBlocksCleared())
                return
            stored = isinstance(ev, BlockStored)
            parent = ev.parent_hash if isinstance(ev, BlockStored) else None
            group = ev.group
            hashes = [ev.block_hash]
            blocks = [ev.block] if isinstance(ev, BlockStored) else []
            while True:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    nxt = None
                if nxt is None or nxt is _END:
                    break
                n_ev = nxt[2]
                if nxt[1] != tenant or isinstance(n_ev, AllBlocksCleared) or n_ev.group != group:
                    break
                if stored:
                    if not isinstance(n_ev, BlockStored) or n_ev.parent_hash != hashes[-1]:
                        break
                    blocks.append(n_ev.block)
                elif isinstance(n_ev, BlockStored):
                    break
                version = nxt[0]
                hashes.append(n_ev.block_hash)
            yield self._event(version, tenant, stored, hashes, blocks, parent, group)
            if nxt is None:
                return
            if nxt is _END:
                q.put_nowait(_END)
                return
            item = nxt

    @staticmethod
    def _event(
        version: int,
        tenant: str,
        stored: bool,
        hashes: list[bytes],
        blocks: list[int],
        parent: bytes | None,
        group: int = 0,
    ) -> pb.KvEvent:
        if stored:
            return pb.KvEvent(
                version=version,
                tenant=tenant,
                block_stored=pb.BlockStored(
                    block_hashes=hashes, parent_block_hash=parent or b"", block_ids=blocks, group=group
                ),
            )
        return pb.KvEvent(
            version=version, tenant=tenant, block_removed=pb.BlockRemoved(block_hashes=hashes, group=group)
        )

    def _leave(self, sub: _Subscriber) -> None:
        with self._mu:
            if sub in self.subs:
                self.subs.remove(sub)
            else:
                return
        if not self.subs and not self.sinks and not self.tenancy:
            with self.lock:
                if not self.subs and not self.sinks and self._core is not None:
                    self._core.enable_events(False)


def _stored(block: int, key: bytes, parent: bytes | None) -> BlockStored:
    """A cached block as a BlockStored event, from the pool's index key (core/kv_groups.py: a
    group's key is its chain hash and the group)."""
    h, group = split_key(key)
    return BlockStored(block, h, None if parent is None else split_key(parent)[0], None, group)
