"""Speculative decoding's proposer and its on/off rule, as pure functions (docs/speculative.md).

The n-gram prompt lookup proposer (vLLM's ``method: ngram``, llama.cpp's lookup decoding):
the last n tokens of a sequence (prompt and generated) are looked up earlier in the same
sequence, and the tokens that followed that occurrence are proposed as the next ones. Copy-heavy
work (editing code, quoting a document, extracting fields) repeats long runs of its context, so
the target then accepts several tokens per verification pass; open-ended text rarely matches and
gets no proposal, so it decodes as before.

The draft-model proposer (vLLM's ``method: draft_model``, llama.cpp's ``--model-draft``) runs
on the workers (worker_svc/model_runner.py): the engine only asks a sequence's pass for up to k
draft tokens (``draft_tokens_for``), and the worker proposes and verifies them in one step.

The settings keep vLLM's ``speculative_config`` names where they exist: ``method``,
``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``.

Pure: no gRPC, no clock, nothing it is given is changed; tests/frontend/engine/test_speculate.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.defaults import MAX_DECODE_STEPS

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = MAX_DECODE_STEPS  # the worker's bound on num_proposed_tokens


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """How to speculate: `method` ("ngram", or "draft_model": the workers' draft model, their
    --speculative-model, proposes), `num_speculative_tokens` (k, the most tokens
    proposed per verification pass; each sequence's own bound moves below it with what its
    passes accept, `next_proposal_bound`), the n-gram sizes tried from `prompt_lookup_max` down
    to `prompt_lookup_min`, and `max_num_seqs`: speculate only while at most this many sequences
    run (a larger batch makes plain decode compute-bound, where verifying rejected proposals
    costs more than the weight reads it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_num_seqs: int = 2  # measured: bench.speculative --in-flight (docs/benchmarks.md)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens of a sequence whose tokens so far are `tokens`, or [] when
    its last n tokens (n from `max_n` down to `min_n`, longest first: a longer match predicts
    better) occur nowhere earlier with a token after them. Of several earlier occurrences the
    most recent wins (the nearest context is the likeliest to be repeated).
    O(len(tokens) * max_n) per call."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n :])
        first = suffix[0]
        for i in range(total - n - 1, -1, -1):  # start of an earlier occurrence, latest first
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : i + n + k])
    return []


def cut_at_rejected(proposal: Sequence[int], allowed: Callable[[int, int], bool]) -> list[int]:
    """The proposal up to its first token that `allowed(j, token)` refuses (a grammar that would
    not let token j follow the ones before it): a token the grammar rejects ends the proposal,
    since the target could never draw it there."""
    for j, t in enumerate(proposal):
        if not allowed(j, t):
            return list(proposal[:j])
    return list(proposal)


class _Worker(Protocol):
    target: str


class _WorkerInfo(Protocol):
    draft_model_name: str


def check_drafts(
    config: SpeculativeConfig | None, workers: Iterable[tuple[_Worker, _WorkerInfo | None]]
) -> None:
    """An engine speculating with a draft model needs one on every worker (each worker with what
    it told of itself, None: it did not answer yet): a worker without one refuses such a step."""
    if config is None or config.method != "draft_model":
        return
    without = [w.target for w, info in workers if info is not None and not info.draft_model_name]
    if without:
        raise ValueError(
            f"speculative decoding with a draft model, but worker(s) {', '.join(without)} have none: "
            "start them with --speculative-model (pagedkv up --speculative-model does)"
        )


def speculation_on(config: SpeculativeConfig | None, num_running: int) -> bool:
    """Whether this iteration speculates: configured, and few enough sequences run that plain
    decode is bound by reading the weights."""
    return config is not None and 0 < num_running <= config.max_num_seqs


def next_proposal_bound(bound: int | None, proposed: int, accepted: int, most: int) -> int:
    """A sequence's bound on its next proposal after a pass that verified `proposed` tokens
    under `bound` (None: `most`, a sequence's first pass) and kept `accepted`: twice the bound
    (at most `most`) when every one was kept, else one more than were kept.

    Why: a verified position costs its row's arithmetic whether it is kept or not. Inside a
    run the sequence copies (a long kept proposal), the next one is likely kept too, and a
    longer pass spreads its fixed cost over more tokens; right after a rejection the copy has
    likely ended or changed, and a long proposal would mostly be paid for and thrown away."""
    if accepted >= proposed:
        return min(most, 2 * (most if bound is None else bound))
    return max(1, min(most, accepted + 1))


def draft_tokens_for(config: SpeculativeConfig, room: int, bound: int | None = None) -> int:
    """How many tokens a sequence's pass asks the workers' draft model to propose: at most `room`
    (what max_tokens and its held blocks leave after the token the pass draws itself) and at most
    `bound` (`next_proposal_bound`; None: `num_speculative_tokens`); 0: a plain decode step."""
    return max(0, min(bound or config.num_speculative_tokens, config.num_speculative_tokens, room))


def proposal_for(
    config: SpeculativeConfig, tokens: Sequence[int], room: int, bound: int | None = None
) -> list[int]:
    """A sequence's proposal for one verification pass: at most `room` tokens (what max_tokens
    and the context length leave after the token the pass draws itself) and at most `bound`
    (the sequence's own, `next_proposal_bound`; None: `num_speculative_tokens`)."""
    k = min(bound or config.num_speculative_tokens, config.num_speculative_tokens, room)
    if k < 1:
        return []
    return propose_ngram(tokens, k, config.prompt_lookup_min, config.prompt_lookup_max)


@dataclass(slots=True)
class SpeculationStats:
    """Acceptance counters for /metrics and the engine stats: proposed and accepted tokens, and
    verification passes with the tokens they produced (accepted + the target's own)."""

    num_passes: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_passes += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_emitted += accepted + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.num_emitted / self.num_passes if self.num_passes else 0.0
