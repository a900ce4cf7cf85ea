"""The engine's scheduler (frontend/engine/scheduler.py) without any server: the plan of one
iteration never exceeds the token budget or max_num_seqs, and a random schedule of arrivals,
finishes and preemptions never drops or duplicates a sequence."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.engine import scheduler
from frontend.engine.scheduler import Limits, PoolView
from frontend.engine.types import Completion, GenerationRequest, RequestOutput, Seq, SeqStatus


def _seq(i: int, prompt_len: int, n: int = 1, max_tokens: int = 8) -> Seq:
    req = GenerationRequest(
        f"r{i}", [1 + (i + j) % 50 for j in range(prompt_len)], max_tokens=max_tokens, n=n
    )
    out = RequestOutput(req.request_id, list(req.prompt), [Completion(index=k) for k in range(n)])
    return Seq(f"e:r{i}/0", req, out, 0, list(req.prompt))


seq_state = st.tuples(st.integers(1, 40), st.integers(0, 39), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(seq_state, max_size=30),
    max_batch_tokens=st.integers(1, 64),
    num_workers=st.integers(1, 3),
    separate=st.booleans(),
    prefill_busy=st.booleans(),
)
def test_batches_respect_the_token_budget_and_never_repeat_a_sequence(
    states: list[tuple[int, int, bool, bool, bool]],
    max_batch_tokens: int,
    num_workers: int,
    separate: bool,
    prefill_busy: bool,
) -> None:
    running = []
    for i, (length, computed, needs_slot, in_flight, awaiting) in enumerate(states):
        s = _seq(i, length)
        s.status = SeqStatus.RUNNING
        s.num_computed = min(computed, length - 1)
        s.needs_slot, s.in_flight, s.awaiting_parent = needs_slot, in_flight, awaiting
        running.append(s)
    limits = Limits(
        max_num_seqs=64, max_batch_tokens=max_batch_tokens, block_size=4, watermark=0, prefix_caching=False
    )
    decode, prefill = scheduler.batches(
        running, limits, separate_budgets=separate, num_workers=num_workers, prefill_busy=prefill_busy
    )
    budget = max_batch_tokens * num_workers
    chosen = [s for s, _ in decode + prefill]
    assert len(chosen) == len(set(map(id, chosen))), "a sequence scheduled twice"
    if separate:
        assert len(decode) <= budget and sum(k for _, k in prefill) <= budget
        assert not (prefill_busy and prefill)
    else:
        assert len(decode) + sum(k for _, k in prefill) <= budget
    for s, k in decode + prefill:
        assert s in running and not (s.needs_slot or s.in_flight or s.awaiting_parent)
        assert 1 <= k <= min(max_batch_tokens, len(s.tokens) - s.num_computed)
    for s, k in decode:
        assert k == 1 and s.num_computed == len(s.tokens) - 1
    # Nothing eligible is left out while budget remains.
    eligible = [s for s in running if not (s.needs_slot or s.in_flight or s.awaiting_parent)]
    used = len(decode) + (0 if separate else sum(k for _, k in prefill))
    if eligible and used < budget and not separate:
        assert set(map(id, eligible)) <= set(map(id, chosen))


@settings(max_examples=300, deadline=None)
@given(
    widths=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 30)), max_size=20),
    num_running=st.integers(0, 12),
    num_swap_in=st.integers(0, 3),
    available=st.integers(0, 60),
    max_num_seqs=st.integers(1, 16),
)
def test_admissions_are_fifo_within_max_num_seqs_and_free_blocks(
    widths: list[tuple[int, int]],
    num_running: int,
    num_swap_in: int,
    available: int,
    max_num_seqs: int,
) -> None:
    limits = Limits(
        max_num_seqs=max_num_seqs, max_batch_tokens=64, block_size=4, watermark=2, prefix_caching=False
    )
    running = [_seq(100 + i, 4) for i in range(num_running)]
    waiting = collections.deque(_seq(i, length, n=n) for i, (n, length) in enumerate(widths))
    admit, held = scheduler.admissions(waiting, running, [], [], num_swap_in, PoolView(available, 0), limits)
    assert held == 0
    assert admit == list(waiting)[: len(admit)], "admissions must be the head of the queue, in order"
    assert num_running + num_swap_in + sum(s.request.n for s in admit) <= max(
        max_num_seqs, num_running + num_swap_in
    )
    need = [-(-len(s.tokens) // 4) for s in admit]
    assert sum(need[1:]) <= max(available - limits.watermark, 0) or len(admit) <= 1


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 9), st.booleans(), st.booleans()), min_size=1, max_size=60
    ),
    max_num_seqs=st.integers(1, 6),
    max_batch_tokens=st.integers(1, 24),
    num_blocks=st.integers(20, 80),
)
def test_random_schedule_never_drops_or_duplicates_a_sequence(
    events: list[tuple[int, int, bool, bool]],
    max_num_seqs: int,
    max_batch_tokens: int,
    num_blocks: int,
) -> None:
    """Arrivals, iterations (plan, allocate what fits, compute, sample), finishes and recompute
    preemptions at random, against a toy pool: every sequence is always in exactly one of
    waiting / running / finished, running never exceeds max_num_seqs, no step exceeds the budget."""
    bs = 4
    limits = Limits(
        max_num_seqs=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
        block_size=bs,
        watermark=1,
        prefix_caching=False,
    )
    waiting: collections.deque[Seq] = collections.deque()
    running: list[Seq] = []
    finished: list[Seq] = []
    all_ids: set[str] = set()

    def blocks(s: Seq) -> int:
        return -(-len(s.tokens) // bs)

    for step, (arrivals, length, finish, preempt) in enumerate(events):
        for a in range(arrivals):
            s = _seq(step * 10 + a, 1 + (length + a) % 10)
            waiting.append(s)
            all_ids.add(s.seq_id)
        grow = [s for s in running if s.needs_slot]
        for s in grow:  # the toy pool always has a slot for the sampled token
            s.needs_slot = False
        used = sum(blocks(s) for s in running)
        admit, _ = scheduler.admissions(waiting, running, [], grow, 0, PoolView(num_blocks - used, 0), limits)
        for s in admit:
            if used + blocks(s) > num_blocks:
                break
            waiting.remove(s)
            s.status, s.num_computed = SeqStatus.RUNNING, 0
            running.append(s)
            used += blocks(s)
        assert len(running) <= max_num_seqs
        decode, prefill = scheduler.batches(running, limits)
        assert len(decode) + sum(k for _, k in prefill) <= max_batch_tokens
        for s, k in decode + prefill:
            s.num_computed += k
            if s.num_computed == len(s.tokens):
                s.tokens.append(7)
                s.needs_slot = True
                if finish or len(s.tokens) > 30:
                    s.status = SeqStatus.FINISHED
                    running.remove(s)
                    finished.append(s)
        if preempt and running:
            victim = running.pop()
            victim.status, victim.num_computed, victim.needs_slot = SeqStatus.WAITING, 0, False
            waiting.appendleft(victim)
        ids = [s.seq_id for s in list(waiting) + running + finished]
        assert len(ids) == len(set(ids)), "a sequence is in two places"
        assert set(ids) == all_ids, "a sequence was dropped"
