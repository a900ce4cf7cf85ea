"""Sampling: greedy is argmax; seeded draws depend only on (seed, position); filters hold."""

from __future__ import annotations

import pytest
import torch

from worker_svc.model.sampling import SamplingParams, argmax_rows, sample


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_model_logprob() -> None:
    logits = _logits()
    res = sample(logits, [SamplingParams()] * 4, [0, 1, 2, 3])
    assert torch.equal(res.token_ids, logits.argmax(-1))
    torch.testing.assert_close(res.logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_seeded_draw_depends_on_seed_and_position_not_on_the_batch() -> None:
    logits = _logits()
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(logits[2:3], [p], [17]).token_ids[0]
    batched = sample(
        logits,
        [SamplingParams(), SamplingParams(temperature=0.7, seed=9), p, SamplingParams()],
        [5, 6, 17, 8],
    ).token_ids[2]
    assert alone == batched
    # different positions give different draws: over 40 steps more than one token appears
    draws = {int(sample(logits[2:3], [p], [pos]).token_ids[0]) for pos in range(40)}
    assert len(draws) > 1


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = _logits(rows=1, vocab=30, seed=3)
    order = logits[0].argsort(descending=True)
    top3 = set(order[:3].tolist())
    got_k = {
        int(sample(logits, [SamplingParams(temperature=2.0, top_k=3, seed=1)], [i]).token_ids[0])
        for i in range(200)
    }
    assert got_k <= top3 and len(got_k) > 1
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = int((torch.cumsum(probs, 0) < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    allowed = set(order[:nucleus].tolist())
    got_p = {
        int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.6, seed=2)], [i]).token_ids[0])
        for i in range(200)
    }
    assert got_p <= allowed


def test_sampled_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 3000
    counts = torch.zeros(4)
    for pos in range(n):
        counts[sample(logits, [SamplingParams(temperature=1.0, seed=7)], [pos]).token_ids[0]] += 1
    torch.testing.assert_close(counts / n, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


def test_top_k_one_is_greedy() -> None:
    logits = _logits()
    res = sample(logits, [SamplingParams(temperature=5.0, top_k=1, seed=3)] * 4, [0, 1, 2, 3])
    assert torch.equal(res.token_ids, logits.argmax(-1))


def test_top_logprobs_are_the_most_likely_tokens_per_row_with_model_logprobs() -> None:
    logits = _logits(rows=3, vocab=40, seed=5)
    params = [
        SamplingParams(num_top_logprobs=3),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=2, num_top_logprobs=5),
    ]
    res = sample(logits, params, [0, 1, 2])
    ref = torch.log_softmax(logits, -1)
    assert res.top[1] == []
    for row, n in ((0, 3), (2, 5)):
        want_lp, want_ids = ref[row].topk(n)
        assert [t for t, _ in res.top[row]] == want_ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in res.top[row]]), want_lp)
    # greedy: the chosen token is the first alternative, with the same logprob
    assert res.top[0][0][0] == int(res.token_ids[0])
    assert abs(res.top[0][0][1] - float(res.logprobs[0])) < 1e-5


@pytest.mark.parametrize("vocab", [5, 511, 512, 1000, 32000, 32001])
def test_argmax_rows_equals_torch_argmax_with_ties_infinities_and_nan(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    # Few distinct values: many ties, several inside and across chunks.
    logits = torch.randint(0, 6, (rows, vocab), generator=gen).float()
    logits[1] = float("-inf")
    logits[2, -1] = 99.0  # the maximum in the ragged tail
    logits[3, 0] = float("nan")
    logits[4, vocab // 2] = float("nan")
    logits[4, vocab - 1] = float("nan")
    logits[5] = 7.0  # one tie across the whole row
    logits[6, vocab // 3] = float("inf")
    assert torch.equal(argmax_rows(logits), torch.argmax(logits, dim=-1))
    fresh = torch.randn(rows, vocab, generator=gen)
    assert torch.equal(argmax_rows(fresh), torch.argmax(fresh, dim=-1))
    assert argmax_rows(torch.empty(0, vocab)).shape == (0,)
