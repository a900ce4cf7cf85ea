"""Journal and snapshot with two KV-cache groups: a crash restores every group's tables exactly
(window groups' released blocks included), nothing leaks, and a restart that names other groups
is refused."""

from __future__ import annotations

import random

import pytest

from pagedkv.block_manager_svc.core import BlockManager
from pagedkv.v1 import block_manager_pb2 as pb

from .conftest import Servers, crash
from .test_recovery import drain_then_allocate, state_bytes, workload

GROUPS = "full,window:8"


def _windows_slid(core: BlockManager) -> int:
    """Sequences whose window group released blocks (the workload must exercise that)."""
    return sum(1 for s in core.seqs.values() if s.kv_tables and len(s.kv_tables[0]) < len(s.block_ids))


@pytest.mark.parametrize("snapshots", [0, 40])
def test_crash_restores_both_groups_exactly(servers: Servers, state_dir: str, snapshots: int) -> None:
    kw = {
        "state_dir": state_dir,
        "num_gpu_blocks": 96,
        "num_cpu_blocks": 16,
        "preemption_mode": "recompute",  # the workload grows without SwapIn; one swap is explicit
        "kv_groups": GROUPS,
        "snapshot_every_ops": snapshots,
        "snapshot_interval_s": 0,
    }
    running, stub = servers.start(**kw)
    acked = workload(stub, random.Random(11), 200)
    core = running.servicer._core  # noqa: SLF001
    # Commit everything that is running, so that the windows slide before the crash.
    for seq_id in list(core.seqs):
        n = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_id)).num_tokens
        stub.Commit(pb.CommitRequest(seq_id=seq_id, num_computed_tokens=n))
    assert _windows_slid(core) > 0 and core.multi
    victim = next(s for s, seq in core.seqs.items() if seq.group not in core.groups)
    stub.Preempt(pb.PreemptRequest(seq_id=victim, mode="swap"))
    assert core.swapped[victim].cpu_kv_tables
    core.check_invariants()
    before = state_bytes(running)
    crash(running)
    running2, stub2 = servers.start(**kw)
    running2.servicer._core.check_invariants()  # noqa: SLF001
    assert state_bytes(running2) == before
    with_ids = [(m, req, rep) for m, req, rep in acked if req.request_id and m != "KeepAlive"]
    for method, req, rep in with_ids[-40:]:
        assert getattr(stub2, method)(req) == rep
    drain_then_allocate(running2, stub2)


def test_a_restart_with_other_groups_is_refused(servers: Servers, state_dir: str) -> None:
    running, stub = servers.start(state_dir=state_dir, kv_groups=GROUPS)
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=9, token_ids=list(range(9))))
    crash(running)
    with pytest.raises(Exception, match="kv_groups"):
        servers.start(state_dir=state_dir)
