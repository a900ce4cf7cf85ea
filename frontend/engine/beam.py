"""Beam search's decisions, one step at a time, made as transformers' ``generate(num_beams=n)``
makes them (its ``_beam_search``), for vLLM's ``use_beam_search``. Pure: numbers in, choices out.

Every step, each of a request's live beams (best first) reports the K most likely next tokens of
its position with the model's own log-softmax (the worker's raw top logprobs), where
K = max(2, 1 + number of end tokens) * n: of the K best continuations over all beams, at most
n * (end tokens) can end a beam, so at least n go on. :meth:`BeamSearch.decide` then:

1. ranks every continuation by its cumulative logprob (the beam's plus the token's) and keeps the
   K best (transformers' top-k over beams x vocabulary);
2. a continuation among the n best that ends its beam (an end token, or the max_tokens-th token) is
   a finished hypothesis, scored ``cumulative / length ** length_penalty`` where ``length`` counts
   the tokens it generated, the end token included; the n best finished so far are kept;
3. the n best continuations that do not end are the next live beams, best first;
4. the search ends when no live beam can beat the worst of n finished hypotheses (transformers'
   heuristic: with the default ``early_stopping=False`` the best live beam's score at its current
   length; ``"never"`` with a positive length_penalty, at max_tokens), when n are finished and
   ``early_stopping=True``, or when every kept continuation ends (max_tokens).

The answer is the n best finished hypotheses, best first (``num_return_sequences=n``).

Ties keep the order the continuations come in: beams best first, each beam's tokens in the order
the worker's top-k gave them. That is transformers' order where torch.topk returns equal values by
index (beam-major over the flat beams x vocabulary); torch does not promise that, so exactly equal
cumulative logprobs (rare with real weights) may rank differently. The engine applies the choices
to sequences (frontend/engine/beam_group.py): a beam that several continuations extend forks, one
that none extends is freed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class BeamParams:
    """A beam search's scoring (the width is the request's n, as in vLLM)."""

    # Finished hypotheses are scored cumulative logprob / length ** length_penalty: > 0 favours
    # longer ones, < 0 shorter ones (vLLM's and transformers' length_penalty, default 1).
    length_penalty: float = 1.0
    # transformers' early_stopping: False (its default) stops when the heuristic says no live beam
    # can beat the finished ones; True as soon as n are finished; "never" only when none can,
    # counting a positive length_penalty at max_tokens. vLLM's API does not expose it.
    early_stopping: bool | Literal["never"] = False

    def validate(self) -> None:
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


def candidates_per_beam(width: int, num_end_tokens: int) -> int:
    """K: the continuations each beam reports and the search keeps each step (transformers'
    ``beams_to_keep``), so that n go on even when the best ones all end."""
    return max(2, 1 + num_end_tokens) * width


@dataclass(slots=True, frozen=True)
class Continuation:
    """One token after one live beam."""

    beam: int  # the beam it extends: its rank in the step's beams (0 = best)
    token: int
    logprob: float  # the token's own logprob
    score: float  # the cumulative logprob: the beam's plus the token's


@dataclass(slots=True, frozen=True)
class Hypothesis(Generic[T]):
    """A finished beam: its score and the caller's record of it (``decide``'s ``finish`` made it)."""

    score: float  # cumulative logprob / generated length ** length_penalty
    value: T


@dataclass(slots=True)
class BeamSearch(Generic[T]):
    """One request's search: what the next step is decided with, and the finished hypotheses."""

    width: int  # n: live beams, and hypotheses returned
    max_tokens: int
    end_tokens: frozenset[int]  # tokens that finish a beam (EOS and the request's stop token ids)
    params: BeamParams = field(default_factory=BeamParams)
    generated: int = 0  # tokens each live beam has generated so far
    finished: list[Hypothesis[T]] = field(default_factory=list)  # the n best, best first
    done: bool = False

    @property
    def candidates(self) -> int:
        """K, the continuations each beam reports (the worker's top logprobs)."""
        return candidates_per_beam(self.width, len(self.end_tokens))

    def decide(
        self,
        beams: Sequence[tuple[float, Sequence[tuple[int, float]]]],
        finish: Callable[[Continuation, bool], T],
    ) -> list[Continuation]:
        """One step: ``beams`` are the live beams best first, each (its cumulative logprob, its
        (token, logprob) candidates, most likely first). ``finish(c, stopped)`` records a
        continuation that finishes a hypothesis (``stopped``: by an end token, else by max_tokens),
        before any beam moves on. Returns the next live beams, best first; none once ``done``
        (``best()`` is then the answer)."""
        if self.done:
            raise RuntimeError("the beam search is over")
        n, length = self.width, self.generated + 1
        ranked = sorted(
            (
                Continuation(i, token, logprob, score + logprob)
                for i, (score, top) in enumerate(beams)
                for token, logprob in top
            ),
            key=lambda c: -c.score,
        )[: self.candidates]  # (a stable sort: ties keep beam rank, then the worker's order)
        last = length >= self.max_tokens
        ends = [last or c.token in self.end_tokens for c in ranked]
        # Only the n best may finish a hypothesis (the rest are there so that n go on). While the
        # search runs, transformers' other masks (no improvement possible, or n finished under
        # early_stopping=True) cannot apply: either would have ended it already.
        scale = length**self.params.length_penalty
        offered = [
            Hypothesis(c.score / scale, finish(c, c.token in self.end_tokens))
            for c, end in zip(ranked[:n], ends[:n], strict=False)
            if end
        ]
        if offered:  # the n best of those kept and the new ones, the kept first on a tie
            self.finished = sorted(self.finished + offered, key=lambda h: -h.score)[:n]
        going = [c for c, end in zip(ranked, ends, strict=True) if not end][:n]
        self.generated = length
        self.done = all(ends) or not going or not self._improvable(going[0].score)
        return [] if self.done else going

    def _improvable(self, best: float) -> bool:
        """transformers' _check_early_stop_heuristic and stopping condition: can the best live beam
        (cumulative logprob ``best``) still beat the worst of n finished hypotheses?"""
        if len(self.finished) < self.width:
            return True
        if self.params.early_stopping is True:
            return False  # n are finished: done
        lp = self.params.length_penalty
        length = self.max_tokens if self.params.early_stopping == "never" and lp > 0 else self.generated
        return best / length**lp > self.finished[-1].score

    def best(self) -> list[Hypothesis[T]]:
        """The finished hypotheses, best first: the search's answer once it is ``done``."""
        return list(self.finished)
