"""The engine's mirror of what the block manager holds for it (frontend/engine/remote_table.py):
whether a sequence grows without a Step, how a reply's growth, grants and refused appends land,
which Frees are due, and what a swap-out keeps. Pure: no manager, no worker."""

from __future__ import annotations

import pytest

from pagedkv.frontend.engine.remote_table import BlockManagerPlan, PoolView, RemoteTable
from pagedkv.frontend.engine.step_messages import (
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    ItemError,
    StepDelta,
    StepPlan,
)
from pagedkv.frontend.engine.types import Completion, GenerationRequest, RequestOutput, Seq, SeqStatus
from pagedkv.v1 import block_manager_pb2 as pb

BS = 4


def _seq(name: str, num_tokens: int, table: list[int], slots: int | None = None) -> Seq:
    req = GenerationRequest(name, list(range(1, num_tokens + 1)), max_tokens=8)
    out = RequestOutput(name, list(req.prompt), [Completion(index=0)])
    s = Seq(f"e:{name}/0", req, out, 0, list(req.prompt), status=SeqStatus.RUNNING)
    s.blocks.table = list(table)
    s.blocks.slots = num_tokens if slots is None else slots
    return s


def _table(available: int = 10) -> RemoteTable:
    t = RemoteTable(BS, 16, prefix_caching=True, defer_appends=True, hints=4)
    t.pool = PoolView(available, 0)
    return t


def _delta(**kw: object) -> StepDelta:
    fields: dict[str, object] = dict(
        available_blocks=5,
        prefix_cache_drops=0,
        grown=[],
        ops=pb.CacheOps(),
        preempted=[],
        errors=[],
        alloc_tables=[],
        alloc_cached=[],
        swap_ins=[],
    )
    fields.update(kw)
    return StepDelta(**fields)  # type: ignore[arg-type]


def test_a_sequence_grows_without_a_step_while_its_tokens_fit_a_private_tail() -> None:
    t = _table()
    s = _seq("a", 6, [1, 2], slots=5)  # its 6th token has no slot, but 8 fit its two blocks
    assert s.needs_slot and t.can_grow(s)
    s.tokens.extend([7, 8, 9])  # 9 tokens: past its blocks
    assert not t.can_grow(s)
    s.blocks.ahead = 3  # the block granted ahead counts
    assert t.can_grow(s) and s.blocks.step_table == [1, 2, 3]
    s.blocks.tail_shared = True  # a shared tail's append copies on write: it cannot wait
    assert not t.can_grow(s)


def test_growth_lands_in_the_block_granted_ahead_and_a_copy_replaces_the_tail() -> None:
    t = _table()
    a = _seq("a", 9, [1, 2], slots=8)
    a.blocks.ahead = 7
    b = _seq("b", 5, [3, 4], slots=4)
    plan = BlockManagerPlan(StepPlan(appends=[(a.seq_id, 9), (b.seq_id, 5)]), grow=[a, b])
    t.reconcile(plan, _delta(grown=[(0, 7, False), (1, 8, True)]))
    assert a.blocks.table == [1, 2, 7] and a.blocks.ahead is None
    assert b.blocks.table == [3, 8], "copy-on-write replaces the last block"
    assert t.pool.available == 5
    assert t.reconcile_appends(plan, _delta(), set()) == []
    assert a.blocks.slots == 9 and b.blocks.slots == 5 and not b.blocks.tail_shared


def test_growth_into_another_block_than_the_one_granted_ahead_is_refused() -> None:
    t = _table()
    a = _seq("a", 9, [1, 2], slots=8)
    a.blocks.ahead = 7
    plan = BlockManagerPlan(StepPlan(appends=[(a.seq_id, 9)]), grow=[a])
    with pytest.raises(RuntimeError, match="not block 7"):
        t.reconcile(plan, _delta(grown=[(0, 9, False)]))


def test_an_append_without_room_is_handed_back_and_takes_no_slot() -> None:
    t = _table()
    a = _seq("a", 10, [1, 2], slots=8)  # two appends, the second refused
    b = _seq("b", 5, [3, 4], slots=4)
    plan = BlockManagerPlan(StepPlan(), grow=[a, a, b])
    full = ItemError("append", 1, a.seq_id, RESOURCE_EXHAUSTED, "no room")
    assert t.reconcile_appends(plan, _delta(errors=[full]), set()) == [a]
    assert a.blocks.slots == 8 and b.blocks.slots == 5
    lost = ItemError("append", 2, b.seq_id, NOT_FOUND, "gone")
    with pytest.raises(RuntimeError, match="refused to grow"):
        t.reconcile_appends(plan, _delta(errors=[lost]), set())
    assert t.reconcile_appends(plan, _delta(errors=[lost]), {b.seq_id}) == [], "a victim's own item"


def test_a_grant_lands_only_on_a_sequence_still_running() -> None:
    t = _table()
    a, b = _seq("a", 8, [1, 2]), _seq("b", 8, [3, 4])
    b.status = SeqStatus.WAITING  # preempted by this very Step
    plan = BlockManagerPlan(StepPlan(grants=[a.seq_id, b.seq_id]), grant=[a, b])
    t.reconcile_appends(plan, _delta(granted=[(0, 9), (1, 10)]), set())
    assert a.blocks.ahead == 9 and b.blocks.ahead is None


def test_a_fenced_finished_sequence_waits_for_its_free_and_a_requeued_one_does_not() -> None:
    t = _table()
    done, requeued = _seq("done", 4, [1]), _seq("again", 4, [2])
    done.status, requeued.status = SeqStatus.FINISHED, SeqStatus.WAITING
    t.finished(done)
    t.free_later(requeued)
    t.held = {done.seq_id, requeued.seq_id}
    assert t.frees_due() == [requeued.seq_id]
    t.held = set()
    assert t.frees_due() == [done.seq_id, requeued.seq_id]
    plan = BlockManagerPlan(StepPlan(frees=t.frees_due()))
    t.reconcile(plan, _delta())
    assert t.finishing() == [] and not t.owes_free(done)


def test_owed_appends_hold_a_free_back_unless_the_steps_growth_needs_the_room() -> None:
    done = _seq("done", 9, [1, 2, 3], slots=6)  # computed 8: its 2nd block has 2 slots unappended
    done.num_computed = 8
    done.status = SeqStatus.FINISHED
    grower = _seq("g", 9, [4, 5], slots=8)  # its 9th token needs a 3rd block
    t = _table(available=1)
    t.finished(done)
    assert t.owed_slots([done.seq_id], [grower]) == [done]
    t.pool = PoolView(0, 0)
    assert t.owed_slots([done.seq_id], [grower]) == [], "freed at once: the growth needs its blocks"


def test_a_swap_out_keeps_only_the_kv_of_the_tables_blocks() -> None:
    t = _table()
    s = _seq("a", 10, [1, 2], slots=6)
    s.blocks.ahead = 3
    s.num_computed = 9  # its 9th token was written into the block granted ahead
    t.swapped_out(s)
    assert s.num_computed == 8 and s.blocks.table == [] and s.blocks.ahead is None
