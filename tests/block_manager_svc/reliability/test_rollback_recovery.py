"""Rollbacks in the journal: a crash after Steps that rolled sequences back (one and two KV
groups) restores the exact state, a retried Step with its request id gets the same reply and
is not applied twice, and nothing leaks."""

from __future__ import annotations

import pytest

from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers, crash
from .test_recovery import drain_then_allocate, state_bytes


def _verify_round(stub, seq_id: str, accepted: int, request_id: str) -> pb.StepResponse:  # type: ignore[no-untyped-def]
    """One speculative round: roll back to the accepted length, commit it, append 5 proposals."""
    return stub.Step(
        pb.StepRequest(
            request_id=request_id,
            rollback_seq_ids=[seq_id],
            rollback_num_tokens=[accepted],
            commit_seq_ids=[seq_id],
            commit_num_computed_tokens=[accepted],
            append_seq_ids=[seq_id],
            append_num_tokens=[5],
            append_token_ids=[accepted % 7 + i for i in range(5)],
        )
    )


@pytest.mark.parametrize("kv_groups", ["", "full,window:8"])
@pytest.mark.parametrize("snapshots", [0, 3])
def test_journal_replays_rollbacks(servers: Servers, state_dir: str, kv_groups: str, snapshots: int) -> None:
    kw = {
        "state_dir": state_dir,
        "kv_groups": kv_groups,
        "snapshot_every_ops": snapshots,
        "snapshot_interval_s": 0,
    }
    running, stub = servers.start(**kw)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=6, token_ids=list(range(6))))
    stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=3, token_ids=[1, 2, 3]))
    stub.Fork(pb.ForkRequest(parent_seq_id="b", child_seq_id="c"))
    stub.Step(pb.StepRequest(append_seq_ids=["a"], append_num_tokens=[5], append_token_ids=[9] * 5))
    length = 11
    replies = []
    for i in range(6):
        accepted = length - 5 + i % 3  # 0..2 of the 4 proposals kept, plus the verified token
        replies.append(_verify_round(stub, "a", accepted, f"round-{i}"))
        length = accepted + 5
    rolled = stub.Step(
        pb.StepRequest(request_id="fork-tail", rollback_seq_ids=["c", "b"], rollback_num_tokens=[2, 1])
    )
    assert not rolled.errors
    core = running.servicer._core  # noqa: SLF001
    assert core.seqs["a"].num_tokens == length and core.seqs["c"].num_tokens == 2
    core.check_invariants()
    before = state_bytes(running)
    crash(running)

    running2, stub2 = servers.start(**kw)
    core2 = running2.servicer._core  # noqa: SLF001
    core2.check_invariants()
    assert state_bytes(running2) == before
    # A retry is answered from the dedupe window and not applied again.
    assert _verify_round(stub2, "a", length - 5, "round-5") == replies[-1]
    assert state_bytes(running2) == before
    below = stub2.Step(pb.StepRequest(rollback_seq_ids=["a"], rollback_num_tokens=[1]))
    assert [e.kind for e in below.errors] == [pb.StepItemError.ROLLBACK]
    assert below.errors[0].code == 9  # FAILED_PRECONDITION: below the committed length
    drain_then_allocate(running2, stub2)
