"""Commands as data: the recording view, replay into a fresh core, the allowlist, and the
refusal of journals written in the older (request) format."""

from __future__ import annotations

import time
from array import array
from pathlib import Path

import pytest

from block_manager_svc.commands import (
    CORE,
    LEASES,
    Batch,
    Command,
    DedupeEntry,
    ReplayError,
    Tap,
    apply,
    decode_batch,
    encode_batch,
)
from block_manager_svc.core import BlockManager, CoreConfig, CoreError, StepBatch
from block_manager_svc.journal import Journal
from block_manager_svc.leases import LeaseTable
from block_manager_svc.server import start_server
from block_manager_svc.settings import BlockManagerSettings
from pagedkv.v1 import block_manager_pb2 as pb


def _core() -> BlockManager:
    return BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, num_cpu_blocks=4, preemption_mode="swap"))


def _view(core: BlockManager) -> tuple:
    tables = {s: (list(q.block_ids), q.num_tokens, q.num_committed) for s, q in core.seqs.items()}
    return tables, list(core.pool.ref_counts), dict(core.pool.index), list(core.pool.free_list), core.stats()


def test_replaying_recorded_commands_rebuilds_the_same_state() -> None:
    live, sink = _core(), []
    leases = LeaseTable()
    core, lt = Tap(live, CORE, sink), Tap(leases, LEASES, sink)
    core.allocate("a", 9, list(range(9)))
    core.commit("a", 8)
    core.fork("a", "b")
    core.append("b", 3, (x for x in (7, 8, 9)))  # a generator is consumed once and recorded as a list
    lt.attach("b", "L")
    with pytest.raises(CoreError):
        core.free("nope")  # refused: changed nothing, so nothing is recorded
    core.step(StepBatch(append_seq_ids=["a"], append_num_tokens=[1], append_token_ids=array("I", [5]),
                        free_seq_ids=["b"], commit_seq_ids=["a"], commit_num_computed_tokens=[10]))
    assert [c.op for c in sink] == ["allocate", "commit", "fork", "append", "attach", "step"]
    assert sink[3].args == ("b", 3, [7, 8, 9])

    batch = decode_batch(encode_batch(Batch(sink, DedupeEntry("r1", "Step", b"d" * 16, b"reply", 1.5))))
    assert batch.dedupe == DedupeEntry("r1", "Step", b"d" * 16, b"reply", 1.5)
    fresh, fresh_leases = _core(), LeaseTable()
    for cmd in batch.commands:
        apply(cmd, {CORE: fresh, LEASES: fresh_leases})
    assert _view(fresh) == _view(live)
    assert fresh_leases.lease_of == leases.lease_of == {"b": "L"}
    fresh.check_invariants()


def test_a_step_journaled_as_parallel_arrays_replays_as_the_same_batch() -> None:
    """Records written before the core took a StepBatch hold Step's old parameters; the
    migration in commands.py turns them into the batch, so their replay is unchanged."""
    def setup(core: BlockManager) -> None:
        core.allocate("a", 7, list(range(7)))
        core.allocate("b", 3)
        core.allocate("c", 2)

    live, old_form = _core(), _core()
    setup(live)
    setup(old_form)
    live.step(StepBatch(append_seq_ids=["a", "c"], append_num_tokens=[2, 1], append_token_ids=array("I", [8, 9, 4]),
                        free_seq_ids=["b"], commit_seq_ids=["a"], commit_num_computed_tokens=[6],
                        alloc_seq_ids=["n"], alloc_num_tokens=[5], alloc_token_ids=array("I", [1, 2, 3, 4, 5])))
    old = Command(CORE, "step", (["a", "c"], [2, 1], [8, 9, 4], ["b"], []),
                  {"append_tokens_known": None, "commit_seq_ids": ["a"], "commit_num_computed_tokens": [6],
                   "alloc_seq_ids": ["n"], "alloc_num_tokens": [5], "alloc_token_ids": [1, 2, 3, 4, 5],
                   "alloc_priorities": [], "alloc_salts": [], "fork_parent_seq_ids": [], "fork_child_seq_ids": [],
                   "tenant": ""})
    apply(decode_batch(encode_batch(Batch([old]))).commands[0], {CORE: old_form, LEASES: LeaseTable()})
    assert _view(old_form) == _view(live)
    with pytest.raises(ReplayError, match="unknown fields"):
        apply(Command(CORE, "step", ({"no_such_field": []},)), {CORE: _core(), LEASES: LeaseTable()})


def test_apply_runs_only_known_state_changes() -> None:
    core = _core()
    for target, op in ((CORE, "check_invariants"), (CORE, "__class__"), ("os", "system"), (LEASES, "restore")):
        with pytest.raises(ReplayError, match="not a known state change"):
            apply(Command(target, op), {CORE: core, LEASES: LeaseTable()})
    with pytest.raises(ReplayError, match="core.free was refused: NOT_FOUND"):
        apply(Command(CORE, "free", ("ghost",)), {CORE: core, LEASES: LeaseTable()})
    with pytest.raises(ReplayError, match="does not hold a command batch"):
        decode_batch(b"\x93garbage")


def test_a_journal_of_requests_from_an_older_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    j = Journal(state, 1, "off")
    j.append("Allocate", pb.AllocateRequest(seq_id="a", num_tokens=5).SerializeToString(), time.time())
    j.close()
    with pytest.raises(ReplayError, match=r"record 1 \(Allocate\) was written by an older version.*stop it cleanly"):
        start_server(BlockManagerSettings(port=0, num_gpu_blocks=16, block_size=4, state_dir=str(state)))
