"""Snapshots as explicit records (block_manager_svc/records.py): a round trip rebuilds the core
exactly, every attribute of the core is either persisted or knowingly derived, a version-2 state
written by the previous release is migrated to the same core, and a file of an unknown, malformed
or inconsistent version is refused with a precise error (a format-1 pickle is never unpickled)."""

from __future__ import annotations

import pickle
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.block_manager_svc import records, snapshot
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, CoreError
from pagedkv.block_manager_svc.core.tenants import Quota, TenantLedger
from pagedkv.block_manager_svc.idempotency import DedupeTable
from pagedkv.block_manager_svc.leases import LeaseTable
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.servicer import BlockManagerServicer
from pagedkv.block_manager_svc.settings import BlockManagerSettings

from .reliability.test_recovery import canonical


def _busy_core(policy: str = "lru-size") -> BlockManager:
    bm = BlockManager(
        CoreConfig(
            num_gpu_blocks=12, block_size=4, num_cpu_blocks=6, preemption_mode="swap", eviction_policy=policy
        )
    )
    bm.allocate("a", 10, list(range(10)))
    bm.commit("a", 10)
    bm.fork("a", "b")
    bm.append("b", 3, [1, 2, 3])
    bm.allocate("c", 8, [9] * 8, 1)
    bm.commit("c", 8)
    bm.free("c")  # cached blocks in the eviction policy
    bm.preempt("b", "swap")  # a swapped group on the CPU pool
    bm.allocate("d", 5, [4] * 5)
    bm.grant("d")  # a block held ahead of need
    bm.enable_tenancy(TenantLedger())
    return bm


def _round_trip(bm: BlockManager, leases: LeaseTable | None = None, dedupe: DedupeTable | None = None):  # type: ignore[no-untyped-def]
    doc = records.decode(
        records.encode(records.to_record(bm, leases or LeaseTable(), dedupe or DedupeTable()))
    )
    return doc, records.core_from_record(records.config_of(doc.config), doc.core)


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_a_round_trip_rebuilds_the_core_exactly(policy: str) -> None:
    bm = _busy_core(policy)
    leases = LeaseTable()
    leases.attach("a", "L")
    dedupe = DedupeTable()
    dedupe.put("r", "Free", b"d" * 16, b"reply", 2e9)
    doc, core = _round_trip(bm, leases, dedupe)
    assert doc.version == records.VERSION == 3 and doc.config.num_gpu_blocks == 12
    assert canonical(core) == canonical(bm)  # every attribute, private ones included
    core.check_invariants()
    assert core.tenants is not None and core.tenants.usage == bm.tenants.usage  # type: ignore[union-attr]
    # The lru policy is bound to the pool's hash list again (not to a copy of it).
    if policy == "lru":
        assert core.pool.eviction_policy._block_hash is core.pool.block_hash  # noqa: SLF001
    assert core.preemption.seqs is core.seqs and core.preemption.pool is core.pool
    back = LeaseTable()
    records.restore_leases(back, doc.leases)
    assert back.export() == leases.export()
    again = DedupeTable()
    records.restore_dedupe(again, doc.dedupe)
    assert again.export() == dedupe.export()
    # Both go on the same way.
    for c in (bm, core):
        c.allocate("e", 9, [9] * 8 + [1])
        c.swap_in("b") if c.pool.num_available > 8 else None
    assert canonical(core) == canonical(bm)


# Attributes of each core object, by what records.py does with them. A new attribute fails this
# test until it is persisted (a record field) or said to be derived from the config or wiring.
_KNOWN = {
    "BlockManager": (
        "pool cpu seqs swapped groups preemption _arrivals prefix_query_tokens prefix_hit_tokens "
        "num_committed_blocks num_cow_copies num_prefix_cache_resets ledger",
        "config block_size cost_model preempt_on kv_groups multi",
    ),
    "BlockPool": (
        "ref_counts free_list block_hash parent_hash depth child_count index eviction_policy num_evicted "
        "events",
        "num_blocks",
    ),
    "CpuPool": ("ref_counts free_list", "num_blocks"),
    "Preempter": (
        "victims requeued recently_preempted num_preemptions_swap num_preemptions_recompute "
        "num_swapped_out_blocks num_swapped_in_blocks preemption_cost_s ledger",
        "enabled mode block_size watermark_blocks cost_model pool cpu seqs swapped groups release exhausted",
    ),
    "VictimQueue": ("_heap _live _tick", ""),
    "LruEviction": ("_order _aside", "_block_hash _child_count"),
    "LruSizeEviction": (
        "clock _score _hits _state _gen _tick _leaves _pending _inner _len",
        "block_size miss_cost_tokens",
    ),
    "SeqState": (
        "seq_id block_ids num_tokens pending_tokens last_hash num_hashed_blocks priority arrival group "
        "cpu_block_ids num_committed pending_hashes tenant ahead_block kv_tables cpu_kv_tables",
        "",
    ),
}


def _attributes(obj: object) -> set[str]:
    names: set[str] = set(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return names - {"__weakref__", "__dict__"}


def test_a_state_written_before_blocks_were_granted_ahead_holds_none() -> None:
    """A version-3 sequence record without the trailing ``ahead_block`` (written before grants
    existed) reads as a sequence holding no block ahead."""
    bm = BlockManager(CoreConfig(num_gpu_blocks=12, block_size=4, num_cpu_blocks=6, preemption_mode="swap"))
    bm.allocate("x", 10, list(range(10)))
    bm.allocate("y", 3, [7, 8, 9])
    bm.preempt("y", "swap")
    doc = msgspec.msgpack.decode(records.encode(records.to_record(bm, LeaseTable(), DedupeTable())))
    running = doc["core"][2]
    assert running and doc["core"][3] and all(r[-1] == -1 for r in running + doc["core"][3])
    for r in running + doc["core"][3]:
        del r[-1]
    old = records.decode(msgspec.msgpack.encode(doc))
    core = records.core_from_record(records.config_of(old.config), old.core)
    assert all(s.ahead_block == -1 for s in core.seqs.values())
    assert canonical(core) == canonical(bm)


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_every_core_attribute_is_persisted_or_derived(policy: str) -> None:
    bm = _busy_core(policy)
    objs = [bm, bm.pool, bm.cpu, bm.preemption, bm.preemption.victims, bm.pool.eviction_policy, bm.seqs["d"]]
    for obj in objs:
        persisted, derived = _KNOWN[type(obj).__name__]
        assert _attributes(obj) == set(persisted.split()) | set(derived.split()), type(obj).__name__


# --- random operations, then a round trip, then the same operations on both ---------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["alloc", "append", "commit", "fork", "free", "preempt", "swap_in", "reset", "grant"]
        ),
        st.integers(0, 3),  # sequence (few: operations meet the same sequences)
        st.integers(1, 9),  # tokens
        st.integers(0, 2),  # token value / priority
    ),
    min_size=8,
    max_size=40,
)


def _run(bm: BlockManager, ops: list[tuple[str, int, int, int]]) -> list[object]:
    out: list[object] = []
    for op, i, k, v in ops:
        s = f"s{i}"
        try:
            if op == "alloc":
                out.append(bm.allocate(s, k, [v] * k, v - 1))
                bm.commit(s, k)
            elif op == "append":
                out.append(bm.append(s, k, [v] * k))
            elif op == "commit":
                out.append(bm.commit(s, bm.block_table(s).num_tokens))
            elif op == "fork":
                out.append(bm.fork(s, f"s{(i + k) % 4}"))
            elif op == "free":
                out.append(bm.free(s))
            elif op == "preempt":
                out.append(bm.preempt(s))
            elif op == "swap_in":
                out.append(bm.swap_in(s))
            elif op == "grant":
                out.append(bm.grant(s))
            else:
                out.append(bm.reset_prefix_cache())
        except CoreError as e:
            out.append((e.code, e.message))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["lru", "lru-size"]),
    mode=st.sampled_from(["off", "auto", "swap", "recompute"]),
    before=OPS,
    after=OPS,
)
def test_after_random_operations_a_round_trip_is_identical_and_behaves_the_same(
    policy: str, mode: str, before: list[tuple[str, int, int, int]], after: list[tuple[str, int, int, int]]
) -> None:
    bm = BlockManager(
        CoreConfig(
            num_gpu_blocks=10, block_size=2, num_cpu_blocks=6, eviction_policy=policy, preemption_mode=mode
        )
    )
    _run(bm, before)
    _, core = _round_trip(bm)
    assert canonical(core) == canonical(bm)
    core.check_invariants()
    assert _run(core, after) == _run(bm, after)
    assert canonical(core) == canonical(bm)


# --- refusals -----------------------------------------------------------------------------------
def test_unknown_old_malformed_and_inconsistent_states_are_refused_precisely() -> None:
    payload = records.encode(records.to_record(_busy_core(), LeaseTable(), DedupeTable()))
    doc = msgspec.msgpack.decode(payload)
    with pytest.raises(
        records.StateError, match=r"unknown state format version 99 \(this version reads 3 and migrates 2\)"
    ):
        records.decode(msgspec.msgpack.encode(dict(doc, version=99)))
    # Version 2 whose core is not what version 2 wrote: refused, and nothing is looked up by name.
    v2 = {"version": 2, "config": {}, "core": ["obj", 0, "os:system", [], []], "leases": {}, "dedupe": []}
    with pytest.raises(records.StateError, match="version-2 state is malformed.*not a BlockManager"):
        records.decode(msgspec.msgpack.encode(v2))
    with pytest.raises(records.StateError, match="not a versioned state document"):
        records.decode(b"\x93\x01\x02")  # an array, not a document
    with pytest.raises(records.StateError, match="version-3 state is malformed.*core"):
        records.decode(msgspec.msgpack.encode(dict(doc, core=["obj", 0, "os:system", [], []])))
    # Decodable, but the bookkeeping does not add up: a ref count nobody holds.
    st_ = records.decode(payload)
    pool = st_.core.pool
    bad = msgspec.structs.replace(
        st_.core, pool=msgspec.structs.replace(pool, ref_counts=[r + 1 for r in pool.ref_counts])
    )
    with pytest.raises(records.StateError, match="bookkeeping is inconsistent.*ref counts"):
        records.core_from_record(records.config_of(st_.config), bad)
    short = msgspec.structs.replace(st_.core, pool=msgspec.structs.replace(pool, depth=pool.depth[:-1]))
    with pytest.raises(records.StateError, match="depths has 11 entries; the pool has 12"):
        records.core_from_record(records.config_of(st_.config), short)


def _write_snapshot(state_dir: Path, seq: int, payload: bytes, magic: bytes = snapshot.MAGIC) -> None:
    header = struct.pack("<8sQIQ", magic, seq, zlib.crc32(payload), len(payload))
    (state_dir / snapshot.snapshot_name(seq)).write_bytes(header + payload)


def _settings(state: Path) -> BlockManagerSettings:
    return BlockManagerSettings(port=0, num_gpu_blocks=16, block_size=4, state_dir=str(state))


def test_a_server_refuses_a_state_dir_of_an_unknown_version_or_a_corrupt_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    _write_snapshot(state, 3, msgspec.msgpack.encode({"version": 7, "core": []}))
    with pytest.raises(snapshot.SnapshotError, match="cannot be loaded: unknown state format version 7"):
        start_server(_settings(state))
    _write_snapshot(state, 4, msgspec.msgpack.encode({"version": 3, "config": {}}))
    with pytest.raises(snapshot.SnapshotError, match="cannot be loaded: the version-3 state is malformed"):
        start_server(_settings(state))
    (state / snapshot.snapshot_name(4)).write_bytes(b"PKVSNAP2" + b"\0" * 30)
    with pytest.raises(snapshot.SnapshotError, match="is corrupt .bad header or checksum"):
        start_server(_settings(state))


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_record_call, ("unpickled",))


CALLS: list[str] = []


def _record_call(what: str) -> None:
    CALLS.append(what)


def test_a_version_1_pickled_snapshot_is_refused_without_unpickling(tmp_path: Path) -> None:
    """A pickle can name code to run: a format-1 file is refused with advice, and never loaded."""
    state = tmp_path / "state"
    state.mkdir()
    _write_snapshot(state, 3, pickle.dumps({"version": 1, "core": _Boom()}), magic=b"PKVSNAP1")
    with pytest.raises(snapshot.SnapshotError, match="format-1 snapshot .a pickle.*drain it"):
        snapshot.load_latest(state)
    assert CALLS == []
    with pytest.raises(snapshot.SnapshotError, match="format-1"):
        start_server(_settings(state))
    assert CALLS == []


# --- version 2 (the previous release's reflective export) ---------------------------------------
DATA = Path(__file__).parent / "data"


def _v2_workload(policy: str) -> tuple[BlockManager, LeaseTable]:
    """What wrote data/state_v2_<policy>.msgpack, run by the release before records.py (c89a06b:
    the same calls, then ``state_export.export(bm, leases.export(), [("r1", "Free", b"d" * 16,
    b"reply", 2e9)])`` encoded with msgpack)."""
    bm = BlockManager(
        CoreConfig(
            num_gpu_blocks=12, block_size=4, num_cpu_blocks=6, preemption_mode="swap", eviction_policy=policy
        )
    )
    bm.enable_tenancy(TenantLedger(quotas={"t": Quota(max_gpu_blocks=10)}))
    bm.allocate("a", 10, list(range(10)), tenant="t")
    bm.commit("a", 10)
    bm.fork("a", "b")
    bm.append("b", 3, [1, 2, 3])
    bm.allocate("c", 8, [9] * 8, 1, tenant="t")
    bm.commit("c", 8)
    bm.free("c")
    bm.preempt("b", "swap")
    bm.allocate("d", 5, [4] * 5, tenant="t")
    bm.allocate("e", 3, [7] * 3, tenant="t")
    bm.preempt("e", "recompute")
    bm.reset_prefix_cache()
    bm.allocate("f", 6, [5] * 6, tenant="t")
    bm.commit("f", 4)
    leases = LeaseTable()
    leases.attach("a", "L")
    leases.touch("M", 5.0)
    return bm, leases


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_a_version_2_state_of_the_previous_release_is_migrated_to_the_same_core(policy: str) -> None:
    want, leases = _v2_workload(policy)
    st_ = records.decode((DATA / f"state_v2_{policy}.msgpack").read_bytes())
    assert st_.version == 3 and records.config_of(st_.config) == want.config
    core = records.core_from_record(records.config_of(st_.config), st_.core)
    assert canonical(core) == canonical(want)
    assert core.preemption.requeued == {"e": 5} and core.tenants is not None
    back = LeaseTable()
    records.restore_leases(back, st_.leases)
    assert back.export() == leases.export()
    assert [msgspec.structs.astuple(d) for d in st_.dedupe] == [("r1", "Free", b"d" * 16, b"reply", 2e9)]
    later = [("alloc", 1, 9, 2), ("swap_in", 0, 1, 1), ("append", 3, 5, 1)]
    assert _run(core, later) == _run(want, later)
    assert canonical(core) == canonical(want)


def test_a_version_2_state_written_before_later_fields_gets_their_old_meaning() -> None:
    """Version-2 documents from before Commit, tenancy, KV events and the reset counter lack those
    fields; the migration gives them what they meant then (all of a sequence committed, tenant "")."""
    doc = msgspec.msgpack.decode((DATA / "state_v2_lru.msgpack").read_bytes())
    drop = {
        "SeqState": {"num_committed", "pending_hashes", "tenant"},
        "BlockManager": {"ledger", "num_prefix_cache_resets", "num_committed_blocks"},
        "BlockPool": {"events"},
    }

    def strip(node: object) -> None:
        if isinstance(node, list):
            if node and node[0] == "obj":
                gone = drop.get(node[2].rpartition(":")[2], set())
                keep = [i for i, n in enumerate(node[3]) if n not in gone]
                node[3] = [node[3][i] for i in keep]
                node[4] = [node[4][i] for i in keep]
            for item in node:
                strip(item)

    strip(doc["core"])
    st_ = records.decode(msgspec.msgpack.encode(doc))
    seqs = [*st_.core.running, *st_.core.swapped]
    assert seqs and all(s.num_committed == s.num_tokens for s in seqs)
    assert all(s.tenant == "" and s.pending_hashes == [] for s in seqs)
    assert st_.core.ledger is None and st_.core.num_prefix_cache_resets == 0
    assert st_.core.num_committed_blocks == 0 and not st_.core.pool.events_enabled


def test_a_state_dir_with_a_version_2_snapshot_recovers(tmp_path: Path) -> None:
    """The path a restart takes: the snapshot file, the migration, the geometry check, the core."""
    state = tmp_path / "state"
    state.mkdir()
    _write_snapshot(state, 7, (DATA / "state_v2_lru-size.msgpack").read_bytes())
    want, _ = _v2_workload("lru-size")
    servicer = BlockManagerServicer(BlockManager(want.config))
    report = servicer.reliable.recover(state)
    assert (report.snapshot_seq, report.snapshot_version) == (7, 2)
    assert canonical(servicer._core) == canonical(want)  # noqa: SLF001
    # Starting on it rewrites the snapshot in this version's format, and that reads back the same.
    settings = BlockManagerSettings(port=0, num_gpu_blocks=12, block_size=4, state_dir=str(state))
    fresh = BlockManagerServicer(BlockManager(want.config))
    fresh.reliable.start(settings).close()
    latest = snapshot.load_latest(state)
    assert latest is not None and records.version_of(latest.payload) == 3
    again = BlockManagerServicer(BlockManager(want.config))
    assert again.reliable.recover(state).snapshot_version == 3
    assert canonical(again._core) == canonical(want)  # noqa: SLF001
