"""Speculative decoding through the scheduler (docs/speculative.md): n-gram proposals appended as
slots with their token ids, verified by the stand-in worker as the real one verifies, rolled back
to the accepted length in the next Step (rollbacks first, before its commits), and only accepted
tokens committed; stop tokens and max_tokens cut accepted tokens; aborts and preemptions between
the Step that appended proposals and their verification leave nothing held. Against the block
manager's real core in-process (harness.py)."""

from __future__ import annotations

import random

import pytest

from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.frontend.engine.step_messages import StepDelta
from pagedkv.frontend.engine.types import SeqStatus

from .harness import VOCAB, Driver, expected

PERIOD = 7


def copier(tokens: list[int], seed: int = 0) -> int:
    """A stand-in model that mostly repeats its context from PERIOD tokens back (so n-gram
    proposals are often right), and now and then does not (so some are rejected)."""
    n = len(tokens)
    if n < PERIOD:
        return (n * 13 + seed) % VOCAB
    t = tokens[n - PERIOD]
    return (t + 1) % VOCAB if n % 11 == 0 else t


def prompt(i: int, length: int = 12) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(VOCAB) for _ in range(length)]


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2, max_num_seqs=8)


def driver(*, speculative: SpeculativeConfig | None = SPEC, **kw: object) -> Driver:
    d = Driver.make(speculative=speculative, **{"num_gpu_blocks": 64, **kw})  # type: ignore[arg-type]
    d.model = copier
    return d


@pytest.mark.parametrize("defer_appends", [True, False])
@pytest.mark.parametrize("num_requests", [1, 4])
def test_outputs_equal_plain_decoding(defer_appends: bool, num_requests: int) -> None:
    d = driver(defer_appends=defer_appends)
    for i in range(num_requests):
        d.add(f"r{i}", prompt(i), max_tokens=30)
    d.run()
    for i in range(num_requests):
        assert d.tokens(f"r{i}") == expected(prompt(i), 30, model=copier)
    st = d.scheduler.stats
    assert st.spec_accepted > 0, "nothing was ever accepted: speculation did not run"
    assert st.spec_accepted < st.spec_proposed, "nothing was ever rejected: rollback untested"
    assert st.spec_emitted == st.spec_accepted + st.spec_passes
    assert len(d.worker_steps) < num_requests * 30 / 1.5  # fewer passes than tokens
    d.assert_nothing_held()


def test_each_sequences_proposals_follow_its_own_bound() -> None:
    """After a pass that rejected a proposal, the sequence's next proposal is at most one token
    longer than what was kept; after one kept whole, it may be twice as long (up to the setting)."""
    cfg = SpeculativeConfig(
        num_speculative_tokens=8, prompt_lookup_max=3, prompt_lookup_min=2, max_num_seqs=8
    )
    d = driver(speculative=cfg, defer_appends=False)
    d.add("r", prompt(4), max_tokens=80)
    sid = d.scheduler.seq_id("r", 0)
    bound, grew, shrank = None, 0, 0
    while d.scheduler.has_work():
        seq = d.scheduler.seqs[sid]
        d.block_manager_step()
        if seq.proposed:
            assert seq.proposed <= (8 if bound is None else bound)
        before = len(d.verified)
        d.worker_step()
        if len(d.verified) > before:
            _, proposed, accepted = d.verified[-1]
            prev = 8 if bound is None else bound
            bound = seq.proposal_bound
            if accepted == proposed:
                assert bound == min(8, 2 * prev)
                grew += bound > prev
            else:
                assert bound == accepted + 1
                shrank += bound < prev
    assert grew and shrank, "both rules must have run"
    assert d.tokens("r") == expected(prompt(4), 80, model=copier)
    d.assert_nothing_held()


def test_proposals_appended_then_rolled_back_to_accepted_length() -> None:
    """Without deferred appends every verification's proposals go to the manager as slots with
    their ids; a pass that rejected some is followed by a Step whose rollback (applied first) keeps
    what the pass computed, and whose commits never go past it."""
    d = driver(defer_appends=False)
    d.add("r", prompt(1), max_tokens=40)
    sid = d.scheduler.seq_id("r", 0)
    rolled = 0
    while d.scheduler.has_work():
        seq = d.scheduler.seqs[sid]
        before = len(d.verified)
        d.block_manager_step()
        if seq.proposed:
            step = d.bm.steps[-1]
            appended = [t for s, t in step.appends if s == sid]
            assert appended == seq.tokens[-1 - seq.proposed :], "proposals not appended with their ids"
        start = seq.num_computed
        d.worker_step()
        if len(d.verified) > before and seq.status is SeqStatus.RUNNING:
            _, proposed, accepted = d.verified[-1]
            assert seq.num_computed == start + 1 + accepted
            if accepted < proposed:
                d.block_manager_step()
                step = d.bm.steps[-1]
                assert step.rollbacks == [(sid, start + 1 + accepted)]
                assert all(n <= start + 1 + accepted for s, n in step.commits if s == sid)
                core_seq = d.bm.core.seqs[sid]
                assert core_seq.num_tokens == len(seq.tokens)  # rolled back, then the drawn token
                rolled += 1
                d.worker_step()
    assert rolled > 0
    assert d.tokens("r") == expected(prompt(1), 40, model=copier)
    d.assert_nothing_held()


@pytest.mark.parametrize("defer_appends", [True, False])
def test_committed_blocks_hold_accepted_tokens_only(defer_appends: bool) -> None:
    """A second request whose prompt is the first one's prompt and output hits the blocks the
    first committed: were a rejected proposal's id committed, its KV would be a wrong hit and the
    second request's tokens would differ."""
    d = driver(defer_appends=defer_appends, block_size=4)
    d.add("a", prompt(2), max_tokens=40)
    d.run()
    first = list(d.tokens("a"))
    assert first == expected(prompt(2), 40, model=copier)
    assert d.scheduler.stats.spec_accepted < d.scheduler.stats.spec_proposed
    follow = prompt(2) + first
    d.add("b", follow, max_tokens=10)
    d.run()
    assert d.scheduler.outputs["b"].num_cached_tokens >= 40
    assert d.tokens("b") == expected(follow, 10, model=copier)
    d.assert_nothing_held()


def test_stop_token_and_max_tokens_cut_accepted_tokens() -> None:
    ref = expected(prompt(3), 60, model=copier)
    stop = ref[25]
    cut = ref.index(stop) + 1
    d = driver()
    d.add("stop", prompt(3), max_tokens=60, stop_token_ids=(stop,))
    d.add("len", prompt(3), max_tokens=23)
    d.run()
    assert d.tokens("stop") == ref[:cut]
    assert d.scheduler.outputs["stop"].completions[0].finish_reason == "stop"
    assert d.tokens("len") == ref[:23]
    assert d.scheduler.outputs["len"].completions[0].finish_reason == "length"
    assert d.scheduler.stats.spec_accepted > 0
    d.assert_nothing_held()


@pytest.mark.parametrize("defer_appends", [True, False])
def test_abort_mid_verification_leaves_nothing_held(defer_appends: bool) -> None:
    d = driver(defer_appends=defer_appends)
    d.add("keep", prompt(4), max_tokens=30)
    d.add("gone", prompt(5), max_tokens=30)
    gone = d.scheduler.seq_id("gone", 0)
    aborted = False
    while d.scheduler.has_work():
        d.block_manager_step()
        seq = d.scheduler.seqs.get(gone)
        if not aborted and seq is not None and seq.proposed:
            assert d.scheduler.abort("gone")  # its proposals' slots appended, not verified yet
            assert not seq.proposed
            aborted = True
        d.worker_step()
    assert aborted
    assert d.tokens("keep") == expected(prompt(4), 30, model=copier)
    assert d.scheduler.release("gone")
    d.assert_nothing_held()


@pytest.mark.parametrize("num_cpu_blocks", [0, 32])
def test_preemption_mid_verification(num_cpu_blocks: int) -> None:
    """A pool too small for every sequence: the manager preempts sequences whose proposals this
    very Step appended (recomputed, or swapped out and back); each comes out as plain decoding
    would have it, and nothing stays held."""
    d = driver(defer_appends=False, block_size=4, num_gpu_blocks=16, num_cpu_blocks=num_cpu_blocks)
    sched = d.scheduler
    victims_with_proposals: list[str] = []
    apply = sched._apply_preemptions

    def spy(delta: StepDelta) -> set[str]:
        for p in delta.preempted:
            s = sched.seqs.get(p.seq_id)
            if s is not None and s.proposed:
                victims_with_proposals.append(p.seq_id)
        return apply(delta)

    sched._apply_preemptions = spy  # type: ignore[method-assign]
    for i in range(6):
        d.add(f"r{i}", prompt(10 + i, 10), max_tokens=36)
    d.run(max_iterations=2000)
    for i in range(6):
        assert d.tokens(f"r{i}") == expected(prompt(10 + i, 10), 36, model=copier)
    assert sched.stats.preempted_recompute + sched.stats.preempted_swap > 0
    assert victims_with_proposals, "no sequence was preempted mid-verification"
    assert sched.stats.spec_accepted > 0
    assert not sched.rollbacks
    d.assert_nothing_held()


def test_off_for_a_large_batch_and_under_a_grammar() -> None:
    d = driver(speculative=SpeculativeConfig(max_num_seqs=2))
    for i in range(3):
        d.add(f"r{i}", prompt(i), max_tokens=20)
    d.run()
    assert d.scheduler.stats.spec_passes == 0  # 3 running > max_num_seqs
    for i in range(3):
        assert d.tokens(f"r{i}") == expected(prompt(i), 20, model=copier)
