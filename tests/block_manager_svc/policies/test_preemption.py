"""Preemption: victim order, fork groups, swap/recompute, SwapIn, atomicity."""

from __future__ import annotations

import copy

import pytest

from pagedkv.block_manager_svc.core import (
    BlockManager,
    CoreConfig,
    ErrorCode,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    StepBatch,
)
from pagedkv.block_manager_svc.core.preemption import VictimQueue

BS = 4


def make(num_blocks: int = 8, mode: str = "auto", cpu: int = 16, **kw: object) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=num_blocks,
            block_size=BS,
            num_cpu_blocks=cpu,
            preemption_mode=mode,
            eviction_policy="lru-size",
            **kw,
        )
    )  # type: ignore[arg-type]


def snapshot(bm: BlockManager) -> object:
    pool = bm.pool
    return copy.deepcopy(
        (
            {k: (list(s.block_ids), s.num_tokens) for k, s in bm.seqs.items()},
            {k: (list(s.cpu_block_ids or ()), s.num_tokens) for k, s in bm.swapped.items()},
            list(pool.ref_counts),
            sorted(pool.free_list),
            dict(pool.index),
            list(bm.cpu.ref_counts),
            bm.stats(),
        )
    )


def test_victim_queue_orders_by_priority_then_latest_arrival() -> None:
    q = VictimQueue()
    q.push("a", 0, 1)
    q.push("b", 0, 2)
    q.push("c", -1, 3)
    q.push("d", 5, 4)
    q.discard("b")
    q.push("b", 0, 2)  # back again (a swap-in): one live entry
    q.discard("a")
    assert list(q.candidates(lambda s: True)) == ["c", "b", "d"]
    assert list(q.candidates(lambda s: s != "c")) == ["b", "d"]
    assert len(q) == 3 and "a" not in q


def test_append_preempts_the_latest_arrival_and_reports_it() -> None:
    bm = make(num_blocks=6, mode="recompute")
    bm.allocate("a", 8)
    bm.allocate("b", 4)
    bm.allocate("c", 4)
    bm.allocate("d", 4)  # 5 of 6 used
    r = bm.append("a", 8)  # needs 2, 1 free: the latest arrival (d) goes
    assert [p.seq_id for p in r.preempted] == ["d"] and r.preempted[0].mode == "recompute"
    assert "d" not in bm.seqs and len(r.new_block_ids) == 2
    with pytest.raises(NotFound):
        bm.append("d", 1)
    bm.check_invariants()


def test_lower_priority_goes_first_and_higher_ranked_are_never_victims() -> None:
    bm = make(num_blocks=4, mode="recompute")
    bm.allocate("low", 4, priority=-1)  # arrived first but lowest priority
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.allocate("c", 4)
    r = bm.append("b", 1)
    assert [p.seq_id for p in r.preempted] == ["low"]
    # c arrived last at the same priority: nobody ranks below it.
    before = snapshot(bm)
    with pytest.raises(ResourceExhausted):
        bm.append("c", 5)
    assert snapshot(bm) == before
    # a ranks above b and c (both arrived later): latest first.
    r = bm.append("a", 5)
    assert [p.seq_id for p in r.preempted] == ["c", "b"]
    bm.check_invariants()


def test_fork_groups_are_preempted_and_swapped_in_together() -> None:
    bm = make(num_blocks=6, mode="swap", cpu=8)
    bm.allocate("a", 6)  # 2 blocks
    bm.allocate("p", 6)  # 2 blocks
    bm.fork("p", "q")  # shares p's 2 blocks
    r = bm.append("a", 12)  # needs 3, 2 free: p's group goes
    assert sorted(x.seq_id for x in r.preempted) == ["p", "q"]
    assert all(x.mode == "swap" for x in r.preempted)
    assert len(r.ops.swap_out) == 2  # shared blocks move once
    tp, tq = bm.block_table("p"), bm.block_table("q")
    assert tp.swapped and tp.cpu_block_ids == tq.cpu_block_ids and tp.block_ids == []
    bm.check_invariants()
    with pytest.raises(FailedPrecondition, match="SwapIn"):
        bm.append("q", 1)
    with pytest.raises(ResourceExhausted):
        bm.swap_in("q")
    bm.free("a")
    s = bm.swap_in("q")
    assert set(s.tables) == {"p", "q"} and s.tables["p"] == s.tables["q"] == s.block_ids
    assert sorted(c for c, _ in s.ops.swap_in) == sorted(tp.cpu_block_ids)
    assert [g for _, g in s.ops.swap_in] == s.block_ids
    assert bm.pool.ref_counts[s.block_ids[0]] == 2 and bm.cpu.num_free == 8
    st = bm.stats()
    assert st.num_preemptions_swap == 2 and st.num_swapped_out_blocks == 2 and st.num_swapped_in_blocks == 2
    bm.check_invariants()


def test_auto_recomputes_a_mostly_shared_sequence_and_swaps_a_private_one() -> None:
    prefix = list(range(32))  # 8 full blocks, kept referenced by "keeper"
    bm = make(num_blocks=24, mode="auto", cpu=32)
    bm.allocate("keeper", 33, prefix + [1])
    bm.commit("keeper", 33)
    bm.allocate("shared", 34, prefix + [2, 3])  # 8 hit blocks + 1 private
    bm.commit("shared", 34)
    bm.allocate("private", 24)  # 6 private blocks
    bm.allocate("grower", 4, priority=5)
    r = bm.append("grower", 4 * 14)
    modes = {p.seq_id: p.mode for p in r.preempted}
    assert modes == {"private": "swap", "shared": "recompute"}
    bm.check_invariants()


def test_swap_falls_back_to_recompute_without_cpu_room() -> None:
    bm = make(num_blocks=4, mode="swap", cpu=1)
    bm.allocate("a", 4)
    bm.allocate("b", 8)
    r = bm.append("a", 8)
    assert r.preempted[0].mode == "recompute"
    bm.check_invariants()


def test_failed_preemption_leaves_everything_unchanged() -> None:
    bm = make(num_blocks=6, mode="auto", cpu=4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.allocate("c", 12, priority=1)  # ranks above a: never its victim
    before = snapshot(bm)
    with pytest.raises(ResourceExhausted):
        bm.append("a", 20)  # needs 5, 1 free, b frees only 1 more
    assert snapshot(bm) == before
    bm.check_invariants()


def test_off_mode_never_preempts() -> None:
    bm = make(num_blocks=4, mode="off")
    bm.allocate("a", 4)
    bm.allocate("b", 12)
    with pytest.raises(ResourceExhausted):
        bm.append("a", 4)


def test_step_never_preempts_a_sequence_that_already_grew_and_victims_fail_later() -> None:
    bm = make(num_blocks=4, mode="recompute")
    for s in ("a", "b", "c"):
        bm.allocate(s, 4)
    r = bm.step(StepBatch(append_seq_ids=["c", "a", "b"], append_num_tokens=[4, 4, 1]))
    # c takes the last free block; a ranks above b and c, but c already grew
    # in this step, so b is the victim; b's own item then fails.
    assert [p.seq_id for p in r.preempted] == ["b"]
    assert [(e.seq_id, e.code) for e in r.append_errors] == [("b", ErrorCode.NOT_FOUND)]
    assert "preempted for recompute" in r.append_errors[0].message
    bm.check_invariants()


def test_step_swap_ins_come_after_appends_and_report_errors() -> None:
    bm = make(num_blocks=4, mode="swap", cpu=4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.append("a", 12)  # preempts b by swap
    assert "b" in bm.swapped
    r = bm.step(StepBatch(free_seq_ids=["a"], swap_in_seq_ids=["b", "nope"]))
    assert r.swap_in_results[0] is not None and r.swap_in_results[1] is None
    assert r.swap_in_errors[0].code is ErrorCode.NOT_FOUND
    assert "b" in bm.seqs
    bm.check_invariants()


def test_watermark_keeps_admissions_and_swap_ins_from_eating_the_reserve() -> None:
    bm = make(num_blocks=8, mode="swap", watermark_blocks=2)
    bm.allocate("a", 16)  # 4 blocks, 4 left
    with pytest.raises(ResourceExhausted, match="watermark"):
        bm.allocate("b", 12)  # would leave 1 < 2
    bm.allocate("b", 8)
    r = bm.append("a", 8)  # appends may use the reserve
    assert not r.preempted
    bm.check_invariants()


def test_free_of_a_swapped_sequence_releases_its_cpu_blocks() -> None:
    bm = make(num_blocks=4, mode="swap", cpu=4)
    bm.allocate("a", 4)
    bm.allocate("b", 8)
    bm.append("a", 8)
    assert bm.cpu.num_free == 2
    assert bm.free("b") == 0
    assert bm.cpu.num_free == 4 and bm.stats().num_swapped_sequences == 0
    bm.check_invariants()


def test_recompute_victim_keeps_its_arrival_when_reallocated() -> None:
    bm = make(num_blocks=5, mode="recompute")
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm.allocate("c", 4)
    arrival_c = bm.seqs["c"].arrival
    bm.append("b", 12)  # preempts c
    bm.free("b")
    bm.allocate("d", 4)
    bm.allocate("c", 4)
    assert bm.seqs["c"].arrival == arrival_c < bm.seqs["d"].arrival
    bm.check_invariants()


def test_manual_preempt_uses_the_planner() -> None:
    bm = make(num_blocks=4, mode="auto", cpu=4)
    bm.allocate("a", 8)
    preempted, ops = bm.preempt("a")
    assert preempted[0].mode == "swap" and len(ops.swap_out) == 2
    with pytest.raises(FailedPrecondition):
        bm.preempt("a")
    bm.swap_in("a")
    preempted, ops = bm.preempt("a", "recompute")
    assert preempted[0].mode == "recompute" and "a" not in bm.seqs and not ops
    bm.check_invariants()
