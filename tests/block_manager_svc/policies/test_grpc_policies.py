"""Preemption, SwapIn, Preempt and the policy stats through a real server."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings, load_settings
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


@pytest.fixture
def stub() -> Iterator[pb_grpc.BlockManagerStub]:
    running = start_server(
        BlockManagerSettings(
            port=0,
            num_gpu_blocks=8,
            block_size=4,
            num_cpu_blocks=8,
            preemption_mode="swap",
            watermark_fraction=0.0,
            log_level="warning",
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield pb_grpc.BlockManagerStub(channel)
    finally:
        running.stop(0)


def test_settings_defaults_and_flags() -> None:
    s = BlockManagerSettings()
    assert s.eviction_policy == "lru-size" and s.preemption_mode == "auto" and s.num_cpu_blocks == 0
    s = load_settings(
        [
            "--eviction-policy",
            "lru",
            "--preemption-mode",
            "recompute",
            "--num-cpu-blocks",
            "64",
            "--watermark-fraction",
            "0.05",
            "--host-link-gb-per-s",
            "50",
        ]
    )
    assert (
        s.eviction_policy,
        s.preemption_mode,
        s.num_cpu_blocks,
        s.watermark_fraction,
        s.host_link_gb_per_s,
    ) == ("lru", "recompute", 64, 0.05, 50.0)
    with pytest.raises(SystemExit):
        load_settings(["--eviction-policy", "fifo"])


def test_append_reply_lists_preemptions_and_swap_in_brings_them_back(stub) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=8))
    stub.Allocate(pb.AllocateRequest(seq_id="b", num_tokens=12))
    stub.Fork(pb.ForkRequest(parent_seq_id="b", child_seq_id="b2"))
    r = stub.Append(pb.AppendRequest(seq_id="a", num_tokens=16))  # needs 4, 3 free
    assert sorted(p.seq_id for p in r.preempted) == ["b", "b2"]
    assert all(p.mode == pb.Preemption.SWAP and p.num_tokens == 12 and p.cost_s > 0 for p in r.preempted)
    assert len(r.ops.swap_out) == 3 and len(r.new_block_ids) == 4
    t = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="b2"))
    assert t.swapped and not t.block_ids and len(t.cpu_block_ids) == 3
    with pytest.raises(grpc.RpcError) as info:
        stub.Append(pb.AppendRequest(seq_id="b", num_tokens=1))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "SwapIn" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.SwapIn(pb.SwapInRequest(seq_id="b"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    st = stub.GetStats(pb.GetStatsRequest())
    assert (
        st.num_cpu_blocks,
        st.num_free_cpu_blocks,
        st.num_swapped_sequences,
        st.num_preemptions_swap,
        st.num_swapped_out_blocks,
    ) == (8, 5, 2, 2, 3)
    stub.Free(pb.FreeRequest(seq_id="a"))
    s = stub.SwapIn(pb.SwapInRequest(seq_id="b"))
    assert len(s.block_ids) == 3 and [o.dst for o in s.ops.swap_in] == list(s.block_ids)
    assert {x.seq_id: list(x.block_ids) for x in s.sequences} == {
        "b": list(s.block_ids),
        "b2": list(s.block_ids),
    }
    assert not stub.GetBlockTable(pb.GetBlockTableRequest(seq_id="b")).swapped
    with pytest.raises(grpc.RpcError) as info:
        stub.SwapIn(pb.SwapInRequest(seq_id="b"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_step_reports_preemptions_swap_ins_and_their_errors(stub) -> None:  # type: ignore[no-untyped-def]
    for sid in ("a", "b", "c"):
        stub.Allocate(pb.AllocateRequest(seq_id=sid, num_tokens=8))
    r = stub.Step(pb.StepRequest(append_seq_ids=["a", "c"], append_num_tokens=[12, 1]))
    assert [p.seq_id for p in r.preempted] == ["c"] and len(r.ops.swap_out) == 2
    assert [(e.kind, e.seq_id, e.code) for e in r.errors] == [
        (pb.StepItemError.PACKED_APPEND, "c", grpc.StatusCode.FAILED_PRECONDITION.value[0])
    ]
    r = stub.Step(pb.StepRequest(free_seq_ids=["a"], swap_in_seq_ids=["c", "ghost"]))
    assert len(r.swap_ins) == 2 and len(r.swap_ins[0].block_ids) == 2 and not r.swap_ins[1].block_ids
    assert [o.src for o in r.ops.swap_in] and r.errors[0].kind == pb.StepItemError.SWAP_IN
    assert r.errors[0].code == grpc.StatusCode.NOT_FOUND.value[0]


def test_preempt_rpc_and_config(stub) -> None:  # type: ignore[no-untyped-def]
    stub.Allocate(pb.AllocateRequest(seq_id="a", num_tokens=8))
    r = stub.Preempt(pb.PreemptRequest(seq_id="a", mode="recompute"))
    assert [(p.seq_id, p.mode) for p in r.preempted] == [("a", pb.Preemption.RECOMPUTE)]
    with pytest.raises(grpc.RpcError) as info:
        stub.Preempt(pb.PreemptRequest(seq_id="a"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    cfg = stub.GetConfig(pb.GetConfigRequest())
    assert (cfg.eviction_policy, cfg.preemption_mode, cfg.num_cpu_blocks) == ("lru-size", "swap", 8)
