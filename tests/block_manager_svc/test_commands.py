"""Commands as data: what the stages record for the journal, replay into a fresh core, the
migration of format-2 records, and the refusal of journals written in the older (request) format."""

from __future__ import annotations

import time
from array import array
from pathlib import Path

import msgspec
import pytest

from pagedkv.block_manager_svc import commands as cmds
from pagedkv.block_manager_svc.commands import (
    Batch,
    DedupeEntry,
    ReplayError,
    decode_batch,
    encode_batch,
    replay,
)
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, StepBatch
from pagedkv.block_manager_svc.journal import Journal, ScanReport, scan
from pagedkv.block_manager_svc.leases import LeaseTable
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2 as pb


def _core() -> BlockManager:
    return BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, num_cpu_blocks=4, preemption_mode="swap"))


def _view(core: BlockManager) -> tuple:
    tables = {
        s: (list(q.block_ids), q.num_tokens, q.num_committed, q.ahead_block) for s, q in core.seqs.items()
    }
    return tables, list(core.pool.ref_counts), dict(core.pool.index), list(core.pool.free_list), core.stats()


def live_ahead(core: BlockManager) -> set[str]:
    return {s for s, q in core.seqs.items() if q.ahead_block >= 0}


def test_the_journal_holds_explicit_commands_that_rebuild_the_same_state(tmp_path: Path) -> None:
    state = tmp_path / "state"
    settings = BlockManagerSettings(
        port=0,
        num_gpu_blocks=16,
        block_size=4,
        num_cpu_blocks=4,
        preemption_mode="swap",
        state_dir=str(state),
        fsync="off",
    )
    running = start_server(settings)
    try:
        sv = running.servicer

        class Ctx:
            def time_remaining(self) -> float:
                return 5.0

            def abort(self, code: object, message: str) -> None:
                raise RuntimeError(message)

            def invocation_metadata(self) -> tuple:
                return ()

        ctx = Ctx()
        sv.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, token_ids=list(range(9)), lease_id="L"), ctx)
        sv.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=8), ctx)
        sv.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="b"), ctx)  # inherits lease L
        sv.Append(pb.AppendRequest(seq_id="b", num_tokens=3, token_ids=[7, 8, 9], request_id="r1"), ctx)
        with pytest.raises(RuntimeError):
            sv.Free(pb.FreeRequest(seq_id="nope"), ctx)  # refused: changed nothing, so nothing is recorded
        sv.Step(
            pb.StepRequest(
                append_seq_ids=["a"],
                append_token_ids=[5],
                free_seq_ids=["b"],
                commit_seq_ids=["a"],
                commit_num_computed_tokens=[9],
                alloc_seq_ids=["n"],
                alloc_num_tokens=[5],
                alloc_token_ids=[1, 2, 3, 4, 5],
                alloc_lease_ids=["M"],
                grant_seq_ids=["n", "ghost"],  # one granted, one refused: both replayed alike
            ),
            ctx,
        )
        assert live_ahead(sv._core) == {"n"}
        live_core = sv._core
        live_leases = sv.reliable.leases
        records = list(scan(state, 0, ScanReport(), repair=False))
        assert {r.name for r in records} == {cmds.RECORD_NAME}
        batches = [decode_batch(r.body) for r in records]
        kinds = [[type(c).__name__ for c in b.commands] for b in batches]
        assert kinds == [
            ["Allocate", "LeaseAttach"],
            ["Commit"],
            ["Fork", "LeaseAttach"],
            ["Append"],
            ["Step", "LeaseDetachAll", "LeaseAttach"],
        ]
        assert batches[3].commands[0] == cmds.Append("b", 3, [7, 8, 9])
        assert batches[3].dedupe is not None and batches[3].dedupe.request_id == "r1"
        fresh, fresh_leases = _core(), LeaseTable()
        for b in batches:
            for c in b.commands:
                replay(c, fresh, fresh_leases)
        assert _view(fresh) == _view(live_core)
        assert fresh_leases.lease_of == live_leases.lease_of == {"a": "L", "n": "M"}
        fresh.check_invariants()
    finally:
        running.stop(0)


def test_a_batch_round_trips_and_decoding_builds_only_command_types() -> None:
    batch = Batch(
        [cmds.Allocate("a", 5, [1, 2, 3, 4, 5]), cmds.LeaseTouch("L", 2.5), cmds.ResetPrefixCache()],
        DedupeEntry("r1", "Step", b"d" * 16, b"reply", 1.5),
    )
    assert decode_batch(encode_batch(batch)) == batch
    bogus = msgspec.msgpack.encode([[["System", "rm -rf /"]], None])
    with pytest.raises(ReplayError, match="does not hold a command batch"):
        decode_batch(bogus)
    with pytest.raises(ReplayError, match="does not hold a command batch"):
        decode_batch(b"\x93garbage")
    with pytest.raises(ReplayError, match="Free was refused: NOT_FOUND"):
        replay(cmds.Free("ghost"), _core(), LeaseTable())


def test_a_step_that_skips_prefix_hits_replays_the_same_and_older_steps_read_without_it() -> None:
    """alloc_skip_prefix_hits is journaled with its Step (a replay without it would hit the cache
    and build other tables), after the older fields: a record written before it reads as None."""
    live = _core()
    live.allocate("a", 9, list(range(9)))
    live.commit("a", 9)
    batch = StepBatch(
        alloc_seq_ids=["s"],
        alloc_num_tokens=[9],
        alloc_token_ids=array("I", range(9)),
        alloc_skip_prefix_hits=[True],
    )
    step = cmds.Step.of(batch)
    assert live.step(batch).alloc_num_cached_tokens == [0]
    decoded = decode_batch(encode_batch(Batch([cmds.Allocate("a", 9, list(range(9))), step], None)))
    replayed = _core()
    replay(decoded.commands[0], replayed, LeaseTable())
    replayed.commit("a", 9)
    replay(decoded.commands[1], replayed, LeaseTable())
    assert _view(replayed) == _view(live)
    # (the fields after it, fork_before_appends, came later still)
    older = msgspec.msgpack.encode(msgspec.msgpack.decode(msgspec.msgpack.encode(step))[:-2])
    assert msgspec.msgpack.decode(older, type=cmds.Step).alloc_skip_prefix_hits is None


def test_a_step_with_forks_before_its_appends_replays_the_same_and_older_steps_read_without_it() -> None:
    """fork_before_appends is journaled with its Step (replayed after the appends, the child would
    share the parent's new token), after the older fields: a record written before it reads None."""
    live = _core()
    live.allocate("p", 6, list(range(6)))
    batch = StepBatch(
        append_seq_ids=["p", "c"],
        append_token_ids=array("I", [40, 41]),
        fork_parent_seq_ids=["p"],
        fork_child_seq_ids=["c"],
        fork_before_appends=[True],
    )
    step = cmds.Step.of(batch)
    assert not live.step(batch).append_errors
    decoded = decode_batch(encode_batch(Batch([cmds.Allocate("p", 6, list(range(6))), step], None)))
    replayed = _core()
    for cmd in decoded.commands:
        replay(cmd, replayed, LeaseTable())
    assert _view(replayed) == _view(live)
    older = msgspec.msgpack.encode(msgspec.msgpack.decode(msgspec.msgpack.encode(step))[:-1])
    assert msgspec.msgpack.decode(older, type=cmds.Step).fork_before_appends is None


def test_format_2_records_are_migrated_to_the_same_commands() -> None:
    """Records written before the explicit commands hold generic (target, method, args, kwargs)
    calls, and Step as its old parallel-array parameters; commands.py migrates them."""

    def setup(core: BlockManager) -> None:
        core.allocate("a", 7, list(range(7)))
        core.allocate("b", 3)
        core.allocate("c", 2)

    live, old_form = _core(), _core()
    setup(live)
    setup(old_form)
    live.step(
        StepBatch(
            append_seq_ids=["a", "c"],
            append_num_tokens=[2, 1],
            append_token_ids=array("I", [8, 9, 4]),
            free_seq_ids=["b"],
            commit_seq_ids=["a"],
            commit_num_computed_tokens=[6],
            alloc_seq_ids=["n"],
            alloc_num_tokens=[5],
            alloc_token_ids=array("I", [1, 2, 3, 4, 5]),
        )
    )
    live_leases = LeaseTable()
    live_leases.attach("n", "L")
    live.fork("n", "n2")
    old_calls = [
        (
            "core",
            "step",
            [["a", "c"], [2, 1], [8, 9, 4], ["b"], []],
            {
                "append_tokens_known": None,
                "commit_seq_ids": ["a"],
                "commit_num_computed_tokens": [6],
                "alloc_seq_ids": ["n"],
                "alloc_num_tokens": [5],
                "alloc_token_ids": [1, 2, 3, 4, 5],
                "alloc_priorities": [],
                "alloc_salts": [],
                "fork_parent_seq_ids": [],
                "fork_child_seq_ids": [],
                "tenant": "",
            },
        ),
        ("leases", "attach", ["n", "L"], {}),
        ("core", "fork", ["n", "n2"], {}),
    ]
    body = msgspec.msgpack.encode([old_calls, ["r9", "Step", b"d" * 16, b"reply", 2.0]])
    batch = decode_batch(body, cmds.RECORD_NAME_V2)
    assert [type(c).__name__ for c in batch.commands] == ["Step", "LeaseAttach", "Fork"]
    assert batch.dedupe == DedupeEntry("r9", "Step", b"d" * 16, b"reply", 2.0)
    old_leases = LeaseTable()
    for c in batch.commands:
        replay(c, old_form, old_leases)
    assert _view(old_form) == _view(live) and old_leases.lease_of == live_leases.lease_of
    for bad in (
        [("os", "system", ["x"], {})],
        [("core", "check_invariants", [], {})],
        [("core", "step", [{"no_such_field": []}], {})],
    ):
        with pytest.raises(ReplayError, match="not a known state change|unknown fields"):
            decode_batch(msgspec.msgpack.encode([bad, None]), cmds.RECORD_NAME_V2)


def test_a_journal_of_requests_from_an_older_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    j = Journal(state, 1, "off")
    j.append("Allocate", pb.AllocateRequest(seq_id="a", num_tokens=5).SerializeToString(), time.time())
    j.close()
    with pytest.raises(
        ReplayError, match=r"record 1 \(Allocate\) was written by an older version.*stop it cleanly"
    ):
        start_server(BlockManagerSettings(port=0, num_gpu_blocks=16, block_size=4, state_dir=str(state)))
