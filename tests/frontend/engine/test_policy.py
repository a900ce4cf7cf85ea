"""The scheduling policy (frontend/engine/policy.py), pure: the batches of one iteration never
exceed the token budget nor repeat a sequence, and admissions are the head of the queue within
max_num_seqs and the free blocks. (The queues' transitions: test_scheduler.py.)"""

from __future__ import annotations

import collections
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.frontend.engine import policy
from pagedkv.frontend.engine.policy import Limits
from pagedkv.frontend.engine.remote_table import PoolView
from pagedkv.frontend.engine.types import Completion, GenerationRequest, RequestOutput, Seq, SeqStatus


def _seq(i: int, prompt_len: int, n: int = 1, max_tokens: int = 8) -> Seq:
    req = GenerationRequest(
        f"r{i}", [1 + (i + j) % 50 for j in range(prompt_len)], max_tokens=max_tokens, n=n
    )
    out = RequestOutput(req.request_id, list(req.prompt), [Completion(index=k) for k in range(n)])
    return Seq(f"e:r{i}/0", req, out, 0, list(req.prompt), width=n)


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
    parent = _seq(999, 4)
    for i, (length, computed, needs_slot, in_flight, awaiting) in enumerate(states):
        s = _seq(i, length)
        s.status = SeqStatus.PREFILLING if in_flight else SeqStatus.RUNNING
        s.num_computed = min(computed, length - 1)
        s.blocks.slots = length - 1 if needs_slot else length
        s.parent = parent if awaiting else None
        running.append(s)
    limits = Limits(
        max_num_seqs=64, max_batch_tokens=max_batch_tokens, block_size=4, watermark=0, prefix_caching=False
    )
    decode, prefill = policy.batches(
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
        assert s in running and s.status is SeqStatus.RUNNING and not (s.needs_slot or s.awaiting_parent)
        assert 1 <= k <= min(max_batch_tokens, len(s.tokens) - s.num_computed)
    for s, k in decode:
        assert k == 1 and s.num_computed == len(s.tokens) - 1
    # Nothing eligible is left out while budget remains.
    eligible = [
        s for s in running if s.status is SeqStatus.RUNNING and not (s.needs_slot or s.awaiting_parent)
    ]
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
    admit, held = policy.admissions(waiting, running, [], [], num_swap_in, PoolView(available, 0), limits)
    assert held == 0
    assert admit == list(waiting)[: len(admit)], "admissions must be the head of the queue, in order"
    assert num_running + num_swap_in + sum(s.request.n for s in admit) <= max(
        max_num_seqs, num_running + num_swap_in
    )
    need = [-(-len(s.tokens) // 4) for s in admit]
    assert sum(need[1:]) <= max(available - limits.watermark, 0) or len(admit) <= 1


def _decoding(
    i: int, prompt_len: int, generated: int, blocks: int, max_tokens: int = 8, **opts: object
) -> Seq:
    """A running sequence about to decode: ``generated`` tokens drawn, ``blocks`` 4-token blocks held."""
    s = _seq(i, prompt_len, max_tokens=max_tokens)
    s.request.sampling = dataclasses.replace(s.request.sampling, **opts)  # type: ignore[arg-type]
    s.completion.token_ids.extend(range(generated))
    s.tokens.extend(range(generated))
    s.num_computed = len(s.tokens) - 1
    s.blocks.table = list(range(blocks))
    s.status = SeqStatus.RUNNING
    return s


def test_decode_steps_go_as_far_as_the_held_blocks_and_max_tokens_allow() -> None:
    roomy = _decoding(0, 5, 1, 4)  # 6 tokens, 16 slots: 11 positions left from the one computed next
    at_edge = _decoding(1, 7, 1, 2)  # 8 tokens in 8 slots: its next token's position is the last
    nearly_done = _decoding(2, 5, 6, 4)  # 2 of its 8 tokens left
    batch = [(roomy, 1), (at_edge, 1), (nearly_done, 1)]
    assert policy.decode_steps(batch, 4, 4) == [4, 1, 2]
    assert policy.decode_steps(batch, 1, 4) is None  # multi-step off
    at_edge.blocks.ahead = 9  # the block granted ahead counts
    assert policy.decode_steps(batch, 4, 4) == [4, 4, 2]
    assert policy.decode_steps([(at_edge, 1)], 64, 4) == [5]
    assert policy.decode_steps([(_decoding(3, 7, 1, 2), 1)], 4, 4) is None  # nobody goes further


def test_decode_steps_leave_prefill_and_engine_tracked_sampling_to_single_steps() -> None:
    ok = _decoding(0, 5, 1, 4)
    assert policy.decode_steps([(ok, 1), (_seq(1, 9), 9)], 4, 4) is None  # a prefill chunk in the batch
    penalized = _decoding(2, 5, 1, 4, presence_penalty=0.5)
    grammar = _decoding(3, 5, 1, 4, grammar=object())
    shared = _decoding(4, 5, 1, 4)
    shared.blocks.tail_shared = True
    assert policy.decode_steps([(ok, 1), (penalized, 1), (grammar, 1), (shared, 1)], 4, 4) == [4, 1, 1, 1]


def test_a_block_ahead_goes_only_to_a_sequence_that_will_write_into_it() -> None:
    """The last token a sequence draws is never computed: a sequence whose held blocks have a slot
    for every other token it may still draw gets no block ahead (it would hold it for nothing)."""
    limits = Limits(max_num_seqs=8, max_batch_tokens=64, block_size=4, watermark=0, prefix_caching=False)
    last_fits = _decoding(0, 5, 2, 2, max_tokens=4)  # 7 tokens, 8 slots; of 2 more, the 1st is computed
    writes_past = _decoding(1, 5, 2, 2, max_tokens=5)  # of 3 more, the 2nd is computed at position 9
    assert policy.grants([last_fits, writes_past], 2, limits, 4) == [writes_past]
