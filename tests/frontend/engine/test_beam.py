"""The beam-search decision (frontend/engine/beam.py) without any server: a step worked by hand,
then whole searches driven by a tiny random Llama's log-softmax against transformers'
``generate(num_beams=n)`` on the same weights: the same n hypotheses, in the same order, with the
same scores, over widths, end-token sets, length penalties and early_stopping's three values."""

from __future__ import annotations

import pytest
import torch

from pagedkv.frontend.engine.beam import BeamParams, BeamSearch, Continuation, candidates_per_beam
from tests.worker_svc.conftest import hf_beam_search, make_hf_config

Tokens = tuple[int, ...]


def test_one_step_worked_by_hand() -> None:
    """Width 2, end token 9 (K = 4). Beam A (-1.0) and B (-1.5) report:
    A: 9 -0.1 (-1.1), 4 -0.5 (-1.5), 5 -2.0; B: 6 -0.2 (-1.7), 9 -0.3 (-1.8), 7 -0.4 (-1.9).
    The 4 best: A9 -1.1, A4 -1.5, B6 -1.7, B9 -1.8. A9 is among the 2 best and ends: finished
    with -1.1 / 3 (its third token, length_penalty 1); B9 ends but is not among the 2 best, so
    it is dropped. The next beams: A4, then B6."""
    search: BeamSearch[Tokens] = BeamSearch(2, max_tokens=10, end_tokens=frozenset({9}), generated=2)
    assert search.candidates == candidates_per_beam(2, 1) == 4
    history = {0: (1, 2), 1: (1, 3)}

    def finish(c: Continuation, stopped: bool) -> Tokens:
        assert stopped
        return (*history[c.beam], c.token)

    going = search.decide(
        [(-1.0, [(9, -0.1), (4, -0.5), (5, -2.0)]), (-1.5, [(6, -0.2), (9, -0.3), (7, -0.4)])], finish
    )
    assert [(c.beam, c.token) for c in going] == [(0, 4), (1, 6)]
    assert [c.score for c in going] == pytest.approx([-1.5, -1.7])
    assert [h.value for h in search.finished] == [(1, 2, 9)]
    assert search.finished[0].score == pytest.approx(-1.1 / 3)
    assert not search.done and search.generated == 3
    # One finished of two: the search goes on although no live beam can beat it.
    going = search.decide([(-1.5, [(9, -3.0), (4, -3.0)]), (-1.7, [(5, -3.0), (6, -3.1)])], finish)
    assert search.done and not going  # (-4.5 / 4 for the second finished; -4.7 / 4 cannot beat it)
    assert [h.value for h in search.best()] == [(1, 2, 9), (1, 2, 9)]  # history is the test's
    with pytest.raises(RuntimeError):
        search.decide([], finish)


def test_max_tokens_finishes_the_n_best_continuations() -> None:
    search: BeamSearch[Tokens] = BeamSearch(2, max_tokens=1, end_tokens=frozenset(), params=BeamParams(2.0))
    reasons: list[bool] = []

    def finish(c: Continuation, stopped: bool) -> Tokens:
        reasons.append(stopped)
        return (c.token,)

    assert search.decide([(0.0, [(3, -0.5), (4, -0.7), (5, -0.9), (6, -1.0)])], finish) == []
    assert search.done and reasons == [False, False]  # by length, not by an end token
    assert [(h.value, h.score) for h in search.best()] == [((3,), -0.5), ((4,), -0.7)]


def test_params_are_checked() -> None:
    BeamParams(-1.5, "never").validate()
    with pytest.raises(ValueError, match="length_penalty"):
        BeamParams(float("nan")).validate()
    with pytest.raises(ValueError, match="early_stopping"):
        BeamParams(1.0, "always").validate()  # type: ignore[arg-type]


# --- against transformers ------------------------------------------------------------------------
VOCAB = 24  # small, so that end tokens are among the best continuations often


@pytest.fixture(scope="module")
def model():  # -> transformers.LlamaForCausalLM
    from transformers import LlamaForCausalLM

    torch.manual_seed(11)
    return LlamaForCausalLM(make_hf_config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)).eval()


def our_beams(
    model: object, prompt: list[int], n: int, max_tokens: int, ends: list[int], params: BeamParams
) -> list[tuple[Tokens, float]]:
    """beam.py driven by the same model's log-softmax, each beam computed in full (no cache)."""
    search: BeamSearch[Tokens] = BeamSearch(n, max_tokens, frozenset(ends), params)
    live: list[tuple[Tokens, float]] = [((), 0.0)]
    while True:
        reports = []
        for tokens, score in live:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(tokens)])).logits[0, -1].float()  # type: ignore[operator]
            top = torch.log_softmax(logits, -1).topk(search.candidates)
            reports.append((score, list(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
        going = search.decide(reports, lambda c, _, beams=live: (*beams[c.beam][0], c.token))
        if search.done:
            return [(h.value, h.score) for h in search.best()]
        live = [((*live[c.beam][0], c.token), c.score) for c in going]


# (transformers' num_beams=1 is greedy search, not a beam search of width 1: not compared)
CASES = [
    # (n, end tokens, length_penalty, early_stopping, max_tokens)
    (2, [], 1.0, False, 7),
    (2, [10], 1.0, False, 9),
    (2, [10, 1], 0.5, False, 8),
    (3, [1], 2.0, False, 8),
    (4, [10], 1.0, False, 9),
    (4, [10], -1.0, False, 8),
    (4, [1, 10], 0.0, False, 7),
    (3, [10], 1.0, True, 9),
    (4, [1, 10], 1.0, True, 8),
    (2, [10], 2.0, "never", 9),
    (4, [1, 10], 1.0, "never", 7),
]


@pytest.mark.parametrize(("n", "ends", "length_penalty", "early_stopping", "max_tokens"), CASES)
def test_the_hypotheses_are_transformers(
    model: object,
    n: int,
    ends: list[int],
    length_penalty: float,
    early_stopping: bool | str,
    max_tokens: int,
) -> None:
    params = BeamParams(length_penalty, early_stopping)  # type: ignore[arg-type]
    stopped_early = 0
    for prompt in ([3, 5, 7, 9], [2, 14], [8, 8, 19, 4, 22, 6]):
        want = [
            (tuple(t), score)
            for t, score in hf_beam_search(model, prompt, n, max_tokens, ends, length_penalty, early_stopping)
        ]
        got = our_beams(model, prompt, n, max_tokens, ends, params)
        assert [t for t, _ in got] == [t for t, _ in want], prompt
        # (transformers sums in fp32: a score is as close as its magnitude allows)
        assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6, abs=1e-5), prompt
        stopped_early += any(len(t) < max_tokens for t, _ in want)
    if ends and length_penalty <= 1.0:  # (a larger one favours the hypotheses that run on)
        assert stopped_early, "no hypothesis ended on an end token: the case tests nothing of it"
