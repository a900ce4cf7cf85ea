"""The state export (snapshot format 2): plain versioned data that rebuilds the core exactly,
refuses what is not core state, and a version-1 (pickled) snapshot is refused, never unpickled."""

from __future__ import annotations

import pickle
import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from block_manager_svc import snapshot, state_export
from block_manager_svc.core import BlockManager, CoreConfig
from block_manager_svc.core.tenants import TenantLedger
from block_manager_svc.leases import LeaseTable
from block_manager_svc.server import start_server
from block_manager_svc.settings import BlockManagerSettings

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
    bm.enable_tenancy(TenantLedger())
    return bm


@pytest.mark.parametrize("policy", ["lru", "lru-size"])
def test_export_is_plain_versioned_data_and_rebuilds_the_core_exactly(policy: str) -> None:
    bm = _busy_core(policy)
    leases = LeaseTable()
    leases.attach("a", "L")
    doc = state_export.export(bm, leases.export(), [("r", "Free", b"d", b"reply", 1.0)])
    assert doc["version"] == 2 and doc["config"]["num_gpu_blocks"] == 12
    wire = msgspec.msgpack.encode(doc)  # plain data: msgpack needs no hooks
    st = state_export.restore(msgspec.msgpack.decode(wire))
    assert canonical(st.core) == canonical(bm)
    st.core.check_invariants()
    # The eviction policy shares the pool's hash list again (not a copy of it).
    if policy == "lru":
        assert st.core.pool.eviction_policy._block_hash is st.core.pool.block_hash
    assert st.leases == leases.export() and st.dedupe == [("r", "Free", b"d", b"reply", 1.0)]
    # Both go on working the same way.
    for core in (bm, st.core):
        core.allocate("e", 9, [9] * 8 + [1])
        core.swap_in("b") if core.pool.num_available > 8 else None
    assert canonical(st.core) == canonical(bm)


def test_a_state_that_names_other_code_or_an_unknown_version_is_refused() -> None:
    doc = state_export.export(_busy_core(), {}, [])
    bad = dict(doc, core=["obj", 0, "os:system", [], []])
    with pytest.raises(state_export.StateError, match="'os:system', which is not a core class"):
        state_export.restore(bad)
    with pytest.raises(state_export.StateError, match="unknown state format version 99"):
        state_export.restore(dict(doc, version=99))
    with pytest.raises(state_export.StateError, match="cannot export"):
        state_export.export(_busy_core(), {"x": object()}, [])


def _write_v1_snapshot(state_dir: Path, seq: int, payload: bytes) -> None:
    """A snapshot as versions before the export wrote it: PKVSNAP1 + a pickle."""
    header = struct.pack("<8sQIQ", b"PKVSNAP1", seq, zlib.crc32(payload), len(payload))
    (state_dir / snapshot.snapshot_name(seq)).write_bytes(header + payload)


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
    _write_v1_snapshot(state, 3, pickle.dumps({"version": 1, "core": _Boom()}))
    with pytest.raises(snapshot.SnapshotError, match="format-1 snapshot .a pickle.*stop it cleanly"):
        snapshot.load_latest(state)
    assert CALLS == []
    settings = BlockManagerSettings(port=0, num_gpu_blocks=16, block_size=4, state_dir=str(state))
    with pytest.raises(snapshot.SnapshotError, match="format-1"):
        start_server(settings)
    assert CALLS == []


def test_an_export_written_before_a_field_existed_is_migrated_in_state_export() -> None:
    """Fields the core gained later (Commit's num_committed, tenancy's ledger...) get their
    migrated values from state_export's one table, not from compatibility code in the core."""
    bm = _busy_core()
    doc = state_export.export(bm, {}, [])

    def strip(node: object) -> None:
        if isinstance(node, list):
            if node and node[0] == "obj":
                cls = node[2].rpartition(":")[2]
                drop = {
                    "SeqState": {"num_committed", "pending_hashes", "tenant"},
                    "BlockManager": {"ledger", "num_prefix_cache_resets", "num_committed_blocks"},
                    "BlockPool": {"events"},
                }.get(cls, set())
                keep = [i for i, n in enumerate(node[3]) if n not in drop]
                node[3] = [node[3][i] for i in keep]
                node[4] = [node[4][i] for i in keep]
            for item in node:
                strip(item)

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(doc))
    strip(old["core"])
    core = state_export.restore(old).core
    assert core.tenants is None and core.num_prefix_cache_resets == 0 and core.num_committed_blocks == 0
    assert core.pool.events is None
    for seq in (*core.seqs.values(), *core.swapped.values()):
        assert seq.num_committed == seq.num_tokens and seq.pending_hashes == [] and seq.tenant == ""
    core.check_invariants()
    assert core.allocate("again", 10, list(range(10))).num_cached_tokens == 8
