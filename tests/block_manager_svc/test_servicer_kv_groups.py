"""The gRPC API with two KV-cache groups (a full group and an 8-token window, 4-token blocks):
every reply carries the other group's table or deltas, and one group's replies carry none."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


@pytest.fixture
def stub2(server_factory) -> Iterator[pb_grpc.BlockManagerStub]:  # type: ignore[no-untyped-def]
    running = server_factory(
        num_gpu_blocks=32, block_size=4, num_cpu_blocks=16, preemption_mode="swap", kv_groups="full,window:8"
    )
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield pb_grpc.BlockManagerStub(channel)


def table(stub, seq_id: str) -> pb.BlockTable:  # type: ignore[no-untyped-def]
    return stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_id), timeout=5)


def used(stub) -> int:  # type: ignore[no-untyped-def]
    return stub.GetStats(pb.GetStatsRequest(), timeout=5).num_used_blocks


def test_config_allocate_commit_and_the_window_table(stub2) -> None:  # type: ignore[no-untyped-def]
    cfg = stub2.GetConfig(pb.GetConfigRequest())
    assert [(g.kind, g.window_tokens) for g in cfg.kv_groups] == [("full", 0), ("window", 8)]
    a = stub2.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=10, token_ids=list(range(10))))
    assert len(a.block_ids) == 3 and len(a.group_tables) == 1
    g = a.group_tables[0]
    assert g.first_block_index == 0 and len(g.block_ids) == 3 and set(g.block_ids).isdisjoint(a.block_ids)
    r = stub2.Append(pb.AppendRequest(seq_id="a", num_tokens=6, token_ids=list(range(10, 16))))
    assert len(r.new_block_ids) == 1 and [len(x.new_block_ids) for x in r.group_blocks] == [1]
    assert used(stub2) == 8
    stub2.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=16))
    t = table(stub2, "a")
    assert list(t.block_ids) == [*a.block_ids, *r.new_block_ids]
    assert t.group_tables[0].first_block_index == 2
    assert list(t.group_tables[0].block_ids) == [g.block_ids[2], r.group_blocks[0].new_block_ids[0]]
    assert used(stub2) == 6
    # A new request with the same prefix hits in both groups: the window group needs only [2, 4).
    stub2.Free(pb.FreeRequest(seq_id="a"))
    b = stub2.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=17, token_ids=[*range(16), 7]))
    assert b.num_cached_tokens == 16 and list(b.block_ids[:4]) == list(t.block_ids)
    assert b.group_tables[0].first_block_index == 2
    assert list(b.group_tables[0].block_ids[:2]) == list(t.group_tables[0].block_ids)


def test_fork_copy_on_write_and_step_deltas(stub2) -> None:  # type: ignore[no-untyped-def]
    a = stub2.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=6, token_ids=list(range(6))))
    f = stub2.Fork(pb.ForkRequest(parent_seq_id="a", child_seq_id="f"))
    assert list(f.block_ids) == list(a.block_ids) and f.group_tables == a.group_tables
    r = stub2.Step(
        pb.StepRequest(
            append_seq_ids=["f"],
            append_token_ids=[9],
            alloc_seq_ids=["n"],
            alloc_num_tokens=[5],
            alloc_token_ids=list(range(5)),
            grant_seq_ids=["a"],
        )
    )
    (d,) = r.group_deltas
    assert list(r.packed_replaced_index) == [0] and list(d.packed_replaced_index) == [0]
    assert list(d.packed_new_block_index) == [0] and len(r.ops.copies) == 2
    assert [(c.src, c.dst) for c in r.ops.copies] == [
        (a.block_ids[1], r.packed_new_block_ids[0]),
        (a.group_tables[0].block_ids[1], d.packed_new_block_ids[0]),
    ]
    assert list(d.packed_alloc_block_index) == [0, 0]
    assert list(table(stub2, "n").group_tables[0].block_ids) == list(d.packed_alloc_block_ids)
    assert list(table(stub2, "f").group_tables[0].block_ids) == [
        a.group_tables[0].block_ids[0],
        d.packed_new_block_ids[0],
    ]
    (err,) = r.errors
    assert err.kind == pb.StepItemError.GRANT and "KV groups" in err.message
    # Sub-message appends carry their own group blocks and copies.
    stub2.Fork(pb.ForkRequest(parent_seq_id="n", child_seq_id="m"))
    sub = pb.AppendRequest(seq_id="m", num_tokens=4, token_ids=[1, 2, 3, 4])
    r = stub2.Step(pb.StepRequest(appends=[sub]))
    (item,) = r.appends
    assert item.replaced_last_block and item.group_blocks[0].replaced_last_block
    assert len(item.new_block_ids) == 2 and len(item.group_blocks[0].new_block_ids) == 2
    assert len(item.ops.copies) == 2 and not r.group_deltas[0].packed_new_block_ids


def test_swap_out_and_in_report_every_group(stub2) -> None:  # type: ignore[no-untyped-def]
    stub2.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=14, token_ids=list(range(14))))
    stub2.Commit(pb.CommitRequest(seq_id="a", num_computed_tokens=14))
    before = table(stub2, "a")
    assert before.group_tables[0].first_block_index == 1 and len(before.group_tables[0].block_ids) == 3
    p = stub2.Preempt(pb.PreemptRequest(seq_id="a", mode="swap"))
    assert len(p.ops.swap_out) == 7 and used(stub2) == 0
    t = table(stub2, "a")
    assert t.swapped and len(t.cpu_block_ids) == 4
    assert t.group_tables[0].first_block_index == 1 and len(t.group_tables[0].cpu_block_ids) == 3
    s = stub2.SwapIn(pb.SwapInRequest(seq_id="a"))
    assert len(s.ops.swap_in) == 7 and s.group_tables[0].first_block_index == 1
    assert list(s.sequences[0].group_tables[0].block_ids) == list(s.group_tables[0].block_ids)
    assert list(table(stub2, "a").group_tables[0].block_ids) == list(s.group_tables[0].block_ids)
    assert stub2.Free(pb.FreeRequest(seq_id="a")).num_blocks_released == 7 and used(stub2) == 0


def test_one_group_replies_carry_no_group_fields(stub) -> None:  # type: ignore[no-untyped-def]
    assert not stub.GetConfig(pb.GetConfigRequest()).kv_groups
    a = stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=6, token_ids=list(range(6))))
    assert not a.group_tables and not table(stub, "a").group_tables
    r = stub.Step(pb.StepRequest(append_seq_ids=["a"], append_num_tokens=[3]))
    assert not r.group_deltas and len(r.packed_new_block_ids) == 1
    assert not stub.Append(pb.AppendRequest(seq_id="a", num_tokens=4)).group_blocks
