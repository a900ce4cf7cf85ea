"""The worker servicer's message conversions (worker_svc/servicer.py), without a server: what a
step's sequences become, the sampling memo, and what a step's results become on the wire."""

from __future__ import annotations

import pytest
import torch

from pagedkv.v1 import worker_pb2
from pagedkv.worker_svc.model.sampling import SamplingParams, Scored, TokenHistory
from pagedkv.worker_svc.model_runner import Drawn, InvalidStep, SequenceResult
from pagedkv.worker_svc.servicer import (
    SamplingMemo,
    output_to_proto,
    sampling_from_proto,
    sequence_from_proto,
)


def _input(seed: int | None, temperature: float = 0.0, forks: int = 0) -> worker_pb2.SequenceInput:
    msg = worker_pb2.SequenceInput(seq_id="r-0", token_ids=[5, 6], block_ids=[3, 9], num_cached_tokens=32)
    msg.sampling.temperature = temperature
    msg.sampling.top_p = 0.5  # exact in fp32
    if seed is not None:
        msg.sampling.seed = seed
    for i in range(forks):
        msg.fork_sampling.add(temperature=1.0, seed=100 + i)
    return msg


def test_memo_gives_the_same_params_as_parsing_and_one_object_per_distinct_message() -> None:
    memo = SamplingMemo()
    a, b, c = _input(7), _input(7), _input(8)
    got_a = sequence_from_proto(a, memo)
    assert got_a == sequence_from_proto(a)  # the memo changes nothing in the result
    assert got_a.sampling == SamplingParams(temperature=0.0, top_p=0.5, seed=7)
    assert sequence_from_proto(b, memo).sampling is got_a.sampling  # same bytes: the same object
    got_c = sequence_from_proto(c, memo).sampling
    assert got_c.seed == 8 and got_c is not got_a.sampling
    unset = sequence_from_proto(_input(None), memo).sampling
    assert unset.seed is None and unset == sampling_from_proto(_input(None).sampling)


def test_memo_is_bounded() -> None:
    memo = SamplingMemo(limit=3)
    first = memo.get(_input(0).sampling)
    for seed in range(1, 5):
        memo.get(_input(seed).sampling)
    assert len(memo._parsed) <= 3
    again = memo.get(_input(0).sampling)
    assert again == first  # emptied and parsed again: equal, a new object


def test_fork_sampling_is_parsed_in_order_and_empty_without_forks() -> None:
    memo = SamplingMemo()
    got = sequence_from_proto(_input(1, forks=2), memo)
    assert [p.seed for p in got.fork_sampling] == [100, 101]
    assert all(p.temperature == 1.0 for p in got.fork_sampling)
    assert sequence_from_proto(_input(1), memo).fork_sampling == []
    assert got.token_ids == [5, 6] and got.block_ids == [3, 9] and got.num_cached_tokens == 32


def test_output_to_proto_sets_only_what_a_result_has() -> None:
    resp = worker_pb2.WorkerStepResponse()
    output_to_proto(resp, SequenceResult(seq_id="g", token_id=4, logprob=-0.5))
    output_to_proto(
        resp,
        SequenceResult(
            seq_id="f",
            token_id=9,
            logprob=-1.25,
            logits=torch.tensor([0.5, -2.0]),
            fork_samples=[Drawn(token_id=3, logprob=-2.0, top=[(3, -2.0), (1, -2.5)])],
            top=[(9, -1.25), (2, -3.0)],
        ),
    )
    greedy, full = resp.outputs
    assert (greedy.seq_id, greedy.token_id, greedy.logprob) == ("g", 4, -0.5)
    assert not greedy.logits and not greedy.fork_samples and not greedy.top_token_ids
    assert (full.seq_id, full.token_id, full.logprob) == ("f", 9, -1.25)
    assert list(full.logits) == [0.5, -2.0]
    assert [
        (s.token_id, s.logprob, list(s.top_token_ids), list(s.top_logprobs)) for s in full.fork_samples
    ] == [(3, -2.0, [3, 1], [-2.0, -2.5])]
    assert list(full.top_token_ids) == [9, 2] and list(full.top_logprobs) == [-1.25, -3.0]
    parsed = worker_pb2.WorkerStepResponse.FromString(resp.SerializeToString())
    assert parsed == resp


def test_penalties_min_p_logit_bias_and_history_are_parsed() -> None:
    msg = _input(3, temperature=1.0)
    msg.sampling.presence_penalty = 0.5
    msg.sampling.frequency_penalty = -0.25
    msg.sampling.repetition_penalty = 1.5
    msg.sampling.min_p = 0.125
    msg.sampling.logit_bias_token_ids.extend([7, 2])
    msg.sampling.logit_bias_values.extend([-100.0, 2.5])
    msg.output_token_ids.extend([4, 9])
    msg.output_token_counts.extend([2, 1])
    msg.prompt_token_ids.extend([5, 6])
    got = sequence_from_proto(msg, SamplingMemo())
    assert got.sampling == SamplingParams(
        temperature=1.0,
        top_p=0.5,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        min_p=0.125,
        logit_bias=((7, -100.0), (2, 2.5)),
    )
    assert got.history == TokenHistory([4, 9], [2, 1], [5, 6])
    msg.allowed_token_mask = b"\x01\x00\x00\x80"
    assert sequence_from_proto(msg).allowed_token_mask == b"\x01\x00\x00\x80"
    # Unset: no penalty (repetition_penalty 0 on the wire means off), no history.
    plain = sequence_from_proto(_input(3))
    assert plain.sampling.repetition_penalty == 1.0 and not plain.sampling.adjusts
    assert plain.history is None


def test_unpaired_bias_or_counts_are_refused() -> None:
    msg = _input(1)
    msg.sampling.logit_bias_token_ids.append(3)
    with pytest.raises(InvalidStep, match="logit_bias_values"):
        sequence_from_proto(msg)
    msg = _input(1)
    msg.output_token_ids.extend([3, 4])
    msg.output_token_counts.append(1)
    with pytest.raises(InvalidStep, match="output_token_counts"):
        sequence_from_proto(msg)


def test_multi_step_decode_fields_round_trip() -> None:
    """decode_steps and stop_token_ids reach the runner (unset: one step, no stop ids); the tokens
    of the later steps go out in next_samples, in order, with their top logprobs when they have any."""
    plain = sequence_from_proto(_input(None))
    assert (plain.decode_steps, plain.stop_token_ids) == (1, frozenset())
    msg = _input(None)
    msg.decode_steps = 4
    msg.stop_token_ids.extend([2, 7, 2])
    got = sequence_from_proto(msg)
    assert (got.decode_steps, got.stop_token_ids) == (4, frozenset({2, 7}))
    resp = worker_pb2.WorkerStepResponse()
    output_to_proto(
        resp,
        SequenceResult(
            seq_id="m",
            token_id=4,
            logprob=-0.5,
            next_samples=[Drawn(6, -1.0), Drawn(7, -0.25, top=[(7, -0.25), (1, -2.0)])],
        ),
    )
    (out,) = resp.outputs
    assert [(s.token_id, s.logprob, list(s.top_token_ids)) for s in out.next_samples] == [
        (6, -1.0, []),
        (7, -0.25, [7, 1]),
    ]
    assert list(out.next_samples[1].top_logprobs) == [-0.25, -2.0]


def test_prompt_logprobs_fields_round_trip() -> None:
    """prompt_logprobs is optional on the wire: unset asks for nothing, 0 for the scored tokens'
    own logprobs; the scores go out in order with their ranks and top tokens."""
    plain = sequence_from_proto(_input(None))
    assert (plain.prompt_logprobs, plain.next_prompt_token, plain.prompt_targets) == (None, None, [])
    msg = _input(None)
    msg.prompt_logprobs = 0
    got = sequence_from_proto(msg)
    assert (got.prompt_logprobs, got.next_prompt_token, got.prompt_targets) == (0, None, [6])
    msg.prompt_logprobs = 2
    msg.next_prompt_token_id = 0  # token 0 is a token: set, not unset
    got = sequence_from_proto(msg)
    assert (got.prompt_logprobs, got.next_prompt_token, got.prompt_targets) == (2, 0, [6, 0])
    resp = worker_pb2.WorkerStepResponse()
    output_to_proto(
        resp,
        SequenceResult(
            seq_id="p",
            token_id=1,
            logprob=-0.5,
            prompt_logprobs=[
                Scored(6, -1.5, 2, [(3, -0.25), (6, -1.5)]),
                Scored(0, -4.0, 9, [(3, -0.5), (1, -1.0)]),
            ],
        ),
    )
    out = worker_pb2.WorkerStepResponse.FromString(resp.SerializeToString()).outputs[0]
    assert [
        (x.token_id, x.logprob, x.rank, list(x.top_token_ids), list(x.top_logprobs))
        for x in out.prompt_logprobs
    ] == [(6, -1.5, 2, [3, 6], [-0.25, -1.5]), (0, -4.0, 9, [3, 1], [-0.5, -1.0])]
    output_to_proto(resp, SequenceResult(seq_id="q", token_id=1, logprob=-0.5))
    assert not resp.outputs[1].prompt_logprobs
