"""A batch where only some rows carry an allowed-token mask: each mask constrains its own row and
no other. Here a penalized row sits beside a masked one (a response_format request) and a plain
one: the masked row draws only what its mask allows, and the other two draw exactly what they draw
in a batch without the masked row."""

from __future__ import annotations

import torch

from pagedkv.worker_svc.model.sampling import SamplingParams, TokenHistory, sample

VOCAB = 64


def _mask(allowed: set[int]) -> bytes:
    words = [0] * (VOCAB // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_a_mask_lands_on_its_row_and_leaves_the_others_untouched() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=g)
    top = [int(t) for t in logits.argmax(-1)]
    penalized = SamplingParams(presence_penalty=2.0, frequency_penalty=1.0)
    history = TokenHistory(output_ids=[top[0]], output_counts=[3])
    allowed = {int(logits[1].argsort()[3]), int(logits[1].argsort()[7])}  # not its favourite
    plain = SamplingParams()
    sampled = SamplingParams(temperature=0.8, seed=11)

    mixed = sample(
        logits.clone(),
        [penalized, plain, plain, sampled],
        [4, 4, 4, 4],
        [history, None, None, None],
        [None, _mask(allowed), None, None],
    )
    alone = sample(
        logits[[0, 2, 3]].clone(), [penalized, plain, sampled], [4, 4, 4], [history, None, None], None
    )
    assert int(mixed.token_ids[1]) in allowed
    assert int(mixed.token_ids[0]) == int(alone.token_ids[0]) != top[0]  # the penalty, not the mask
    assert int(mixed.token_ids[2]) == top[2] == int(alone.token_ids[1])
    assert int(mixed.token_ids[3]) == int(alone.token_ids[2])
    assert torch.allclose(mixed.logprobs[[0, 2]], alone.logprobs[[0, 1]])
