"""The n-gram prompt lookup proposer and speculation's on/off rule (frontend/engine/speculate.py)."""

from __future__ import annotations

import pytest

from pagedkv.frontend.engine.speculate import (
    SpeculationStats,
    SpeculativeConfig,
    cut_at_rejected,
    next_proposal_bound,
    proposal_for,
    propose_ngram,
    speculation_on,
)


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]
    assert propose_ngram(tokens, 10, 2, 3) == [4, 5, 6, 9, 2, 3]  # up to the end of the sequence


def test_the_longest_n_gram_wins_then_the_most_recent_occurrence() -> None:
    # "3" alone last occurred before 8; "2 3" before 4: the bigram's match is used.
    tokens = [2, 3, 4, 0, 3, 8, 2, 3]
    assert propose_ngram(tokens, 1, 1, 2) == [4]
    assert propose_ngram(tokens, 1, 1, 1) == [8]  # unigram only: the latest "3" is followed by 8


def test_no_match_no_proposal() -> None:
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([5], 4, 1, 3) == []
    assert propose_ngram([7, 7], 4, 2, 3) == []  # a bigram needs an earlier bigram
    assert propose_ngram([7, 7], 4, 1, 3) == [7]


def test_grammar_rejection_ends_the_proposal() -> None:
    assert cut_at_rejected([5, 6, 7, 8], lambda j, t: t != 7) == [5, 6]
    assert cut_at_rejected([5, 6], lambda j, t: True) == [5, 6]
    assert cut_at_rejected([5, 6], lambda j, t: False) == []


def test_room_and_batch_size_bound_speculation() -> None:
    cfg = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, max_num_seqs=2
    )
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert proposal_for(cfg, tokens, 10) == [3, 4, 5]
    assert proposal_for(cfg, tokens, 2) == [3, 4]  # max_tokens leaves room for 2 more
    assert proposal_for(cfg, tokens, 0) == []
    assert speculation_on(cfg, 1) and speculation_on(cfg, 2)
    assert not speculation_on(cfg, 3) and not speculation_on(cfg, 0) and not speculation_on(None, 1)


def test_a_sequences_bound_doubles_while_all_are_kept_and_falls_after_a_rejection() -> None:
    assert next_proposal_bound(2, 2, 2, 8) == 4
    assert next_proposal_bound(4, 3, 3, 8) == 8  # a short proposal all kept: the bound still grows
    assert next_proposal_bound(8, 8, 8, 8) == 8  # never past num_speculative_tokens
    assert next_proposal_bound(8, 8, 3, 8) == 4  # one more than were kept
    assert next_proposal_bound(8, 8, 0, 8) == 1
    assert next_proposal_bound(8, 5, 7, 4) == 4  # a lowered limit caps even a shrunk bound
    assert next_proposal_bound(None, 3, 3, 8) == 8  # the first pass's bound is the setting
    assert next_proposal_bound(None, 8, 2, 8) == 3
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert proposal_for(cfg, tokens, 10, bound=1) == [3]
    assert proposal_for(cfg, tokens, 10, bound=6) == [3, 4, 5]  # the setting bounds the bound
    assert proposal_for(cfg, tokens, 10, bound=None) == [3, 4, 5]


def test_config_uses_vllm_names_and_checks_them() -> None:
    cfg = SpeculativeConfig(
        method="ngram", num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 3, 1)
    for bad in (
        {"method": "eagle"},
        {"num_speculative_tokens": 0},
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"prompt_lookup_min": 0},
        {"max_num_seqs": 0},
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)  # type: ignore[arg-type]


def test_stats_count_acceptance_and_tokens_per_pass() -> None:
    s = SpeculationStats()
    assert s.acceptance_rate == 0.0 and s.tokens_per_pass == 0.0
    s.record(4, 3)
    s.record(4, 0)
    assert s.acceptance_rate == pytest.approx(3 / 8)
    assert s.tokens_per_pass == pytest.approx((4 + 1) / 2)
