"""The block manager's state as explicit, versioned records: what a snapshot holds.

Next to commands.py (the state *changes* the journal records), this module is the
state itself: one hand-written msgspec struct per piece of the core and the
reliability stage, :func:`to_record` / :func:`core_from_record` (and the lease
and dedupe counterparts) that copy each field by name, and the migrations, in
one place. Nothing is found by reflection: a field the core gains is persisted
only when it is added here (tests/block_manager_svc/test_records.py fails until
it is), and a state file can only ever build these types (no pickle, no class
names). This module names the private attributes of the eviction policies and
the victim queue on purpose: their exact order is state (a restored pool must
evict and preempt in the same order), and this is the one module allowed to
know them.

What is state and what is not:

* persisted: the pool (ref counts, free list order, the prefix index and tree,
  the eviction policy's exact order), the CPU pool, every sequence, the fork
  groups, the preemption state (victim queue, requeued arrivals, counters),
  the admission counters, the tenant ledger, the lease table (ttl and members;
  deadlines restart fresh, see leases.py) and the dedupe window;
* derived from the config, not persisted: block size, cost model, which
  eviction policy, whether preemption is on;
* wiring, not state: the KV-event hub (the pool's buffer is persisted only as
  "events on", it is drained after every call) and the Preempter's callbacks.

Versions (:data:`VERSION`, the ``version`` field of :class:`StateRecord`):

* 1: a pickle (``PKVSNAP1``): refused by snapshot.py, never unpickled.
* 2: a reflective export of the core objects' attributes (tagged nodes naming
  core classes, see :func:`_v2_node`): migrated by :func:`_migrate_v2`, which
  reads the nodes as data (it never looks a class up) and knows that layout's
  field names, including the defaults for fields older version-2 documents lack.
* 3: these records.

A later version that changes a record adds its migration to :data:`MIGRATIONS`
(from version N's plain document to N+1's), and :func:`decode` runs them in
order before building the records. This module is the only place that knows
any old format.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from pagedkv.block_manager_svc.commands import DedupeEntry
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.eviction import EvictionPolicy, LruEviction, LruSizeEviction
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.block_manager_svc.core.preemption import Preempter, VictimQueue
from pagedkv.block_manager_svc.core.prefix_cache import encode_tokens
from pagedkv.block_manager_svc.core.sequence import SeqState
from pagedkv.block_manager_svc.core.tenants import NULL_LEDGER, Quota, TenantLedger, Usage
from pagedkv.block_manager_svc.idempotency import DedupeTable
from pagedkv.block_manager_svc.leases import LeaseTable

VERSION = 3


class StateError(ValueError):
    """A state document this version cannot load (unknown version, malformed, inconsistent)."""


class _Rec(msgspec.Struct, array_like=True, frozen=True):
    """Every record repeats ``frozen=True``: msgspec inherits it, type checkers do not."""


# --- the records ------------------------------------------------------------------------
class ConfigRecord(msgspec.Struct, frozen=True):
    """CoreConfig, field by field (the pool geometry is checked against the settings first)."""

    num_gpu_blocks: int
    block_size: int
    num_cpu_blocks: int
    eviction_policy: str
    enable_prefix_caching: bool
    preemption_mode: str
    watermark_blocks: int
    kv_bytes_per_block: int
    host_link_bytes_per_s: float
    prefill_tokens_per_s: float
    miss_cost_tokens: float
    # Capacity as bytes; the defaults are what a state written before them meant.
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int = 0
    # KV-cache groups as (kind, window tokens); empty: one full group (a state written before
    # groups existed, and every one-group state: its bytes are as they were).
    kv_groups: list[tuple[str, int]] = []


class LruRecord(_Rec, frozen=True, tag="lru"):
    """LruEviction: cached blocks, least recently released first, and those set aside as inner."""

    order: list[int]
    aside: list[int]


class LruSizeRecord(_Rec, frozen=True, tag="lru-size"):
    """LruSizeEviction: the inflation clock, per-block scores, hits, states and entry ticks,
    the leaf heap (entries as stored, stale ones included: the layout is the pop order's
    tie-breaker), the waiting entry and the inner blocks in insertion order."""

    clock: float
    score: list[float]
    hits: list[int]
    state: bytes
    gen: list[int]
    tick: int
    leaves: list[tuple[float, int, int]]
    pending: tuple[float, int, int] | None
    inner: list[int]
    length: int


EvictionRecord = LruRecord | LruSizeRecord


class PoolRecord(_Rec, frozen=True):
    ref_counts: list[int]
    free_list: list[int]  # in order: the stack hands out its last entry next
    block_hash: list[bytes | None]
    parent_hash: list[bytes | None]
    depth: list[int]
    child_count: list[tuple[bytes, int]]
    index: list[tuple[bytes, int]]
    eviction: EvictionRecord
    num_evicted: int
    events_enabled: bool


class CpuPoolRecord(_Rec, frozen=True):
    ref_counts: list[int]
    free_list: list[int]


class SeqRecord(_Rec, frozen=True):
    """SeqState, field by field (see core/sequence.py for what each means)."""

    seq_id: str
    block_ids: list[int]
    num_tokens: int
    pending_tokens: list[int] | None
    last_hash: bytes
    num_hashed_blocks: int
    priority: int
    arrival: int
    group: int
    cpu_block_ids: list[int] | None
    num_committed: int
    pending_hashes: list[bytes]
    tenant: str
    # Later than the first version-3 documents: a record without it holds no block ahead.
    ahead_block: int = -1


class VictimQueueRecord(_Rec, frozen=True):
    heap: list[tuple[int, int, int, str]]  # as stored (layout included: planning walks it)
    live: list[tuple[str, int]]
    tick: int


class PreemptionRecord(_Rec, frozen=True):
    victims: VictimQueueRecord
    requeued: list[tuple[str, int]]  # oldest first: the bound drops from the front
    recently_preempted: list[tuple[str, str]]
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    preemption_cost_s: float


class QuotaRecord(_Rec, frozen=True):
    max_gpu_blocks: int
    max_cpu_blocks: int
    max_sequences: int


class UsageRecord(_Rec, frozen=True):
    gpu_blocks: int
    cpu_blocks: int
    sequences: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int


class LedgerRecord(_Rec, frozen=True):
    quotas: list[tuple[str, QuotaRecord]]
    default_quota: QuotaRecord
    usage: list[tuple[str, UsageRecord]]


class KVTablesRecord(_Rec, frozen=True):
    """A sequence's tables of KV groups 1.. (core/kv_groups.py: a window group's live tail), on
    the GPU while running, in the CPU pool while swapped."""

    seq_id: str
    kv_tables: list[list[int]]
    cpu_kv_tables: list[list[int]] | None


class CoreRecord(_Rec, frozen=True):
    pool: PoolRecord
    cpu: CpuPoolRecord
    running: list[SeqRecord]  # in the manager's table order
    swapped: list[SeqRecord]
    groups: list[tuple[int, list[str]]]
    preemption: PreemptionRecord
    arrivals: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_committed_blocks: int
    num_cow_copies: int
    num_prefix_cache_resets: int
    ledger: LedgerRecord | None  # None: tenancy off
    # With several KV groups, every sequence's other tables (running, then swapped); empty with
    # one group, and in a state written before groups existed.
    kv_tables: list[KVTablesRecord] = []


class LeaseRecord(_Rec, frozen=True):
    lease_id: str
    ttl_s: float
    seq_ids: list[str]


class LeaseTableRecord(_Rec, frozen=True):
    leases: list[LeaseRecord]
    num_expired: int
    num_expired_sequences: int


class StateRecord(msgspec.Struct, frozen=True):
    """A whole snapshot. A map (not an array) so that any version's ``version`` reads alike."""

    version: int
    config: ConfigRecord
    core: CoreRecord
    leases: LeaseTableRecord
    dedupe: list[DedupeEntry]


# --- core -> records -------------------------------------------------------------------------
def config_record(c: CoreConfig) -> ConfigRecord:
    return ConfigRecord(
        num_gpu_blocks=c.num_gpu_blocks,
        block_size=c.block_size,
        num_cpu_blocks=c.num_cpu_blocks,
        eviction_policy=c.eviction_policy,
        enable_prefix_caching=c.enable_prefix_caching,
        preemption_mode=c.preemption_mode,
        watermark_blocks=c.watermark_blocks,
        kv_bytes_per_block=c.kv_bytes_per_block,
        host_link_bytes_per_s=c.host_link_bytes_per_s,
        prefill_tokens_per_s=c.prefill_tokens_per_s,
        miss_cost_tokens=c.miss_cost_tokens,
        kv_cache_dtype=c.kv_cache_dtype,
        kv_cache_memory_bytes=c.kv_cache_memory_bytes,
        kv_groups=[] if len(c.kv_groups) == 1 else [(g.kind, g.window_tokens) for g in c.kv_groups],
    )


def _eviction_record(p: EvictionPolicy) -> EvictionRecord:
    if isinstance(p, LruEviction):
        return LruRecord(list(p._order), list(p._aside))
    if isinstance(p, LruSizeEviction):
        return LruSizeRecord(
            clock=p.clock,
            score=list(p._score),
            hits=list(p._hits),
            state=bytes(p._state),
            gen=list(p._gen),
            tick=p._tick,
            leaves=list(p._leaves),
            pending=p._pending,
            inner=list(p._inner),
            length=p._len,
        )
    raise StateError(f"no record for eviction policy {type(p).__name__}")


def _seq_record(s: SeqState) -> SeqRecord:
    return SeqRecord(
        seq_id=s.seq_id,
        block_ids=list(s.block_ids),
        num_tokens=s.num_tokens,
        pending_tokens=None if s.pending_tokens is None else s.pending_tokens.tolist(),
        last_hash=s.last_hash,
        num_hashed_blocks=s.num_hashed_blocks,
        priority=s.priority,
        arrival=s.arrival,
        group=s.group,
        cpu_block_ids=None if s.cpu_block_ids is None else list(s.cpu_block_ids),
        num_committed=s.num_committed,
        pending_hashes=list(s.pending_hashes),
        tenant=s.tenant,
        ahead_block=s.ahead_block,
    )


def _preemption_record(p: Preempter) -> PreemptionRecord:
    q = p.victims
    return PreemptionRecord(
        victims=VictimQueueRecord(list(q._heap), list(q._live.items()), q._tick),
        requeued=list(p.requeued.items()),
        recently_preempted=list(p.recently_preempted.items()),
        num_preemptions_swap=p.num_preemptions_swap,
        num_preemptions_recompute=p.num_preemptions_recompute,
        num_swapped_out_blocks=p.num_swapped_out_blocks,
        num_swapped_in_blocks=p.num_swapped_in_blocks,
        preemption_cost_s=p.preemption_cost_s,
    )


def _quota_record(q: Quota) -> QuotaRecord:
    return QuotaRecord(q.max_gpu_blocks, q.max_cpu_blocks, q.max_sequences)


def _ledger_record(bm: BlockManager) -> LedgerRecord | None:
    led = bm.tenants
    if led is None:
        return None
    return LedgerRecord(
        quotas=[(t, _quota_record(q)) for t, q in led.quotas.items()],
        default_quota=_quota_record(led.default_quota),
        usage=[
            (
                t,
                UsageRecord(
                    u.gpu_blocks,
                    u.cpu_blocks,
                    u.sequences,
                    u.prefix_query_tokens,
                    u.prefix_hit_tokens,
                    u.preemptions,
                ),
            )
            for t, u in led.usage.items()
        ],
    )


def core_record(bm: BlockManager) -> CoreRecord:
    """The core's whole state (call under the state lock)."""
    pool, cpu = bm.pool, bm.cpu
    return CoreRecord(
        pool=PoolRecord(
            ref_counts=list(pool.ref_counts),
            free_list=list(pool.free_list),
            block_hash=list(pool.block_hash),
            parent_hash=list(pool.parent_hash),
            depth=list(pool.depth),
            child_count=list(pool.child_count.items()),
            index=list(pool.index.items()),
            eviction=_eviction_record(pool.eviction_policy),
            num_evicted=pool.num_evicted,
            events_enabled=pool.events is not None,
        ),
        cpu=CpuPoolRecord(list(cpu.ref_counts), list(cpu.free_list)),
        running=[_seq_record(s) for s in bm.seqs.values()],
        swapped=[_seq_record(s) for s in bm.swapped.values()],
        groups=[(g, sorted(members)) for g, members in bm.groups.items()],
        preemption=_preemption_record(bm.preemption),
        arrivals=bm._arrivals,
        prefix_query_tokens=bm.prefix_query_tokens,
        prefix_hit_tokens=bm.prefix_hit_tokens,
        num_committed_blocks=bm.num_committed_blocks,
        num_cow_copies=bm.num_cow_copies,
        num_prefix_cache_resets=bm.num_prefix_cache_resets,
        ledger=_ledger_record(bm),
        kv_tables=[
            KVTablesRecord(
                s.seq_id,
                [list(t) for t in s.kv_tables],
                None if s.cpu_kv_tables is None else [list(t) for t in s.cpu_kv_tables],
            )
            for s in (*bm.seqs.values(), *bm.swapped.values())
        ]
        if bm.multi
        else [],
    )


def lease_table_record(t: LeaseTable) -> LeaseTableRecord:
    return LeaseTableRecord(
        leases=[LeaseRecord(lid, lease.ttl_s, sorted(lease.seq_ids)) for lid, lease in t.leases.items()],
        num_expired=t.num_expired,
        num_expired_sequences=t.num_expired_sequences,
    )


def to_record(core: BlockManager, leases: LeaseTable, dedupe: DedupeTable) -> StateRecord:
    """The whole state as records (call under the state lock)."""
    return StateRecord(
        version=VERSION,
        config=config_record(core.config),
        core=core_record(core),
        leases=lease_table_record(leases),
        dedupe=[DedupeEntry(*e) for e in dedupe.export()],
    )


# --- records -> core ---------------------------------------------------------------------------
def config_of(r: ConfigRecord) -> CoreConfig:
    return CoreConfig(
        num_gpu_blocks=r.num_gpu_blocks,
        block_size=r.block_size,
        num_cpu_blocks=r.num_cpu_blocks,
        eviction_policy=r.eviction_policy,
        enable_prefix_caching=r.enable_prefix_caching,
        preemption_mode=r.preemption_mode,
        watermark_blocks=r.watermark_blocks,
        kv_bytes_per_block=r.kv_bytes_per_block,
        host_link_bytes_per_s=r.host_link_bytes_per_s,
        prefill_tokens_per_s=r.prefill_tokens_per_s,
        miss_cost_tokens=r.miss_cost_tokens,
        kv_cache_dtype=r.kv_cache_dtype,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        kv_groups=tuple(KVGroup(kind, w) for kind, w in r.kv_groups) if r.kv_groups else ONE_GROUP,  # type: ignore[arg-type]
    )


def _check_len(what: str, items: Any, n: int) -> None:
    if len(items) != n:
        raise StateError(f"the state's {what} has {len(items)} entries; the pool has {n}")


def _restore_eviction(p: EvictionPolicy, r: EvictionRecord, n: int) -> None:
    if isinstance(p, LruEviction) and isinstance(r, LruRecord):
        p._order = OrderedDict.fromkeys(r.order)
        p._aside = OrderedDict.fromkeys(r.aside)
        return
    if isinstance(p, LruSizeEviction) and isinstance(r, LruSizeRecord):
        for what, items in (("score", r.score), ("hits", r.hits), ("state", r.state), ("gen", r.gen)):
            _check_len(f"eviction {what}", items, n)
        p.clock = r.clock
        p._score = list(r.score)
        p._hits = list(r.hits)
        p._state = bytearray(r.state)
        p._gen = list(r.gen)
        p._tick = r.tick
        p._leaves = list(r.leaves)
        p._pending = r.pending
        p._inner = OrderedDict.fromkeys(r.inner)
        p._len = r.length
        return
    raise StateError(f"the state's eviction record is {type(r).__name__}, the config says {p.name!r}")


def _seq(r: SeqRecord) -> SeqState:
    return SeqState(
        seq_id=r.seq_id,
        block_ids=list(r.block_ids),
        num_tokens=r.num_tokens,
        pending_tokens=None if r.pending_tokens is None else encode_tokens(r.pending_tokens),
        last_hash=r.last_hash,
        num_hashed_blocks=r.num_hashed_blocks,
        priority=r.priority,
        arrival=r.arrival,
        group=r.group,
        cpu_block_ids=None if r.cpu_block_ids is None else list(r.cpu_block_ids),
        num_committed=r.num_committed,
        pending_hashes=list(r.pending_hashes),
        tenant=r.tenant,
        ahead_block=r.ahead_block,
    )


def _quota(r: QuotaRecord) -> Quota:
    return Quota(r.max_gpu_blocks, r.max_cpu_blocks, r.max_sequences)


def core_from_record(config: CoreConfig, r: CoreRecord) -> BlockManager:
    """A core built for `config`, then given the recorded state field by field. Raises StateError
    when the record does not fit the config or its bookkeeping is inconsistent (the invariant
    checker runs on the result)."""
    bm = BlockManager(config)
    pool, cpu, n = bm.pool, bm.cpu, config.num_gpu_blocks
    p = r.pool
    for what, items in (
        ("ref counts", p.ref_counts),
        ("block hashes", p.block_hash),
        ("parent hashes", p.parent_hash),
        ("depths", p.depth),
    ):
        _check_len(what, items, n)
    pool.ref_counts = list(p.ref_counts)
    pool.free_list = list(p.free_list)
    pool.block_hash[:] = p.block_hash  # in place: the lru policy is bound to this list
    pool.parent_hash = list(p.parent_hash)
    pool.depth = list(p.depth)
    pool.child_count.update(p.child_count)  # in place, likewise
    pool.index = dict(p.index)
    _restore_eviction(pool.eviction_policy, p.eviction, n)
    pool.num_evicted = p.num_evicted
    pool.events = [] if p.events_enabled else None
    _check_len("CPU ref counts", r.cpu.ref_counts, config.num_cpu_blocks)
    cpu.ref_counts = list(r.cpu.ref_counts)
    cpu.free_list = list(r.cpu.free_list)
    bm.seqs.update((s.seq_id, _seq(s)) for s in r.running)  # in place: the Preempter shares them
    bm.swapped.update((s.seq_id, _seq(s)) for s in r.swapped)
    bm.groups.update((g, set(members)) for g, members in r.groups)
    for kt in r.kv_tables:
        seq = bm.seqs.get(kt.seq_id) or bm.swapped.get(kt.seq_id)
        if seq is None:
            raise StateError(f"the state's KV-group tables name {kt.seq_id!r}, which it does not hold")
        seq.kv_tables = [list(t) for t in kt.kv_tables]
        seq.cpu_kv_tables = None if kt.cpu_kv_tables is None else [list(t) for t in kt.cpu_kv_tables]
    pr, pre = r.preemption, bm.preemption
    q = VictimQueue()
    q._heap = list(pr.victims.heap)
    q._live = dict(pr.victims.live)
    q._tick = pr.victims.tick
    pre.victims = q
    pre.requeued = dict(pr.requeued)
    pre.recently_preempted = dict(pr.recently_preempted)
    pre.num_preemptions_swap = pr.num_preemptions_swap
    pre.num_preemptions_recompute = pr.num_preemptions_recompute
    pre.num_swapped_out_blocks = pr.num_swapped_out_blocks
    pre.num_swapped_in_blocks = pr.num_swapped_in_blocks
    pre.preemption_cost_s = pr.preemption_cost_s
    bm._arrivals = r.arrivals
    bm.prefix_query_tokens = r.prefix_query_tokens
    bm.prefix_hit_tokens = r.prefix_hit_tokens
    bm.num_committed_blocks = r.num_committed_blocks
    bm.num_cow_copies = r.num_cow_copies
    bm.num_prefix_cache_resets = r.num_prefix_cache_resets
    if r.ledger is not None:
        led = r.ledger
        bm.ledger = pre.ledger = TenantLedger(
            quotas={t: _quota(qr) for t, qr in led.quotas},
            default_quota=_quota(led.default_quota),
            usage={
                t: Usage(
                    u.gpu_blocks,
                    u.cpu_blocks,
                    u.sequences,
                    u.prefix_query_tokens,
                    u.prefix_hit_tokens,
                    u.preemptions,
                )
                for t, u in led.usage
            },
        )
    else:
        bm.ledger = pre.ledger = NULL_LEDGER
    try:
        bm.check_invariants()
    except (AssertionError, IndexError, KeyError) as e:
        raise StateError(f"the state's bookkeeping is inconsistent: {e or type(e).__name__}") from None
    return bm


def restore_leases(t: LeaseTable, r: LeaseTableRecord) -> None:
    leases = [(lr.lease_id, lr.ttl_s, lr.seq_ids) for lr in r.leases]
    t.restore(leases, r.num_expired, r.num_expired_sequences)


def restore_dedupe(t: DedupeTable, entries: list[DedupeEntry]) -> None:
    t.restore([(e.request_id, e.method, e.digest, e.reply, e.wall_time) for e in entries])


# --- bytes, versions, migrations ------------------------------------------------------------------
class _Version(msgspec.Struct):
    """Only the version of a state document (any version: the rest is not looked at)."""

    version: int | None = None


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Version)
_state_decoder = msgspec.msgpack.Decoder(StateRecord)
_plain_decoder = msgspec.msgpack.Decoder()

_REFUSED = {1: "a pickle, which a state file must never be"}


def encode(state: StateRecord) -> bytes:
    return _encoder.encode(state)


def version_of(payload: bytes) -> int | None:
    """The format version a snapshot payload was written in (before any migration)."""
    try:
        return _version_decoder.decode(payload).version
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StateError(f"the state is not a versioned state document: {e}") from None


def decode(payload: bytes) -> StateRecord:
    """The records in a snapshot payload, migrated to this version. Raises StateError naming the
    version when this version cannot load it, or what is malformed."""
    version = version_of(payload)
    if version in _REFUSED:
        raise StateError(
            f"the state is format version {version} ({_REFUSED[version]}); this version reads "
            f"versions {sorted((*MIGRATIONS, VERSION))}. Start the release that wrote it and drain it "
            "(free every sequence), then start this one on a new --state-dir"
        )
    if version != VERSION and version not in MIGRATIONS:
        raise StateError(
            f"unknown state format version {version!r} (this version reads {VERSION} and migrates "
            f"{', '.join(map(str, sorted(MIGRATIONS)))})"
        )
    try:
        if version == VERSION:
            return _state_decoder.decode(payload)
        doc = _plain_decoder.decode(payload)
        while doc["version"] != VERSION:
            doc = MIGRATIONS[doc["version"]](doc)
        return msgspec.convert(doc, StateRecord)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError, ValueError, IndexError) as e:
        raise StateError(f"the version-{version} state is malformed: {e!r}") from None


# --- version 2 -> 3 ------------------------------------------------------------------------------
_V2_ARRAY_TYPECODES = frozenset("bBhHiIlLqQ")  # token ids were packed as unsigned ints ("I")


def _v2_node(x: Any, seen: dict[int, Any]) -> Any:
    """A version-2 node as plain data: containers as lists, dicts and bytes, a core object as a
    dict of its fields by name (``"__class__"``: its class name, only ever compared, never looked
    up). ``["ref", id]`` is the container or object first written with that id."""
    if not isinstance(x, list):
        return x
    tag = x[0]
    if tag == "ref":
        return seen[x[1]]
    if tag == "tuple":
        return tuple(_v2_node(v, seen) for v in x[1])
    if tag == "array":
        if x[1] not in _V2_ARRAY_TYPECODES:
            raise ValueError(f"array typecode {x[1]!r}")
        return array(x[1], x[2]).tolist()
    if tag == "bytearray":
        seen[x[1]] = out = bytes(x[2])
        return out
    if tag in ("list", "set"):
        items: list[Any] = []
        seen[x[1]] = items
        items.extend(_v2_node(v, seen) for v in x[2])
        return items
    if tag in ("dict", "odict"):
        d: dict[Any, Any] = {}
        seen[x[1]] = d
        d.update(zip((_v2_node(k, seen) for k in x[2]), (_v2_node(v, seen) for v in x[3]), strict=True))
        return d
    if tag == "obj":
        seen[x[1]] = obj = {"__class__": str(x[2]).rpartition(":")[2]}
        obj.update(zip(x[3], (_v2_node(v, seen) for v in x[4]), strict=True))
        return obj
    raise ValueError(f"unknown node tag {tag!r}")


def _v2_seq(s: dict[str, Any]) -> SeqRecord:
    # Before Commit existed the manager registered everything a sequence held: all of it counts
    # as committed. Before tenancy, every sequence was the one tenant "".
    return SeqRecord(
        seq_id=s["seq_id"],
        block_ids=s["block_ids"],
        num_tokens=s["num_tokens"],
        pending_tokens=s["pending_tokens"],
        last_hash=s["last_hash"],
        num_hashed_blocks=s["num_hashed_blocks"],
        priority=s["priority"],
        arrival=s["arrival"],
        group=s["group"],
        cpu_block_ids=s["cpu_block_ids"],
        num_committed=s.get("num_committed", s["num_tokens"]),
        pending_hashes=s.get("pending_hashes", []),
        tenant=s.get("tenant", ""),
    )


def _v2_eviction(p: dict[str, Any]) -> EvictionRecord:
    if p["__class__"] == "LruEviction":
        return LruRecord(list(p["_order"]), list(p["_aside"]))
    if p["__class__"] == "LruSizeEviction":
        return LruSizeRecord(
            clock=p["clock"],
            score=p["_score"],
            hits=p["_hits"],
            state=p["_state"],
            gen=p["_gen"],
            tick=p["_tick"],
            leaves=[tuple(e) for e in p["_leaves"]],
            pending=None if p["_pending"] is None else tuple(p["_pending"]),
            inner=list(p["_inner"]),
            length=p["_len"],
        )
    raise ValueError(f"eviction policy {p['__class__']!r}")


def _v2_quota(q: dict[str, Any]) -> QuotaRecord:
    return QuotaRecord(q["max_gpu_blocks"], q["max_cpu_blocks"], q["max_sequences"])


def _v2_ledger(led: dict[str, Any] | None) -> LedgerRecord | None:
    if led is None or led["__class__"] != "TenantLedger":
        return None  # the null ledger, or a document from before tenancy
    return LedgerRecord(
        quotas=[(t, _v2_quota(q)) for t, q in led["quotas"].items()],
        default_quota=_v2_quota(led["default_quota"]),
        usage=[
            (
                t,
                UsageRecord(
                    u["gpu_blocks"],
                    u["cpu_blocks"],
                    u["sequences"],
                    u["prefix_query_tokens"],
                    u["prefix_hit_tokens"],
                    u["preemptions"],
                ),
            )
            for t, u in led["usage"].items()
        ],
    )


def _migrate_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """Version 2 (the reflective export) to version 3: the same state, field by field. In version
    2 the preemption state was the manager's own attributes; here it is the Preempter's record."""
    seen: dict[int, Any] = {}
    bm = _v2_node(doc["core"], seen)
    if not isinstance(bm, dict) or bm.get("__class__") != "BlockManager":
        raise ValueError("the version-2 core is not a BlockManager")
    pool, cpu, victims = bm["pool"], bm["cpu"], bm["victims"]
    core = CoreRecord(
        pool=PoolRecord(
            ref_counts=pool["ref_counts"],
            free_list=pool["free_list"],
            block_hash=pool["block_hash"],
            parent_hash=pool["parent_hash"],
            depth=pool["depth"],
            child_count=list(pool["child_count"].items()),
            index=list(pool["index"].items()),
            eviction=_v2_eviction(pool["eviction_policy"]),
            num_evicted=pool["num_evicted"],
            events_enabled=pool.get("events") is not None,
        ),
        cpu=CpuPoolRecord(cpu["ref_counts"], cpu["free_list"]),
        running=[_v2_seq(s) for s in bm["seqs"].values()],
        swapped=[_v2_seq(s) for s in bm["swapped"].values()],
        groups=[(g, sorted(members)) for g, members in bm["groups"].items()],
        preemption=PreemptionRecord(
            victims=VictimQueueRecord(
                [tuple(e) for e in victims["_heap"]], list(victims["_live"].items()), victims["_tick"]
            ),
            requeued=list(bm["requeued"].items()),
            recently_preempted=list(bm["recently_preempted"].items()),
            num_preemptions_swap=bm["num_preemptions_swap"],
            num_preemptions_recompute=bm["num_preemptions_recompute"],
            num_swapped_out_blocks=bm["num_swapped_out_blocks"],
            num_swapped_in_blocks=bm["num_swapped_in_blocks"],
            preemption_cost_s=bm["preemption_cost_s"],
        ),
        arrivals=bm["_arrivals"],
        prefix_query_tokens=bm["prefix_query_tokens"],
        prefix_hit_tokens=bm["prefix_hit_tokens"],
        num_committed_blocks=bm.get("num_committed_blocks", 0),
        num_cow_copies=bm["num_cow_copies"],
        num_prefix_cache_resets=bm.get("num_prefix_cache_resets", 0),
        ledger=_v2_ledger(bm.get("ledger")),
    )
    leases = _v2_node(doc["leases"], seen)
    dedupe = _v2_node(doc["dedupe"], seen)
    # Fields CoreConfig gained after a document was written take CoreConfig's defaults, as in version 2.
    config = CoreConfig(**{f: v for f, v in doc["config"].items() if f in ConfigRecord.__struct_fields__})
    state = StateRecord(
        version=3,
        config=config_record(config),
        core=core,
        leases=LeaseTableRecord(
            leases=[LeaseRecord(lid, ttl, list(seqs)) for lid, (ttl, seqs) in leases["leases"].items()],
            num_expired=leases["num_expired"],
            num_expired_sequences=leases["num_expired_sequences"],
        ),
        dedupe=[DedupeEntry(*entry) for entry in dedupe],
    )
    return msgspec.to_builtins(state, builtin_types=(bytes,))


# version N -> a function from version N's plain document to version N+1's.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {2: _migrate_v2}
