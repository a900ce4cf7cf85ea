"""Every transition of the scheduler (frontend/engine/scheduler.py), driven as the engine drives it
against the block manager's real core in-process (harness.py): admission, allocation failure,
fork, preemption by recompute and by swap, swap-in, abort mid-prefill, and the recovery paths.
Each run ends with the fault-free tokens and nothing held in the manager."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedkv.frontend.engine.step_messages import StepDelta, StepPlan
from pagedkv.frontend.engine.types import GenerationRequest, SeqStatus
from tests.frontend.engine.harness import Driver, expected


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + j) % 50 + 1 for j in range(length)]


def test_requests_generate_their_tokens_and_free_everything() -> None:
    d = Driver.make(num_gpu_blocks=32)
    for i in range(4):
        d.add(f"r{i}", _prompt(i, 5 + i), max_tokens=6)
    d.run()
    for i in range(4):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 5 + i), 6)
        assert d.scheduler.outputs[f"r{i}"].completions[0].finish_reason == "length"
    d.assert_nothing_held()


def test_an_admission_leaves_the_block_a_running_sequence_crosses_into() -> None:
    """A running sequence crosses a block boundary in the same Step that two requests wait, with
    exactly enough blocks for the growth and one of them: the second is held back (not even
    asked for), and nothing is preempted."""
    d = Driver.make(num_gpu_blocks=4, prefix_caching=False, preemption_mode="recompute", grant_ahead_tokens=0)
    d.add("a", _prompt(0, 4), max_tokens=8)  # 4 tokens: its 5th needs a second block
    d.add("c", _prompt(1, 3), max_tokens=3)  # 3 tokens: its 4th fits its block
    d.iterate()
    a = d.scheduler.seqs["test:a/0"]
    assert a.needs_slot and len(a.tokens) == 5 and d.bm.core.pool.num_available == 2
    d.add("w0", _prompt(2, 4), max_tokens=2)  # one block each
    d.add("w1", _prompt(3, 4), max_tokens=2)
    delta = d.block_manager_step()
    assert delta is not None
    step = d.bm.steps[-1]
    assert [s for s, _ in step.appends] == ["test:a/0", "test:c/0"]
    assert [s for s, _, _ in step.allocs] == ["test:w0/0"], "w1 must wait: a's growth takes its block"
    assert delta.preempted == [] and not delta.errors
    assert len(a.block_table) == 2 and not a.needs_slot
    assert d.scheduler.seqs["test:w1/0"].status is SeqStatus.WAITING
    assert d.scheduler.stats.preempted_recompute == 0
    d.worker_step()
    d.run()
    for rid, i, n in (("a", 0, 8), ("c", 1, 3), ("w0", 2, 2), ("w1", 3, 2)):
        assert d.tokens(rid) == expected(_prompt(i, 4 if rid != "c" else 3), n)
    d.assert_nothing_held()


def test_appends_inside_a_block_wait_for_the_step_that_needs_a_block() -> None:
    """One sequence decoding: a Step only when it crosses into a new block (and to allocate and to
    free), each carrying the deferred token ids, which the prefix cache then hashes: a second
    request whose prompt is the first one's whole text hits the generated blocks."""
    d = Driver.make(num_gpu_blocks=16, block_size=4, grant_ahead_tokens=0)
    prompt = _prompt(0, 6)
    d.add("r", prompt, max_tokens=14)
    iterations = 0
    while d.scheduler.has_work():
        d.iterate()
        iterations += 1
    assert d.tokens("r") == expected(prompt, 14)
    assert iterations == 15  # 14 tokens, then the Free
    # allocate, the crossings into blocks 3, 4 and 5 (tokens 8, 12 and 16) with every token deferred
    # since the last one, and the free
    assert [len(st.appends) for st in d.bm.steps] == [0, 3, 4, 4, 0]
    assert [len(st.allocs) for st in d.bm.steps] == [1, 0, 0, 0, 0] and d.bm.steps[-1].frees == ["test:r/0"]
    d.assert_nothing_held()
    text = prompt + d.tokens("r")
    d.add("again", text[:17], max_tokens=1)
    d.iterate()
    assert d.scheduler.outputs["again"].num_cached_tokens == 16, "the generated blocks were hashed"
    d.run()
    d.assert_nothing_held()


def test_a_block_granted_ahead_takes_the_boundary_crossing_off_the_step_path() -> None:
    """With grants, the allocation's Step also grants block 3, so crossing into it needs no Step;
    the crossing into block 4 does, carrying the seven deferred token ids and granting block 5, into
    which the last tokens go without a Step. Once it finished, one Step appends the deferred tokens
    that complete block 4 and the next commits and frees it. The worker stand-in wrote tokens into
    each granted block before the manager put it in the table, and read them back through the
    table: the tokens are the fault-free ones, the prefix cache hashes them, and nothing stays held."""
    d = Driver.make(num_gpu_blocks=16, block_size=4)
    prompt = _prompt(0, 6)
    d.add("r", prompt, max_tokens=14)
    while d.scheduler.has_work():
        d.iterate()
    assert d.tokens("r") == expected(prompt, 14)
    assert [len(st.appends) for st in d.bm.steps] == [0, 7, 3, 0]
    assert [len(st.grants) for st in d.bm.steps] == [1, 1, 0, 0]
    assert [len(st.frees) for st in d.bm.steps] == [0, 0, 0, 1]
    d.assert_nothing_held()
    text = prompt + d.tokens("r")
    d.add("again", text[:17], max_tokens=1)
    d.iterate()
    assert d.scheduler.outputs["again"].num_cached_tokens == 16, "the generated blocks were hashed"
    d.run()
    d.assert_nothing_held()


def test_a_finished_sequence_owing_appends_is_freed_at_once_when_growth_needs_its_blocks() -> None:
    """A finished sequence whose deferred appends complete a block is normally freed a Step after
    those appends (so the block is committed to the prefix cache first). When the same Step's
    growth needs more blocks than the pool has, it is freed at once instead: holding its blocks back
    would make that growth fail and preempt a running sequence for nothing."""
    d = Driver.make(num_gpu_blocks=3, block_size=2, grant_ahead_tokens=0, preemption_mode="recompute")
    d.add("a", _prompt(0, 1), max_tokens=2)  # 1 block; its one append is deferred until it finishes
    d.add("b", _prompt(1, 3), max_tokens=3)  # 2 blocks; its 5th token needs a 3rd in the same iteration
    d.iterate()
    d.iterate()  # no Step: a's and b's appends fit their blocks; a finishes, b's next token has no block
    assert len(d.bm.steps) == 1 and d.scheduler.outputs["a"].finished
    d.block_manager_step()
    step = d.bm.steps[-1]
    assert step.frees == ["test:a/0"] and {s for s, _ in step.appends} == {"test:b/0"}
    assert d.scheduler.stats.preempted_recompute == 0
    d.run()
    assert d.tokens("a") == expected(_prompt(0, 1), 2) and d.tokens("b") == expected(_prompt(1, 3), 3)
    assert d.scheduler.stats.preempted_recompute == 0
    d.assert_nothing_held()


def test_no_block_is_granted_ahead_while_a_request_waits_for_room() -> None:
    """A grant takes a block a waiting request's admission needs, and saves no Step while one waits
    (each iteration tries its admission): b, held back at the first Step, is admitted as soon as c's
    blocks are freed, not once a's granted block is too."""
    d = Driver.make(num_gpu_blocks=6, block_size=4)
    d.add("a", _prompt(0, 6), max_tokens=12)  # 2 blocks, and would be granted a 3rd
    d.add("c", _prompt(1, 7), max_tokens=1)  # 2 blocks, freed after its prefill
    d.add("b", _prompt(2, 13), max_tokens=2)  # 4 blocks: waits for c's
    d.iterate()
    assert [s for s, _, _ in d.bm.steps[0].allocs] == ["test:a/0", "test:c/0"]
    assert d.bm.steps[0].grants == []
    d.iterate()
    assert d.scheduler.seqs["test:b/0"].status is SeqStatus.RUNNING
    d.run()
    assert d.scheduler.stats.blocks_granted_ahead > 0, "once nobody waits, a is granted its next block"
    for rid, i, n, m in (("a", 0, 6, 12), ("c", 1, 7, 1), ("b", 2, 13, 2)):
        assert d.tokens(rid) == expected(_prompt(i, n), m)
    d.assert_nothing_held()


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 13), min_size=2, max_size=6),
    max_tokens=st.lists(st.integers(1, 17), min_size=6, max_size=6),
    num_gpu_blocks=st.integers(16, 40),  # one request always fits (30 tokens in 2-token blocks)
    ahead=st.sampled_from([None, 0, 1, 2, 3]),
)
# Each once made more Steps with grants, through a preemption by recompute or a late admission: a
# block granted to a sequence that never writes into it; a finished sequence's Free held back (for
# its deferred appends) while the same Step's growth needed its blocks; a grant taking the blocks
# a waiting request needed (tests above pin each rule on its own).
@example(lengths=[1, 3, 7, 3, 6, 12], max_tokens=[1, 1, 10, 5, 13, 4], num_gpu_blocks=17, ahead=None)
@example(lengths=[1, 4, 4, 1, 1, 13], max_tokens=[2, 10, 10, 2, 2, 4], num_gpu_blocks=16, ahead=None)
@example(lengths=[1, 5, 5, 5, 13, 1], max_tokens=[1, 3, 3, 3, 1, 1], num_gpu_blocks=16, ahead=None)
def test_grants_change_no_token_and_cut_steps(
    lengths: list[int], max_tokens: list[int], num_gpu_blocks: int, ahead: int | None
) -> None:
    """Any mix of requests, pool sizes (preempting by recompute under pressure) and grant thresholds:
    the tokens are the fault-free ones, nothing stays held, and granting never makes more Steps."""

    def run(grant: int | None) -> tuple[dict[str, list[int]], int]:
        d = Driver.make(
            num_gpu_blocks=num_gpu_blocks, block_size=2, preemption_mode="recompute", grant_ahead_tokens=grant
        )
        for i, n in enumerate(lengths):
            d.add(f"r{i}", _prompt(i, n), max_tokens=max_tokens[i])
        d.run()
        d.assert_nothing_held()
        return {f"r{i}": d.tokens(f"r{i}") for i in range(len(lengths))}, len(d.bm.steps)

    with_grants, steps = run(ahead)
    without, base_steps = run(0)
    assert (
        with_grants
        == without
        == {f"r{i}": expected(_prompt(i, n), max_tokens[i]) for i, n in enumerate(lengths)}
    )
    if ahead != 0:
        # One more at most: a sequence that finishes inside its granted block owes the appends the
        # Steps it saved deferred, and they go one Step ahead of its Free (Scheduler._owed_slots).
        assert steps <= base_steps + 1


def test_multi_step_decode_gives_the_same_tokens_in_fewer_worker_calls() -> None:
    """decode_steps=4: each worker call runs as many decode steps as the blocks the sequence holds
    (the one granted ahead too) and its max_tokens allow, so 13 decode tokens take 5 calls, not 13;
    the tokens, the Steps' appends and what the prefix cache learns are those of single steps."""
    prompt = _prompt(0, 6)
    runs = {}
    for steps in (1, 4):
        d = Driver.make(num_gpu_blocks=16, block_size=4, decode_steps=steps)
        d.add("r", prompt, max_tokens=14)
        d.run()
        assert d.tokens("r") == expected(prompt, 14)
        d.assert_nothing_held()
        runs[steps] = (len(d.worker_steps), sum(len(st.appends) for st in d.bm.steps))
        d.add("again", (prompt + d.tokens("r"))[:17], max_tokens=1)
        d.iterate()
        assert d.scheduler.outputs["again"].num_cached_tokens == 16, "the generated blocks were hashed"
        # the tokens no call of their own drew: 14 less the prefill's and one per decode call
        assert d.scheduler.stats.multi_step_tokens == 14 - runs[steps][0]
    assert runs[1][0] == 14  # the prefill, then one call per decode token
    assert runs[4][0] == 5 and runs[4][1] == runs[1][1]


def test_multi_step_decode_stops_at_a_stop_token_and_frees_what_it_wrote_past_it() -> None:
    prompt = _prompt(2, 5)
    full = expected(prompt, 12)
    stop = full[5]
    want = full[: full.index(stop) + 1]
    d = Driver.make(num_gpu_blocks=16, block_size=4, decode_steps=8)
    d.add("r", prompt, max_tokens=12, stop_token_ids=(stop,))
    d.run()
    assert d.tokens("r") == want
    assert d.scheduler.outputs["r"].completions[0].finish_reason == "stop"
    d.assert_nothing_held()


def test_tokens_a_reply_carries_past_the_one_that_finished_the_sequence_are_dropped() -> None:
    """A worker reply may carry more steps' tokens than the sequence takes (it ran them before it
    knew, or it does not check stop tokens): apply_outputs accepts them in order and takes nothing
    after the one that finishes the sequence, and what the worker wrote past it is freed."""
    prompt = _prompt(2, 5)
    full = expected(prompt, 12)
    stop = full[3]
    want = full[: full.index(stop) + 1]
    d = Driver.make(num_gpu_blocks=16, block_size=4, decode_steps=8)
    d.worker_stops = False
    d.add("r", prompt, max_tokens=12, stop_token_ids=(stop,))
    d.run()
    assert d.scheduler.stats.multi_step_tokens > 0, "the stop token came inside a multi-step reply"
    assert d.tokens("r") == want
    assert d.scheduler.outputs["r"].completions[0].finish_reason == "stop"
    assert [e.token_id for e in d.events if e.request_id == "r"] == want
    d.assert_nothing_held()


def test_a_sequence_waiting_for_swap_in_holds_the_others_to_single_steps() -> None:
    """While a preempted sequence waits in the swap queue, every call is one decode step: a
    multi-step call would keep it out for the whole call."""
    d = _contended("swap", num_cpu_blocks=32)
    d.decode_steps = 4
    seen_swapped = seen_multi = False
    for _ in range(300):
        if not d.scheduler.has_work():
            break
        d.block_manager_step()
        sched = d.scheduler
        decode, prefill = sched.batches(separate_budgets=False, num_workers=1, prefill_busy=False)
        batch = decode + prefill
        if batch and not prefill and not sched.waiting:
            steps = sched.decode_steps(batch, 4)
            if sched.swapped:
                seen_swapped = True
                assert steps is None, f"multi-step decode with {len(sched.swapped)} sequence(s) swapped out"
            elif steps is not None and max(steps) > 1:
                seen_multi = True
        d.worker_step()
    assert seen_swapped and seen_multi
    for i in range(4):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 6), 10)
    d.assert_nothing_held()


def test_a_waiting_request_gets_single_steps_until_it_is_admitted() -> None:
    """Multi-step decode only while nobody waits: a request that cannot be admitted yet (the pool is
    full) holds the running one to one decode step per call, so it is admitted as soon as blocks free."""
    d = Driver.make(num_gpu_blocks=6, block_size=4, max_num_seqs=1, decode_steps=4)
    d.add("a", _prompt(0, 6), max_tokens=6)
    d.iterate()  # a's prefill
    d.add("b", _prompt(1, 6), max_tokens=2)
    d.iterate()
    assert d.scheduler.waiting and d.worker_steps[-1] == [("test:a/0", 1)]
    assert d.scheduler.stats.multi_step_tokens == 0
    d.run()
    assert d.tokens("a") == expected(_prompt(0, 6), 6) and d.tokens("b") == expected(_prompt(1, 6), 2)
    d.assert_nothing_held()


def test_without_deferral_every_decode_iteration_makes_a_step() -> None:
    d = Driver.make(num_gpu_blocks=16, block_size=4, defer_appends=False)
    d.add("r", _prompt(0, 6), max_tokens=8)
    d.run()
    assert d.tokens("r") == expected(_prompt(0, 6), 8)
    # allocate, an append for each generated token but the last, and the free
    assert [len(st.appends) for st in d.bm.steps] == [0] + [1] * 7 + [0]
    d.assert_nothing_held()


def test_an_allocation_without_room_keeps_its_place_and_runs_later() -> None:
    d = Driver.make(num_gpu_blocks=6, prefix_caching=False, preemption_mode="off")
    d.add("big", _prompt(0, 16), max_tokens=4)  # 4 blocks + growth
    d.iterate()
    d.add("next", _prompt(1, 12), max_tokens=2)  # 3 blocks: not there while "big" runs
    d.add("after", _prompt(2, 2), max_tokens=2)
    d.iterate()
    assert d.scheduler.seqs["test:next/0"].status is SeqStatus.WAITING
    assert list(d.scheduler.waiting)[0].seq_id == "test:next/0", "it keeps the head of the queue"
    d.run()
    assert d.tokens("next") == expected(_prompt(1, 12), 2)
    assert d.tokens("big") == expected(_prompt(0, 16), 4)
    assert d.tokens("after") == expected(_prompt(2, 2), 2)
    d.assert_nothing_held()


def test_samples_fork_from_the_prompt_and_draw_their_first_tokens_from_its_prefill() -> None:
    d = Driver.make(num_gpu_blocks=16)
    prompt = _prompt(0, 9)
    d.add("r", prompt, max_tokens=5, n=3, seed=11)
    d.iterate()
    seqs = [d.scheduler.seqs[f"test:r/{i}"] for i in range(3)]
    assert [s.status for s in seqs] == [SeqStatus.RUNNING] * 3
    assert seqs[1].block_table == seqs[0].block_table, "a sample shares its parent's prompt blocks"
    assert all(len(s.tokens) == 10 and not s.awaiting_parent for s in seqs)
    assert len(d.bm.steps[0].forks) == 2 and len(d.worker_steps[0]) == 1, "one prefill, three first tokens"
    d.run()
    for i in range(3):
        assert d.tokens("r", i) == expected(prompt, 5, seed=11 + i)
    d.assert_nothing_held()


def _contended(mode: str, num_cpu_blocks: int = 0, defer_appends: bool = True) -> Driver:
    d = Driver.make(
        defer_appends=defer_appends,
        num_gpu_blocks=10,
        max_num_seqs=4,
        prefix_caching=False,
        preemption_mode=mode,
        num_cpu_blocks=num_cpu_blocks,
    )
    for i in range(4):
        d.add(f"r{i}", _prompt(i, 6), max_tokens=10)  # 2 blocks each now, 4 each by the end
    return d


@pytest.mark.parametrize("defer_appends", [True, False])
def test_preemption_by_recompute_gives_the_same_tokens(defer_appends: bool) -> None:
    d = _contended("recompute", defer_appends=defer_appends)
    d.run()
    assert d.scheduler.stats.preempted_recompute > 0
    assert d.scheduler.stats.preempted_swap == 0
    for i in range(4):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 6), 10)
    d.assert_nothing_held()


@pytest.mark.parametrize("defer_appends", [True, False])
def test_preemption_by_swap_and_swap_in_give_the_same_tokens(defer_appends: bool) -> None:
    d = _contended("swap", num_cpu_blocks=32, defer_appends=defer_appends)
    swapped_seen = False
    for _ in range(200):
        if not d.scheduler.has_work():
            break
        d.iterate()
        swapped_seen |= bool(d.scheduler.swapped)
    assert swapped_seen and d.scheduler.stats.preempted_swap > 0
    assert d.ops_sent > 0, "swap-out and swap-in ops reached the workers"
    for i in range(4):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 6), 10)
    d.assert_nothing_held()


def test_abort_mid_prefill_frees_its_blocks_and_spares_the_others() -> None:
    d = Driver.make(num_gpu_blocks=32, max_batch_tokens=8)
    d.add("long", _prompt(0, 30), max_tokens=4)
    d.add("short", _prompt(1, 3), max_tokens=4)
    d.iterate()
    long_seq = d.scheduler.seqs["test:long/0"]
    assert 0 < long_seq.num_computed < 30, "its prefill is chunked over several steps"
    assert d.scheduler.abort("long")
    assert long_seq.status is SeqStatus.FINISHED and d.scheduler.outputs["long"].finished
    d.block_manager_step()
    assert "test:long/0" in d.bm.steps[-1].frees
    d.worker_step()
    d.run()
    assert d.tokens("short") == expected(_prompt(1, 3), 4)
    assert d.scheduler.release("long") and d.scheduler.release("short")
    assert d.scheduler.seqs == {} and d.scheduler.outputs == {}
    d.assert_nothing_held()


def test_a_prefill_chunk_sent_before_a_requeue_never_counts_for_the_new_attempt() -> None:
    """A sequence requeued while its prefill chunk runs on a prefill worker (an overlapped Step's
    preemption) and admitted again before the chunk is harvested starts at the same token with
    other blocks: the old chunk wrote into the blocks it held before, so its results must be
    dropped (taking them skipped the prompt's KV: right first token, wrong ones after)."""
    d = Driver.make(num_gpu_blocks=32)
    d.add("r", _prompt(0, 6), max_tokens=4)
    d.block_manager_step()
    seq = d.scheduler.seqs["test:r/0"]
    items = d.scheduler.start_prefill([(seq, 6)])
    victims, frees = d.scheduler.take_block_holders()
    d.scheduler.requeue_all(victims)
    d.bm.step(StepPlan(frees=frees))
    d.block_manager_step()  # admitted again
    assert seq.status is SeqStatus.RUNNING and seq.num_computed == items[0].start == 0
    assert d.scheduler.end_prefill(items) == []
    d.run()
    assert d.tokens("r") == expected(_prompt(0, 6), 4)
    d.assert_nothing_held()


def test_cache_host_recovery_requeues_everything_and_recomputes_the_same_tokens() -> None:
    """What recovery.recover_lost_cache does with the scheduler: everything held is freed, every
    running and swapped sequence recomputes from its prompt and the tokens so far."""
    d = Driver.make(num_gpu_blocks=32)
    for i in range(3):
        d.add(f"r{i}", _prompt(i, 5), max_tokens=8)
    for _ in range(4):
        d.iterate()
    victims, frees = d.scheduler.take_block_holders()
    assert {s.seq_id for s in victims} <= set(frees) and len(victims) == 3
    d.scheduler.remote.note_pool(d.bm.step(_frees(frees)))
    d.scheduler.requeue_all(victims)
    assert [s.seq_id for s in d.scheduler.waiting] == [s.seq_id for s in victims]
    assert d.scheduler.stats.recomputed_tokens > 0 and not d.scheduler.remote.has_pending_ops()
    assert d.bm.num_sequences() == 0
    d.run()
    for i in range(3):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 5), 8)
    d.assert_nothing_held()


def test_a_step_whose_reply_was_lost_frees_what_it_created_in_the_next() -> None:
    """The manager applied the Step (allocated the admitted sequences) but the engine never heard:
    the next Step frees them before allocating them again, so nothing leaks."""
    d = Driver.make(num_gpu_blocks=16)
    d.add("r", _prompt(0, 6), max_tokens=3, n=2, seed=3)
    plan = d.scheduler.plan()
    assert plan is not None and plan.created == ["test:r/0", "test:r/1"]
    d.bm.step(plan.step)  # applied, reply lost
    d.scheduler.step_unanswered(plan)
    assert d.bm.num_sequences() == 2
    d.iterate()
    retry = d.bm.steps[-1]
    assert retry.frees == ["test:r/0", "test:r/1"] and [s for s, _, _ in retry.allocs] == ["test:r/0"]
    d.run()
    for i in range(2):
        assert d.tokens("r", i) == expected(_prompt(0, 6), 3, seed=3 + i)
    d.assert_nothing_held()


def _frees(ids: list[str]):  # type: ignore[no-untyped-def]
    from pagedkv.frontend.engine.step_messages import StepPlan

    return StepPlan(frees=list(ids))


@settings(max_examples=40, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 8), st.integers(1, 2)), min_size=1, max_size=8
    ),
    aborts=st.lists(st.integers(0, 7), max_size=3),
    mode=st.sampled_from(["recompute", "swap"]),
    defer_appends=st.booleans(),
    num_gpu_blocks=st.integers(8, 20),
    max_batch_tokens=st.integers(4, 32),
    decode_steps=st.sampled_from([1, 3, 8]),
)
# A sequence swapped out with deferred tokens in its block granted ahead (released, not swapped):
# it came back believing their KV computed, and drew a wrong token.
@example(
    arrivals=[(1, 7, 1), (12, 6, 2), (2, 5, 1)],
    aborts=[],
    mode="swap",
    defer_appends=True,
    num_gpu_blocks=9,
    max_batch_tokens=13,
    decode_steps=1,
)
def test_random_traffic_keeps_every_sequence_in_one_place_and_its_tokens(
    arrivals: list[tuple[int, int, int]],
    aborts: list[int],
    mode: str,
    defer_appends: bool,
    num_gpu_blocks: int,
    max_batch_tokens: int,
    decode_steps: int,
) -> None:
    """Arrivals, aborts and whatever preemptions a small pool forces: each sequence is in exactly
    one queue at every step, finished requests have the fault-free tokens, nothing stays held."""
    d = Driver.make(
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=4,
        max_batch_tokens=max_batch_tokens,
        preemption_mode=mode,
        num_cpu_blocks=32 if mode == "swap" else 0,
        defer_appends=defer_appends,
        decode_steps=decode_steps,
    )
    sched = d.scheduler
    for step in range(400):
        if step < len(arrivals):
            length, max_tokens, n = arrivals[step]
            d.add(f"r{step}", _prompt(step, length), max_tokens=max_tokens, n=n, seed=step)
        if step in aborts and f"r{step - 1}" in sched.outputs:
            sched.abort(f"r{step - 1}")
        d.iterate()
        places = [s.seq_id for s in list(sched.waiting) + sched.running + list(sched.swapped)]
        assert len(places) == len(set(places)), "a sequence is in two queues"
        for s in sched.seqs.values():
            in_queue = s.seq_id in places
            assert in_queue == (s.status is not SeqStatus.FINISHED), (s.seq_id, s.status)
        assert len(sched.running) + len(sched.swapped) <= 4 + 1  # n=2 forks may briefly share a slot
        if step >= len(arrivals) and not sched.has_work():
            break
    assert not sched.has_work()
    for step, (length, max_tokens, _) in enumerate(arrivals):
        out = sched.outputs[f"r{step}"]
        for i, c in enumerate(out.completions):
            if c.finish_reason == "length":
                assert c.token_ids == expected(_prompt(step, length), max_tokens, seed=step + i)
    d.assert_nothing_held()


@pytest.mark.parametrize("priorities", [(0, 0, 0, 0), (0, 0, 5, 5), (0, -3, 0, 7)])
def test_admission_goes_by_priority_then_arrival(priorities: tuple[int, ...]) -> None:
    """A pool that holds one request at a time: while r0 runs, r1..r3 wait, and they are admitted
    highest priority first, in arrival order within one priority (all 0: first come, first served).
    Every request still gets its fault-free tokens and nothing stays held."""
    d = Driver.make(num_gpu_blocks=4, block_size=4, max_num_seqs=4)
    d.add("r0", _prompt(0, 8), max_tokens=4, priority=priorities[0])
    d.iterate()  # r0 admitted alone
    for i in (1, 2, 3):
        d.add(f"r{i}", _prompt(i, 8), max_tokens=4, priority=priorities[i])
    d.run()
    first_step: dict[str, int] = {}
    for n, step in enumerate(d.worker_steps):
        for seq_id, _ in step:
            first_step.setdefault(seq_id.split(":")[1].split("/")[0], n)
    order = sorted(first_step, key=first_step.__getitem__)
    want = ["r0", *sorted(("r1", "r2", "r3"), key=lambda r: (-priorities[int(r[1])], r))]
    assert order == want
    for i in range(4):
        assert d.tokens(f"r{i}") == expected(_prompt(i, 8), 4)
    d.assert_nothing_held()


def test_a_request_for_prompt_logprobs_asks_for_no_hit_and_refuses_one_it_gets() -> None:
    """Its allocation carries alloc_skip_prefix_hits (every position must be scored), a request
    beside it still hits; a manager that ignores the flag (one that predates it) is an error, not
    prompt logprobs with holes."""
    d = Driver.make(num_gpu_blocks=32)
    d.add("a", _prompt(0, 9), max_tokens=2)
    d.run()
    d.scheduler.add(GenerationRequest("b", _prompt(0, 9), max_tokens=2, prompt_logprobs=0))
    d.add("c", _prompt(0, 9), max_tokens=2)
    d.block_manager_step()
    assert d.bm.steps[-1].alloc_skip_prefix_hits == [True, False]
    assert [d.scheduler.seqs[f"test:{r}/0"].num_computed for r in "bc"] == [0, 8]
    d.run()
    real = d.bm.step

    def predates_the_flag(plan: StepPlan) -> StepDelta:
        plan.alloc_skip_prefix_hits = []
        return real(plan)

    d.bm.step = predates_the_flag  # type: ignore[method-assign]
    d.scheduler.add(GenerationRequest("e", _prompt(0, 9), max_tokens=2, prompt_logprobs=0))
    with pytest.raises(RuntimeError, match="predates StepRequest.alloc_skip_prefix_hits"):
        d.block_manager_step()
