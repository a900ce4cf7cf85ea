"""A beam-search request's sequences: which live sequence is which beam, what each reported in its
last worker step, and each decision of frontend/engine/beam.py turned into moves of sequences.

A beam is a sequence (``Seq.own_completion`` holds its tokens so far). Its worker step draws no
token: it reports its position's K most likely next tokens (``GenerationRequest.step_sampling``),
and the beam then waits, computed and idle, until every live beam of its request has reported (a
beam preempted meanwhile keeps its report: its tokens and so its distribution are the same). Then
:meth:`BeamGroup.decide` ranks the continuations (beam.py) and moves the sequences:

- a beam that k of the chosen continuations extend takes the best one's token itself and is forked
  k - 1 times (``BeamMoves.forks``): each child shares every block of its parent and takes another
  token; the scheduler sends these forks ahead of the Step's appends, so the first write into
  their shared last block copies it (copy-on-write where the beams part);
- a beam that none extends is pruned (``BeamMoves.pruned``): the scheduler frees its blocks in the
  next Step, and the blocks its siblings share stay theirs;
- a continuation that finishes a hypothesis is recorded as a Completion; when the search is over
  the request's completions are the n best, best first, and every live beam is pruned.

No queues (scheduler.py applies the moves) and no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.frontend.engine.beam import BeamParams, BeamSearch, Continuation
from pagedkv.frontend.engine.types import Completion, RequestOutput, Seq

Top = Sequence[tuple[int, float]]  # a position's (token, logprob) candidates, most likely first


@dataclass(slots=True)
class BeamMoves:
    """What one decision does to the sequences (the scheduler applies it)."""

    pruned: list[Seq]  # live beams no continuation extends: freed now
    forks: list[tuple[Seq, Seq]]  # (parent, child): new beams that share their parent's blocks
    done: bool  # the search is over: the request's completions hold its answer


@dataclass(slots=True, eq=False)
class BeamGroup:
    """One beam-search request: its search (beam.py) and its live beams, best first."""

    output: RequestOutput
    search: BeamSearch[Completion]
    live: list[Seq]  # best first, the order the search ranks them in
    scores: list[float]  # each live beam's cumulative logprob
    shown: int = 0  # alternatives per token the client asked to see (SamplingOptions.logprobs)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # by seq id
    next_index: int = 1  # the next new beam's sequence index (an id is never used twice)
    # Pruned beams the scheduler may still owe a Free (it forgets them once that went through).
    pruned: list[Seq] = field(default_factory=list)

    @classmethod
    def start(cls, root: Seq) -> BeamGroup:
        """The search of ``root``'s request: one live beam, its prompt (forked at the first decision)."""
        req = root.request
        search: BeamSearch[Completion] = BeamSearch(
            req.n, req.max_tokens, frozenset(req.stop_token_ids), req.beam or BeamParams()
        )
        return cls(root.output, search, [root], [0.0], shown=req.sampling.logprobs)

    def report(self, seq: Seq, top: Top) -> bool:
        """A live beam's candidates (the top logprobs of its step); True once every live beam's
        are in, when :meth:`decide` may run."""
        if any(s is seq for s in self.live):
            self.reports[seq.seq_id] = list(top)
        return all(s.seq_id in self.reports for s in self.live)

    def decide(self, seq_id: Callable[[int], str]) -> BeamMoves:
        """One step of the search over the reports (every live beam's). New beams get
        ``seq_id(index)``; each keeps a copy of its parent's tokens and completion."""
        tops = [self.reports.pop(s.seq_id) for s in self.live]
        going = self.search.decide(
            list(zip(self.scores, tops, strict=True)),
            lambda c, stopped: self._hypothesis(c, stopped, tops[c.beam]),
        )
        if self.search.done:
            self._answer()
            pruned, self.live, self.scores = self.live, [], []
            return BeamMoves(pruned, [], done=True)
        # Every child is copied from its parent before any beam takes its token.
        taken: set[int] = set()
        beams: list[Seq] = []
        forks: list[tuple[Seq, Seq]] = []
        for c in going:
            parent = self.live[c.beam]
            if c.beam in taken:
                child = self._child(parent, self.next_index, seq_id(self.next_index))
                self.next_index += 1
                forks.append((parent, child))
                beams.append(child)
            else:
                taken.add(c.beam)
                beams.append(parent)
        for s, c in zip(beams, going, strict=True):
            self._extend(s, c, tops[c.beam])
        pruned = [s for i, s in enumerate(self.live) if i not in taken]
        self.live, self.scores = beams, [c.score for c in going]
        return BeamMoves(pruned, forks, done=False)

    def _child(self, parent: Seq, index: int, seq_id: str) -> Seq:
        """A new beam: a copy of ``parent``'s tokens (computed: it will share their blocks)."""
        c = parent.completion
        own = Completion(index, list(c.token_ids), list(c.logprobs), top_logprobs=list(c.top_logprobs))
        return Seq(
            seq_id,
            parent.request,
            parent.output,
            index,
            list(parent.tokens),
            num_computed=parent.num_computed,
            own_completion=own,
        )

    def _shown(self, top: Top) -> tuple[tuple[int, float], ...]:
        return tuple(top[: self.shown])

    def _extend(self, s: Seq, c: Continuation, top: Top) -> None:
        """The beam takes the continuation's token (the next worker step computes it)."""
        s.width = 1  # (the root counted n places at admission: the beams now hold them)
        s.tokens.append(c.token)
        own = s.completion
        own.token_ids.append(c.token)
        own.logprobs.append(c.logprob)
        if self.shown:
            own.top_logprobs.append(self._shown(top))

    def _hypothesis(self, c: Continuation, stopped: bool, top: Top) -> Completion:
        """A finished hypothesis: the beam's tokens and the continuation's, as they are now."""
        own = self.live[c.beam].completion
        return Completion(
            0,
            [*own.token_ids, c.token],
            [*own.logprobs, c.logprob],
            finish_reason="stop" if stopped else "length",
            top_logprobs=[*own.top_logprobs, self._shown(top)] if self.shown else [],
        )

    def _answer(self) -> None:
        """The request's completions: the n best hypotheses, best first, with their scores."""
        out = self.output.completions
        for i, h in enumerate(self.search.best()[: len(out)]):
            out[i] = dataclasses.replace(h.value, index=i, beam_score=h.score)
        for c in out:  # (never fewer than n with K candidates per beam: a guard, not a case)
            c.finish_reason = c.finish_reason or "length"
