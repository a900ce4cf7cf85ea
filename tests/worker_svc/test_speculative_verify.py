"""Speculative decoding's verification step on the worker: k proposed tokens scored in one pass
over the paged cache, the longest prefix the target's own sampling agrees with kept, then the
target's next token. Greedy and seeded outputs are those of plain decoding; unseeded sampling
keeps the target's distribution (token frequencies against the model's probabilities)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.sampling import SamplingParams, accept_proposals
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import InvalidStep, ModelRunner, SequenceRequest
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.test_model_runner import BLOCK, PROMPT, make_runner

TABLE = list(range(20, 32))  # 12 blocks of 4: room for the prompt and 30 more tokens


def plain(runner: ModelRunner, n: int, sampling: SamplingParams, table: list[int] = TABLE) -> list[int]:
    """n tokens of plain decoding after PROMPT, one step each."""
    out = runner.step([SequenceRequest("p", PROMPT, table, 0, sampling=sampling)]).outputs[0].token_id
    tokens = [out]
    for pos in range(len(PROMPT), len(PROMPT) + n - 1):
        o = runner.step([SequenceRequest("p", [tokens[-1]], table, pos, sampling=sampling)]).outputs[0]
        tokens.append(o.token_id)
    return tokens


def speculate(
    runner: ModelRunner, want: list[int], sampling: SamplingParams, k: int, right: int
) -> tuple[list[int], list[int]]:
    """Decode after PROMPT with verification steps whose proposals are the next `right` tokens of
    `want` followed by wrong ones (k in all); returns the tokens and each step's accepted count.
    Rejected proposals' KV is left in the cache and overwritten, as after a rollback."""
    first = runner.step([SequenceRequest("s", PROMPT, TABLE, 0, sampling=sampling)]).outputs[0]
    tokens, accepted = [first.token_id], []
    while len(tokens) < len(want):
        pos = len(PROMPT) + len(tokens) - 1  # the KV of every token but the last is cached
        good = want[len(tokens) : len(tokens) + right]
        bad = [(t + 1) % 128 for t in want[len(tokens) + len(good) : len(tokens) + k]]
        proposal = (good + bad + [0] * k)[:k]
        o = runner.step(
            [SequenceRequest("s", [tokens[-1], *proposal], TABLE, pos, sampling=sampling, num_proposed=k)]
        ).outputs[0]
        got = [o.token_id] + [d.token_id for d in o.next_samples]
        assert len(got) == o.num_accepted + 1 and got[:-1] == proposal[: o.num_accepted]
        tokens += got
        accepted.append(o.num_accepted)
    return tokens[: len(want)], accepted


@pytest.mark.parametrize("right", [0, 2, 4])
def test_greedy_verification_gives_the_tokens_of_plain_decoding(hf_llama: HFModel, right: int) -> None:
    want = plain(make_runner(hf_llama.path), 24, SamplingParams())
    got, accepted = speculate(make_runner(hf_llama.path), want, SamplingParams(), 4, right)
    assert got == want
    # Right proposals are kept (the last step may be cut by the end of `want`), wrong ones never.
    assert all(a == right for a in accepted[:-1])


def test_seeded_sampling_verification_gives_the_tokens_of_plain_sampling(hf_llama: HFModel) -> None:
    """Each position is drawn with the uniform plain decoding uses there: same seed, same tokens,
    whichever proposals were made; over many seeds the frequencies are therefore plain sampling's."""
    plain_runner, spec_runner = make_runner(hf_llama.path), make_runner(hf_llama.path)
    for seed in range(4):
        sp = SamplingParams(temperature=1.3, seed=seed)
        want = plain(plain_runner, 10, sp)
        for right in (1, 3):
            assert speculate(spec_runner, want, sp, 3, right)[0] == want


@pytest.mark.slow  # 400 draws on the reference kernels
def test_unseeded_sampling_keeps_the_target_distribution(hf_llama: HFModel) -> None:
    """Propose the target's most likely token d at the next position, many times over: d must be
    accepted with probability p(d), and the token that comes out there must follow p."""
    lanes, rounds = 50, 8  # 400 draws: 50 sequences with their own blocks, 8 steps
    runner = make_runner(hf_llama.path, num_gpu_blocks=3 * lanes)
    temp = 0.5
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(lanes)]
    ref = runner.step(
        [SequenceRequest(f"r{i}", PROMPT, t, 0, return_logits=not i) for i, t in enumerate(tables)]
    ).outputs[0]
    assert ref.logits is not None
    p = torch.softmax(ref.logits / temp, -1)
    d = int(p.argmax())
    sp = SamplingParams(temperature=temp)
    n = lanes * rounds
    counts = torch.zeros_like(p)
    accepted = 0
    last, pos = PROMPT[-1], len(PROMPT) - 1
    for _ in range(rounds):
        res = runner.step(
            [
                SequenceRequest(f"r{i}", [last, d], t, pos, sampling=sp, num_proposed=1)
                for i, t in enumerate(tables)
            ]
        )
        for o in res.outputs:
            counts[o.token_id] += 1
            accepted += o.num_accepted
    sigma = (p[d] * (1 - p[d]) / n).sqrt()
    assert abs(accepted / n - float(p[d])) < 4 * sigma
    top = torch.topk(p, 5).indices
    for t in top.tolist():
        sd = float((p[t] * (1 - p[t]) / n).sqrt())
        assert abs(float(counts[t]) / n - float(p[t])) < 4 * sd + 1e-3, t
    rest = 1 - float(p[top].sum())
    drawn_rest = 1 - float(counts[top].sum()) / n
    assert abs(drawn_rest - rest) < 4 * (rest * (1 - rest) / n) ** 0.5


def test_a_verifying_sequence_and_a_plain_one_share_a_step(hf_llama: HFModel) -> None:
    want = plain(make_runner(hf_llama.path), 6, SamplingParams())
    runner = make_runner(hf_llama.path)
    other = list(range(40, 48))
    runner.step([SequenceRequest("s", PROMPT, TABLE, 0), SequenceRequest("q", PROMPT, other, 0)])
    res = runner.step(
        [
            SequenceRequest("s", [want[0], *want[1:4]], TABLE, len(PROMPT), num_proposed=3),
            SequenceRequest("q", [want[0]], other, len(PROMPT)),
        ]
    )
    s, q = res.outputs
    assert s.num_accepted == 3 and [s.token_id] + [d.token_id for d in s.next_samples] == want[1:5]
    assert q.token_id == want[1] and not q.next_samples
    assert res.num_tokens == 4 + 1


def _cpu_runner(path: object, held: str) -> ModelRunner:
    """A runner on the CPU backend a worker runs (its native kernels and decode chain), the model
    held dense or quantized at load (int4 layers, an int8 output layer)."""
    cfg = ModelConfig.from_dir(path)  # type: ignore[arg-type]
    model = load_model(str(path), cfg, torch.float32, torch.device("cpu"), held=held)
    shape = (cfg.num_layers, 2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(
        model, torch.zeros(shape), torch.zeros((*shape[:2], 1, *shape[3:])), kernel_backend="cpu"
    )


def _spy_logits(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner) -> list[torch.Tensor]:
    """Every forward pass's logits rows, in order (build_batch's: each sequence's last position,
    then the verifying sequences' proposed positions)."""
    calls: list[torch.Tensor] = []
    forward = runner.model.forward

    def spy(*args: object) -> torch.Tensor:
        out = forward(*args)  # type: ignore[arg-type]
        calls.append(out.clone())
        return out

    monkeypatch.setattr(runner.model, "forward", spy)
    return calls


LONG_TABLE = list(range(16))  # 64 tokens: contexts past the decode kernel's split into runs


@pytest.mark.parametrize("held", ["dense", "int4"])
def test_verification_computes_every_position_as_plain_decoding_to_the_bit(
    hf_llama: HFModel, held: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the worker's CPU kernels each position a verification pass scores gets the logits plain
    decoding computes there, bit for bit (not merely the same argmax: a near-tie would otherwise
    flip a greedy token), for 1 to 12 proposals (the quantized layers' row tiles and past 8 rows),
    contexts past 4 blocks (the decode attention's runs), and a prefill sharing the step."""
    runner = _cpu_runner(hf_llama.path, held)
    calls = _spy_logits(monkeypatch, runner)
    n = 44
    want = plain(runner, n, SamplingParams(), LONG_TABLE)
    at = {len(PROMPT) + i: row[0] for i, row in enumerate(calls[1:])}  # decode step i: position P + i
    assert len(at) == n - 1
    for k in (1, 3, 7, 12):
        calls.clear()
        runner.step([SequenceRequest("s", PROMPT, LONG_TABLE, 0)])
        done, step = 1, 0  # tokens of `want` known (the first from the prefill)
        while done + k < n:
            cached = len(PROMPT) + done - 1
            seqs = [SequenceRequest("s", want[done - 1 : done + k], LONG_TABLE, cached, num_proposed=k)]
            if step == 1:  # another sequence's prefill in the same step
                seqs.append(SequenceRequest("o", PROMPT[::-1], list(range(40, 44)), 0))
            o = runner.step(seqs).outputs[0]
            assert o.num_accepted == k
            rows = calls[-1]
            # row 0: the last position; after every sequence's row, the proposed ones in order
            got = {cached + k: rows[0]} | {cached + j: rows[len(seqs) + j] for j in range(k)}
            for pos, logits in got.items():
                assert torch.equal(logits, at[pos]), (k, pos)
            done += k + 1
            step += 1
        assert step >= 3


def test_a_sequences_decode_logits_do_not_depend_on_its_batch(
    hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain decoding on the worker's CPU kernels: a sequence decoded alone and the same sequence
    decoded among 7 others (different prompts and lengths) get the same logits to the bit at every
    step, so its greedy tokens do not depend on how many sequences share the steps (nor, with
    speculation, on whether its neighbours were verifying)."""
    alone, crowd = _cpu_runner(hf_llama.path, "int4"), _cpu_runner(hf_llama.path, "int4")
    a_calls, c_calls = _spy_logits(monkeypatch, alone), _spy_logits(monkeypatch, crowd)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(8)]  # 32 tokens each
    prompts = [PROMPT] + [[(t * (i + 3)) % 97 for t in PROMPT[: 4 + i]] for i in range(1, 8)]
    tok = alone.step([SequenceRequest("s", PROMPT, tables[0], 0)]).outputs[0].token_id
    outs = crowd.step([SequenceRequest(f"s{i}", p, tables[i], 0) for i, p in enumerate(prompts)]).outputs
    last = [o.token_id for o in outs]
    assert last[0] == tok
    for step in range(18):
        tok = alone.step([SequenceRequest("s", [tok], tables[0], len(PROMPT) + step)]).outputs[0].token_id
        outs = crowd.step(
            [SequenceRequest(f"s{i}", [last[i]], tables[i], len(p) + step) for i, p in enumerate(prompts)]
        ).outputs
        last = [o.token_id for o in outs]
        assert torch.equal(c_calls[-1][0], a_calls[-1][0]), step
        assert last[0] == tok


def test_accept_proposals_and_invalid_verification_steps(runner: ModelRunner) -> None:
    assert accept_proposals([1, 2, 3], [1, 2, 9, 4]) == 2
    assert accept_proposals([1, 2], [1, 2, 5]) == 2
    assert accept_proposals([1], [0, 1]) == 0
    for bad, match in [
        (SequenceRequest("x", [1, 2], [0], 0, num_proposed=2), "less than"),
        (SequenceRequest("x", [1, 2], [0], 0, num_proposed=1, return_logits=True), "return_logits"),
        (SequenceRequest("x", [1, 2], [0], 0, num_proposed=1, allowed_token_mask=b"\xff" * 16), "mask"),
    ]:
        with pytest.raises(InvalidStep, match=match):
            runner.step([bad])


@pytest.fixture
def runner(hf_llama: HFModel) -> ModelRunner:
    return make_runner(hf_llama.path)


assert BLOCK == 4
