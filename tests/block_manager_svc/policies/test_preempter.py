"""The Preempter alone: no BlockManager, no server. Its whole view of the world is what its
constructor is given (a pool, a CPU pool, the running/swapped tables, the fork groups, a
release callback), so a test can build exactly that and watch what it changes."""

from __future__ import annotations

import copy

from pagedkv.block_manager_svc.core.block_pool import BlockPool
from pagedkv.block_manager_svc.core.cpu_pool import CpuPool
from pagedkv.block_manager_svc.core.errors import ResourceExhausted
from pagedkv.block_manager_svc.core.eviction import LruEviction
from pagedkv.block_manager_svc.core.preemption import Preempter, rank
from pagedkv.block_manager_svc.core.results import CacheOps
from pagedkv.block_manager_svc.core.sequence import SeqState
from pagedkv.block_manager_svc.core.swap_planner import CostModel, PreemptionMode

BS = 4


class World:
    """The few things a Preempter may see, built by hand; `released` records its releases."""

    def __init__(self, gpu: int = 8, cpu: int = 8, mode: str = "swap") -> None:
        self.pool = BlockPool(gpu, LruEviction(gpu))
        self.cpu = CpuPool(cpu)
        self.seqs: dict[str, SeqState] = {}
        self.swapped: dict[str, SeqState] = {}
        self.groups: dict[int, set[str]] = {}
        self.released: list[str] = []
        self.pre = Preempter(
            mode=mode,
            block_size=BS,
            watermark_blocks=0,
            cost_model=CostModel(),
            pool=self.pool,
            cpu=self.cpu,
            seqs=self.seqs,
            swapped=self.swapped,
            groups=self.groups,
            release=self.release,
            exhausted=lambda what, needed, available, reserve: ResourceExhausted(
                f"{what}: {needed}>{available}"
            ),
        )

    def release(self, seq_id: str) -> int:
        seq = self.seqs.pop(seq_id)
        self.pre.gone(seq_id)
        self.released.append(seq_id)
        return sum(1 for b in reversed(seq.block_ids) if self.pool.decref(b))

    def admit(self, seq_id: str, blocks: int, priority: int = 0, arrival: int = 0) -> SeqState:
        seq = SeqState(seq_id, self.pool.take(blocks), blocks * BS, None, b"", 0, priority, arrival, arrival)
        self.seqs[seq_id] = seq
        self.pre.running(seq_id, priority, arrival)
        return seq

    def state(self) -> object:
        return copy.deepcopy(
            (
                {k: list(s.block_ids) for k, s in self.seqs.items()},
                {k: list(s.cpu_block_ids or ()) for k, s in self.swapped.items()},
                list(self.pool.ref_counts),
                list(self.pool.free_list),
                list(self.cpu.ref_counts),
                self.pre.victims._heap,  # noqa: SLF001 - planning must not even reorder it
                self.released,
            )
        )


def test_rank_is_the_one_order_of_who_yields() -> None:
    assert rank(0, 5) < rank(0, 1) < rank(1, 9)  # lower priority first, then the later arrival


def test_plan_is_pure_and_takes_the_lowest_ranked_groups_below_the_grower() -> None:
    w = World(gpu=8)
    w.admit("senior", 1, arrival=1)  # arrived before the grower: ranks above it
    grower = w.admit("grower", 1, arrival=2)
    w.admit("old", 2, arrival=3)
    w.admit("young", 2, arrival=4)
    w.admit("vip", 2, priority=5, arrival=5)
    before = w.state()
    plan = w.pre.plan(grower, 2, None)
    assert plan is not None and [v.members for v in plan.victims] == [["young"]]
    assert w.state() == before  # nothing applied, not even the heap's layout
    # More than one group's worth: the next lowest ranked below the grower is "old"; "vip" and
    # "senior" rank above the grower and are never candidates, so 5 blocks cannot be found.
    plan = w.pre.plan(grower, 4, None)
    assert plan is not None and [v.members for v in plan.victims] == [["young"], ["old"]]
    assert w.pre.plan(grower, 5, None) is None
    assert w.pre.plan(grower, 2, {w.seqs["young"].group}) is not None  # young grew: old goes instead
    assert [v.members for v in w.pre.plan(grower, 2, {w.seqs["young"].group}).victims] == [["old"]]  # type: ignore[union-attr]
    assert w.state() == before


def test_swap_moves_a_fork_group_to_the_cpu_pool_and_swap_in_brings_it_back() -> None:
    w = World(gpu=8, cpu=8, mode="swap")
    a = w.admit("a", 2, arrival=1)
    b = SeqState("b", list(a.block_ids), a.num_tokens, None, b"", 0, 0, 2, a.group)  # a fork of a
    for blk in b.block_ids:
        w.pool.incref(blk)
    w.seqs["b"] = b
    w.pre.running("b", 0, 2)
    w.groups[a.group] = {"a", "b"}
    grower = w.admit("g", 4, priority=1, arrival=3)
    plan = w.pre.plan(grower, 2, None)
    assert plan is not None and plan.victims[0].members == ["a", "b"]
    assert plan.victims[0].decision.mode is PreemptionMode.SWAP
    ops = CacheOps()
    out = w.pre.apply(plan, ops)
    assert [p.seq_id for p in out] == ["a", "b"] and set(w.swapped) == {"a", "b"}
    assert len(ops.swap_out) == 2  # the two shared blocks move once
    assert w.swapped["a"].cpu_block_ids == w.swapped["b"].cpu_block_ids
    assert w.cpu.ref_counts.count(2) == 2 and w.pool.num_free == 4
    assert w.pre.recently_preempted == {"a": "swap", "b": "swap"} and w.pre.num_preemptions_swap == 2
    assert "a" not in w.pre.victims and w.released == []
    w.pre.new_call()
    assert w.pre.recently_preempted == {}
    res = w.pre.swap_in(w.swapped["a"])
    assert set(res.tables) == {"a", "b"} and res.tables["a"] == res.tables["b"] and len(res.ops.swap_in) == 2
    assert set(w.seqs) == {"a", "b", "g"} and w.swapped == {} and w.cpu.num_free == 8
    assert "a" in w.pre.victims and w.pre.num_swapped_in_blocks == 2


def test_recompute_releases_through_the_callback_and_remembers_the_arrival() -> None:
    w = World(gpu=4, cpu=0, mode="recompute")
    w.admit("low", 2, arrival=7)
    grower = w.admit("g", 2, priority=1, arrival=8)
    plan = w.pre.plan(grower, 1, None)
    assert plan is not None
    out = w.pre.apply(plan, CacheOps())
    assert [p.mode for p in out] == ["recompute"] and w.released == ["low"]
    assert w.pre.recently_preempted == {"low": "recompute"} and w.pre.num_preemptions_recompute == 1
    assert w.pre.arrival_for("low", 99) == 7  # a re-admission keeps its place
    assert w.pre.arrival_for("low", 99) == 99  # once


def test_swap_in_refuses_when_there_is_no_room_and_changes_nothing() -> None:
    w = World(gpu=4, cpu=4, mode="swap")
    w.admit("a", 2, arrival=1)
    w.pre.preempt(w.seqs["a"])
    w.admit("b", 3, arrival=2)
    before = w.state()
    try:
        w.pre.swap_in(w.swapped["a"])
    except ResourceExhausted as e:
        assert "swapping in 'a'" in e.message
    else:
        raise AssertionError("swap_in found room that is not there")
    assert w.state() == before
