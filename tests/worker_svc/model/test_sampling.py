"""Sampling: greedy is argmax; seeded draws depend only on (seed, position); filters hold."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedkv.worker_svc.model.sampling import (
    SamplingParams,
    TokenHistory,
    adjust_logits,
    allowed_tokens,
    argmax_rows,
    draw_uniform,
    sample,
    sampling_knob_error,
)


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


# --- logit bias, penalties, min-p: each against a reference computed from the same logits ----------
def _reference_logits(row: list[float], p: SamplingParams, h: TokenHistory) -> list[float]:
    """The adjustments written out token by token, in vLLM's order: bias, repetition, frequency and
    presence."""
    out = list(row)
    for t, b in p.logit_bias:
        out[t] += b
    counts = dict(zip(h.output_ids, h.output_counts, strict=True))
    seen = set(counts) | set(h.prompt_ids)
    for t in range(len(out)):
        if t in seen and p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        if t in counts:
            out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty
    return out


def _reference_probs(adjusted: list[float], p: SamplingParams) -> list[float]:
    """Temperature, then min-p against the most likely token, renormalised."""
    scaled = [x / p.temperature for x in adjusted]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    kept = [w if w >= p.min_p * 1.0 else 0.0 for w in weights]  # w = p / p_max
    total = sum(kept)
    return [w / total for w in kept]


def _reference_draw(probs: list[float], u: float) -> int:
    """Inverse CDF over the tokens sorted by probability (stable), as the sampler draws."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    acc = 0.0
    for t in order:
        acc += probs[t]
        if probs[t] > 0 and acc > u:
            return t
    return next(t for t in reversed(order) if probs[t] > 0)


_HISTORY = TokenHistory(output_ids=(0, 3, 5), output_counts=(4, 1, 2), prompt_ids=(1, 3, 7))
_KNOBS = {
    "presence_penalty": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "negative_presence_penalty": SamplingParams(temperature=1.0, presence_penalty=-1.0),
    "frequency_penalty": SamplingParams(temperature=1.0, frequency_penalty=0.7),
    "repetition_penalty": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias=((2, 3.0), (5, -100.0), (6, 1.5))),
    "all_together": SamplingParams(
        temperature=0.8,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        min_p=0.05,
        logit_bias=((4, 2.0),),
    ),
}


@pytest.mark.parametrize("knob", list(_KNOBS))
def test_adjusted_logits_equal_the_token_by_token_reference(knob: str) -> None:
    logits = _logits(rows=2, vocab=12, seed=11)
    p = dataclasses.replace(_KNOBS[knob], seed=5)
    got = adjust_logits(logits, [p, p], [_HISTORY, TokenHistory()])
    torch.testing.assert_close(got[0], torch.tensor(_reference_logits(logits[0].tolist(), p, _HISTORY)))
    torch.testing.assert_close(got[1], torch.tensor(_reference_logits(logits[1].tolist(), p, TokenHistory())))
    assert not torch.equal(logits, got) or knob == "min_p"  # min-p is no logit adjustment


@pytest.mark.parametrize("knob", list(_KNOBS))
def test_each_knob_draws_the_reference_token_and_follows_its_distribution(knob: str) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -2.0]])
    p = dataclasses.replace(_KNOBS[knob], seed=21)
    probs = _reference_probs(_reference_logits(logits[0].tolist(), p, _HISTORY), p)
    n = 2000
    # One batch of n rows, one per position: each row its own seeded draw.
    tokens = sample(logits.expand(n, 8), [p] * n, list(range(n)), [_HISTORY] * n).token_ids.tolist()
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    for pos in range(300):  # the exact token for the same uniform, drawn from the reference distribution
        assert tokens[pos] == _reference_draw(probs, draw_uniform(p.seed, pos)), pos
    torch.testing.assert_close(counts / n, torch.tensor(probs), atol=0.035, rtol=0)
    assert all(counts[t] == 0 for t in range(8) if probs[t] == 0.0)  # min-p / -100 bias: never drawn
    # The knob changed the distribution (else this test could not fail).
    plain = _reference_probs(logits[0].tolist(), SamplingParams(temperature=p.temperature))
    assert max(abs(a - b) for a, b in zip(probs, plain, strict=True)) > 0.05


@pytest.mark.parametrize("knob", [k for k in _KNOBS if k != "min_p"])
def test_greedy_picks_the_argmax_of_the_adjusted_logits_and_reports_the_model_logprob(knob: str) -> None:
    logits = _logits(rows=3, vocab=12, seed=13)
    p = dataclasses.replace(_KNOBS[knob], temperature=0.0)
    res = sample(logits, [SamplingParams(), p, p], [0, 1, 2], [None, _HISTORY, TokenHistory()])
    for row, h in ((1, _HISTORY), (2, TokenHistory())):
        ref = _reference_logits(logits[row].tolist(), p, h)
        assert int(res.token_ids[row]) == max(range(12), key=lambda t: ref[t])
    assert int(res.token_ids[0]) == int(logits[0].argmax())
    model_lp = torch.log_softmax(logits, -1).gather(1, res.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs, model_lp)


def test_penalties_without_a_history_change_nothing_and_a_bias_can_force_a_token() -> None:
    logits = _logits(rows=1, vocab=30, seed=4)
    p = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0)
    assert int(sample(logits, [p], [0]).token_ids[0]) == int(logits.argmax())
    forced = SamplingParams(temperature=1.5, seed=3, logit_bias=((17, 100.0),))
    assert {int(sample(logits, [forced], [i]).token_ids[0]) for i in range(50)} == {17}


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(logit_bias=((3, 1.0), (3, 2.0))), "repeats"),
        (SamplingParams(logit_bias=((50, 1.0),)), "vocab_size"),
        (SamplingParams(logit_bias=((3, 101.0),)), "value"),
    ],
)
def test_out_of_range_knobs_are_named(params: SamplingParams, why: str) -> None:
    err = sampling_knob_error(params, vocab_size=50)
    assert err is not None and why in err
    assert sampling_knob_error(_KNOBS["all_together"], vocab_size=50) is None


def _mask(allowed: set[int], vocab: int) -> bytes:
    """The step message's bitmask, built as the frontend builds it: int32 words, bit t % 32 of
    word t // 32 (xgrammar's layout), little-endian bytes."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return (
        torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
        .numpy()
        .tobytes()
    )


def test_allowed_tokens_unpacks_the_bitmask_layout() -> None:
    allowed = {0, 5, 31, 32, 63, 64, 99}
    other = {1, 40, 98}
    got = allowed_tokens([_mask(allowed, 100), _mask(other, 100)], 100, torch.device("cpu"))
    assert got.shape == (2, 100)
    assert (
        set(got[0].nonzero().flatten().tolist()) == allowed
        and set(got[1].nonzero().flatten().tolist()) == other
    )


def test_grammar_mask_restricts_greedy_and_sampled_tokens_to_the_allowed_ones() -> None:
    """Greedy: the most likely allowed token; sampled: the model's distribution renormalised over
    the allowed tokens (exact draws for the same uniforms, and frequencies), with penalties too."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -2.0]])
    allowed = {1, 3, 4, 6}
    mask = _mask(allowed, 8)
    greedy = sample(logits.expand(3, 8), [SamplingParams()] * 3, [0, 1, 2], None, [mask, None, mask])
    assert greedy.token_ids.tolist() == [1, 0, 1]
    torch.testing.assert_close(greedy.logprobs[0], torch.log_softmax(logits[0], -1)[1])  # the model's
    for p in (SamplingParams(temperature=1.0, seed=4), dataclasses.replace(_KNOBS["all_together"], seed=4)):
        masked = [
            x if t in allowed else float("-inf")
            for t, x in enumerate(_reference_logits(logits[0].tolist(), p, _HISTORY))
        ]
        probs = _reference_probs(masked, p)
        n = 2000
        tokens = sample(
            logits.expand(n, 8), [p] * n, list(range(n)), [_HISTORY] * n, [mask] * n
        ).token_ids.tolist()
        assert set(tokens) <= allowed
        for pos in range(300):
            assert tokens[pos] == _reference_draw(probs, draw_uniform(p.seed, pos)), pos
        counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
        torch.testing.assert_close(counts / n, torch.tensor(probs), atol=0.035, rtol=0)
