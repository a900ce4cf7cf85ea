"""Beam search through the scheduler and the block manager's real core, without servers
(tests/frontend/engine/harness.py): the stand-in worker reads every beam's context back through its
block table, so a beam that shared a block it should not have, or lost a copy-on-write, reports
other candidates. The answer must be the reference search's (beam.py run on the dense contexts),
the beams must be forks sharing their blocks, and nothing may be held afterwards, whatever was
pruned, preempted, refused or aborted on the way."""

from __future__ import annotations

import pytest

from pagedkv.block_manager_svc.core import ResourceExhausted
from pagedkv.frontend.engine.beam import BeamParams, BeamSearch
from pagedkv.kv_capacity import blocks_for_tokens
from tests.frontend.engine.harness import Driver, candidates, expected

Hypotheses = list[tuple[list[int], float]]


def reference(
    prompt: list[int], n: int, max_tokens: int, ends: tuple[int, ...], params: BeamParams
) -> Hypotheses:
    """beam.py on the stand-in model's dense contexts: no blocks, no engine."""
    search: BeamSearch[tuple[int, ...]] = BeamSearch(n, max_tokens, frozenset(ends), params)
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    while True:
        reports = [(score, candidates(prompt + list(t), search.candidates)) for t, score in live]
        going = search.decide(reports, lambda c, _, beams=live: (*beams[c.beam][0], c.token))
        if search.done:
            return [(list(h.value), h.score) for h in search.best()]
        live = [((*live[c.beam][0], c.token), c.score) for c in going]


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 7 + length + salt) % 90 + 1 for i in range(length)]


PLAIN = BeamParams()


def check_answer(
    d: Driver,
    rid: str,
    prompt: list[int],
    n: int,
    max_tokens: int,
    ends: tuple[int, ...] = (),
    params: BeamParams = PLAIN,
) -> None:
    out = d.scheduler.outputs[rid]
    want = reference(prompt, n, max_tokens, ends, params)
    assert [c.token_ids for c in out.completions] == [t for t, _ in want]
    # (the worker's logprobs cross the wire as float32)
    assert [c.beam_score for c in out.completions] == pytest.approx([s for _, s in want], rel=1e-5)
    for c in out.completions:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in ends else "length")
        assert len(c.logprobs) == len(c.token_ids)


def forks_and_frees(d: Driver) -> tuple[int, int]:
    return sum(len(p.early_forks) for p in d.bm.steps), sum(len(p.frees) for p in d.bm.steps)


@pytest.mark.parametrize(
    ("n", "ends", "length_penalty"),
    [(2, (), 1.0), (3, (5,), -1.0), (4, (5, 9), 0.5), (4, (), 2.0)],
)
@pytest.mark.parametrize("prompt_len", [3, 8, 13])
def test_the_beams_are_the_reference_search_forked_and_freed(
    n: int, ends: tuple[int, ...], length_penalty: float, prompt_len: int
) -> None:
    prompt = prompt_of(prompt_len)
    d = Driver.make(num_gpu_blocks=64, block_size=4)
    d.add("b", prompt, max_tokens=10, n=n, stop_token_ids=ends, beam=BeamParams(length_penalty))
    d.run()
    check_answer(d, "b", prompt, n, 10, ends, BeamParams(length_penalty))
    forks, frees = forks_and_frees(d)
    assert forks >= n - 1 and frees > 0, "beams fork where they part and are freed when pruned"
    assert d.bm.core.stats().num_cow_copies > 0, "forks copy their shared last block on write"
    assert not any(p.forks for p in d.bm.steps), "no sample is forked at admission"
    d.assert_nothing_held()


def peak_blocks(d: Driver) -> int:
    peak = 0
    for _ in range(500):
        if not d.scheduler.has_work():
            return peak
        d.iterate()
        peak = max(peak, d.bm.blocks_in_use())
    raise AssertionError("still running")


@pytest.mark.parametrize("n", [2, 4])
def test_forked_beams_hold_fewer_blocks_than_n_independent_sequences(n: int) -> None:
    """The prompt's blocks once, the beams' common prefix once: the peak stays below what n
    independent sequences of the same lengths hold (no prefix caching on either side, so only
    forks share)."""
    prompt, max_tokens = prompt_of(22), 10
    beams = Driver.make(num_gpu_blocks=64, block_size=4, prefix_caching=False)
    beams.add("b", prompt, max_tokens=max_tokens, n=n, beam=BeamParams())
    beam_peak = peak_blocks(beams)
    check_answer(beams, "b", prompt, n, max_tokens)
    apart = Driver.make(num_gpu_blocks=64, block_size=4, prefix_caching=False)
    for i in range(n):
        apart.add(f"s{i}", prompt, max_tokens=max_tokens)
    apart_peak = peak_blocks(apart)
    assert apart_peak == n * blocks_for_tokens(len(prompt) + max_tokens - 1, 4)
    # The prompt's 6 blocks once, then at most the n beams' last 3 blocks each.
    assert beam_peak <= blocks_for_tokens(len(prompt), 4) + n * 3 < apart_peak
    beams.assert_nothing_held()
    apart.assert_nothing_held()


def contended(mode: str, num_cpu_blocks: int = 0) -> Driver:
    """Two beam searches and two plain requests in a pool too small for all: preemptions."""
    d = Driver.make(num_gpu_blocks=16, max_num_seqs=8, preemption_mode=mode, num_cpu_blocks=num_cpu_blocks)
    d.add("b0", prompt_of(9, 1), max_tokens=12, n=3, stop_token_ids=(5,), beam=BeamParams())
    d.add("s0", prompt_of(7, 2), max_tokens=14)
    d.add("b1", prompt_of(6, 3), max_tokens=12, n=2, beam=BeamParams(0.5))
    d.add("s1", prompt_of(5, 4), max_tokens=14)
    return d


@pytest.mark.parametrize(("mode", "cpu"), [("recompute", 0), ("swap", 64)])
def test_preempted_beams_come_back_and_the_answer_stands(mode: str, cpu: int) -> None:
    d = contended(mode, cpu)
    d.run()
    stats = d.scheduler.stats
    assert stats.preempted_recompute + stats.preempted_swap > 0, "the pool was meant to be too small"
    check_answer(d, "b0", prompt_of(9, 1), 3, 12, (5,))
    check_answer(d, "b1", prompt_of(6, 3), 2, 12, (), BeamParams(0.5))
    d.assert_nothing_held()


@pytest.mark.parametrize("iterations", [1, 2, 3, 5, 8])
def test_an_aborted_search_frees_every_block(iterations: int) -> None:
    """Aborted after its prefill, right after a decision that forked (the forks not sent yet), or
    mid-search: every beam, pruned or live, is freed, and the request beside it is unharmed."""
    d = Driver.make(num_gpu_blocks=64, block_size=4)
    d.add("b", prompt_of(9), max_tokens=12, n=4, stop_token_ids=(5,), beam=BeamParams())
    d.add("s", prompt_of(6, 1), max_tokens=12)
    for _ in range(iterations):
        d.iterate()
    sent = len(d.bm.steps)
    assert d.scheduler.abort("b")
    d.run()
    out = d.scheduler.outputs["b"]
    assert out.finished and {c.finish_reason for c in out.completions} == {"abort"}
    assert not d.scheduler.beams and not d.scheduler.beam_forks
    assert not any(p.early_forks for p in d.bm.steps[sent:]), "a new beam of an aborted search is not forked"
    d.assert_nothing_held()
    assert d.tokens("s") == expected(prompt_of(6, 1), 12)
    assert d.scheduler.release("b") and d.scheduler.release("s") and not d.scheduler.seqs


def test_a_refused_beam_fork_is_computed_anew() -> None:
    """The manager refuses a fork (a tenant's sequence quota would): the new beam is allocated
    from its tokens instead and computed, and the answer is the same."""
    d = Driver.make(num_gpu_blocks=64, block_size=4)
    prompt = prompt_of(10)
    core = d.bm.core
    real_fork, refused = core.fork, []

    def fork(parent: str, child: str) -> list[int]:
        if not refused:
            refused.append(child)
            raise ResourceExhausted("no sequence left in the quota")
        return real_fork(parent, child)

    core.fork = fork  # type: ignore[method-assign]
    d.add("b", prompt, max_tokens=8, n=3, beam=BeamParams())
    d.run()
    assert refused, "a fork was meant to be refused"
    assert any(p.allocs and p.allocs[0][0] == refused[0] for p in d.bm.steps), "allocated from its tokens"
    check_answer(d, "b", prompt, 3, 8)
    d.assert_nothing_held()


def test_a_new_beam_whose_parent_left_the_gpu_before_its_fork_is_computed_anew() -> None:
    """The manager lost the engine's sequences between a decision and the Step that forks (a
    resync requeues every sequence): the new beams wait to be allocated like the others."""
    d = Driver.make(num_gpu_blocks=64, block_size=4)
    prompt = prompt_of(7)
    d.add("b", prompt, max_tokens=8, n=4, beam=BeamParams())
    while not d.scheduler.beam_forks:
        d.iterate()
    victims, ids = d.scheduler.take_block_holders()
    for seq_id in ids:
        d.bm.core.free(seq_id)
    d.scheduler.requeue_all(victims)
    d.run()
    check_answer(d, "b", prompt, 4, 8)
    d.assert_nothing_held()


def test_a_long_search_keeps_only_its_live_beams() -> None:
    d = Driver.make(num_gpu_blocks=128, block_size=4)
    d.add("b", prompt_of(5), max_tokens=40, n=4, beam=BeamParams())
    most = 0
    while d.scheduler.has_work():
        d.iterate()
        most = max(most, len(d.scheduler.seqs))
    forks, _ = forks_and_frees(d)
    assert forks > 3 * 4 and most <= 2 * 4, "pruned beams are forgotten once freed"
    check_answer(d, "b", prompt_of(5), 4, 40)
    d.assert_nothing_held()
