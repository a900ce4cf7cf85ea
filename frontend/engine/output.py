"""The worker step's messages: the request for a batch (:func:`worker_request`), and what its
results do to a sequence: its new token (with logprobs), the stop checks (a stop token,
max_tokens), the token event streamed to the caller, and the first tokens of the samples forked
from it (n > 1). The scheduler moves a finished sequence out of its queues."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pagedkv.frontend.engine.types import PromptLogprob, SamplingOptions, Seq, SeqStatus, TokenEvent
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import worker_pb2 as wpb


class Drawn(Protocol):
    """A worker's sampled token: wpb.SequenceOutput or wpb.Sample (read-only members, so that the
    messages' repeated fields, read-only properties, match)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top_token_ids(self) -> Sequence[int]: ...
    @property
    def top_logprobs(self) -> Sequence[float]: ...


def accept_token(s: Seq, drawn: Drawn) -> TokenEvent:
    """Append the token to the sample's completion and check the stop conditions: a finished
    sequence is FINISHED (with its finish reason); else the token now needs a slot (``Seq.needs_slot``)."""
    c = s.completion
    token, logprob = drawn.token_id, drawn.logprob
    top: tuple[tuple[int, float], ...] = ()
    if s.request.sampling.logprobs:
        top = tuple(zip(drawn.top_token_ids, drawn.top_logprobs, strict=False))
        c.top_logprobs.append(top)
    c.token_ids.append(token)
    c.logprobs.append(logprob)
    s.tokens.append(token)
    reason = None
    done_grammar = False
    if s.request.sampling.grammar is not None:
        m = _matcher(s)
        if not m.accept(token):
            raise RuntimeError(
                f"{s.seq_id}: the worker chose token {token}, which its grammar does not allow "
                "(a worker that predates SequenceInput.allowed_token_mask?)"
            )
        done_grammar = m.terminated  # a stop token ended the grammar: nothing else may follow
    if token in s.request.stop_token_ids or done_grammar:
        reason = "stop"
    elif len(c.token_ids) >= s.request.max_tokens:
        reason = "length"
    if reason is not None:
        c.finish_reason = reason
        s.status = SeqStatus.FINISHED
    return TokenEvent(s.request.request_id, s.index, token, logprob, reason, top)


def fill_prompt_logprobs(msg: wpb.SequenceInput, s: Seq, start: int, k: int) -> None:
    """vLLM's prompt_logprobs: a chunk of ``k`` tokens from ``start`` whose positions score prompt
    tokens not scored yet asks the worker to score them (position p scores the token at p + 1);
    a chunk before the prompt's last sends the token after it, which only the engine knows."""
    n = s.request.prompt_logprobs
    if n is None or s.output.prompt_scored:
        return
    prompt = s.request.prompt
    if start + 1 >= len(prompt):  # its positions score no prompt token
        return
    msg.prompt_logprobs = n
    if start + k < len(prompt):
        msg.next_prompt_token_id = prompt[start + k]


def record_prompt_logprobs(s: Seq, start: int, scores: Sequence[wpb.Sample]) -> None:
    """The prompt tokens a chunk from ``start`` scored (``fill_prompt_logprobs``): its j-th score is
    the token at ``start + 1 + j``'s. A score past the prompt (a sequence recomputed after a
    preemption scores its generated tokens too) is not the prompt's and is left out."""
    out = s.output.prompt_logprobs
    if out is None:
        return
    for j, x in enumerate(scores[: max(0, len(out) - start - 1)]):
        top = tuple(zip(x.top_token_ids, x.top_logprobs, strict=True))
        out[start + 1 + j] = PromptLogprob(x.token_id, x.logprob, x.rank, top)


def fork_firsts(parent: Seq, samples: Sequence[wpb.Sample]) -> list[tuple[Seq, wpb.Sample]]:
    """n > 1: the samples forked at admission and the first tokens the worker drew for them from
    the prompt's last position (``SequenceInput.fork_sampling``); one preempted meanwhile is left
    out (it re-prefills as a request of its own)."""
    sent, parent.forks_sent = parent.forks_sent, []
    if len(samples) != len(sent):  # else those samples would wait for a first token forever
        raise RuntimeError(
            f"the worker drew {len(samples)} first tokens for the {len(sent)} samples forked from "
            f"{parent.seq_id} (a worker that predates SequenceInput.fork_sampling?)"
        )
    out = []
    for child, drawn in zip(sent, samples, strict=True):
        if not child.awaiting_parent or child.status is not SeqStatus.RUNNING:
            continue
        child.parent = None
        child.num_computed = parent.num_computed
        out.append((child, drawn))
    return out


def fill_sampling(msg: wpb.SamplingParams, opts: SamplingOptions, seed: int | None) -> None:
    msg.temperature = opts.temperature
    msg.top_p = opts.top_p
    msg.top_k = opts.top_k
    msg.num_top_logprobs = opts.logprobs
    if seed is not None:
        msg.seed = seed
    msg.presence_penalty = opts.presence_penalty
    msg.frequency_penalty = opts.frequency_penalty
    msg.repetition_penalty = opts.repetition_penalty
    msg.min_p = opts.min_p
    if opts.logit_bias:
        msg.logit_bias_token_ids.extend(t for t, _ in opts.logit_bias)
        msg.logit_bias_values.extend(b for _, b in opts.logit_bias)


def _matcher(s: Seq) -> Any:
    if s.matcher is None:
        s.matcher = s.request.sampling.grammar.matcher()
    return s.matcher


def fill_sequence_state(msg: wpb.SequenceInput, s: Seq) -> None:
    """What the sequence's sampling needs beyond its parameters (the worker keeps no state between
    steps): its grammar's allowed tokens, and the token history of a penalized sequence."""
    opts = s.request.sampling
    if opts.grammar is not None:
        msg.allowed_token_mask = _matcher(s).mask()
    if opts.penalized:
        fill_history(msg, s)


def fill_history(msg: wpb.SequenceInput, s: Seq) -> None:
    """The token history a penalized sequence's sampling needs: its distinct generated tokens with
    their counts and, for repetition_penalty, its prompt's distinct tokens. Rebuilt every step
    from the sequence."""
    opts = s.request.sampling
    counts = collections.Counter(s.completion.token_ids)
    msg.output_token_ids.extend(counts.keys())
    msg.output_token_counts.extend(counts.values())
    if opts.repetition_penalty != 1.0:
        msg.prompt_token_ids.extend(dict.fromkeys(s.request.prompt))


def worker_request(
    batch: Sequence[tuple[Seq, int]],
    ops: pb.CacheOps | None,
    request_id: str,
    cache_instance_id: str,
    fork_draws: Callable[[Seq, int], list[Seq]],
    decode_steps: Sequence[int] | None = None,
) -> wpb.WorkerStepRequest:
    """The step of ``batch`` ((sequence, tokens to compute) pairs) on the cache named, with the cache
    ops owed; ``fork_draws`` names the samples whose first token each sequence's step draws, and
    ``decode_steps`` (policy.decode_steps) how many decode steps each one runs."""
    req = wpb.WorkerStepRequest(request_id=request_id, cache_instance_id=cache_instance_id)
    if ops is not None:
        req.ops.CopyFrom(ops)
    for j, (s, k) in enumerate(batch):
        start = s.num_computed
        item = req.sequences.add(
            seq_id=s.seq_id,
            token_ids=s.tokens[start : start + k],
            block_ids=s.blocks.step_table,
            num_cached_tokens=start,
        )
        for first, ids in s.blocks.group_tables:  # KV-cache groups 1.. (none with one group)
            item.group_tables.add(first_block_index=first, block_ids=ids)
        fill_sampling(item.sampling, s.request.step_sampling, s.seed)  # a beam's: its candidates
        fill_sequence_state(item, s)
        fill_prompt_logprobs(item, s, start, k)
        # n > 1: the worker draws the forked samples' first tokens from the prompt's last position.
        for c in fork_draws(s, k):
            fill_sampling(item.fork_sampling.add(), s.request.sampling, c.seed)
        if s.proposed and start + k == len(s.tokens):  # speculative decoding: verify the proposals
            item.num_proposed_tokens = s.proposed
        if s.draft_tokens and start + k == len(s.tokens):  # the worker's draft model proposes them
            item.num_draft_tokens = s.draft_tokens
            item.stop_token_ids.extend(s.request.stop_token_ids)
        if decode_steps is not None and decode_steps[j] > 1:
            item.decode_steps = decode_steps[j]
            item.stop_token_ids.extend(s.request.stop_token_ids)
    return req
