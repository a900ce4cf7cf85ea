"""Speculative decoding with a draft model on the worker (``ModelRunner(draft=...)``).

The draft's KV is a second cache tensor indexed by the model's block ids, written by every
forward pass at the same positions as the model's; a sequence asking for ``num_draft`` tokens gets
them proposed by the draft (greedy, one row per step) and verified in the same step. Checked here:
greedy tokens are plain decoding's whatever the draft (the model itself: every proposal kept; a
small random one: nearly none; a perturbed copy: some); the draft's cache after drafted decoding
holds the draft's own KV of every computed position (what a plain prefill by the draft writes);
cache ops move the draft's blocks with the model's; a stop token ends a proposal; and bad requests
are refused before anything is written. The draft caches start as random values, never zeros."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.sampling import SamplingParams
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import CacheOpsRequest, InvalidStep, ModelRunner, SequenceRequest
from tests.worker_svc.conftest import HFModel, build_hf_model, noisy_copy
from tests.worker_svc.test_model_runner import BLOCK, PROMPT, make_runner
from tests.worker_svc.test_speculative_verify import TABLE, plain

N = 24  # tokens decoded after PROMPT


def draft_runner(target: pathlib.Path, draft: pathlib.Path, num_gpu_blocks: int = 64) -> ModelRunner:
    """``make_runner``'s runner with ``draft`` as its draft model, the draft's caches random."""
    runner = make_runner(target, num_gpu_blocks=num_gpu_blocks)
    cfg = ModelConfig.from_dir(draft)
    model = load_model(str(draft), cfg, torch.float32, torch.device("cpu"))
    shape = (cfg.num_layers, 2, num_gpu_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    cpu_shape = (*shape[:2], runner.num_cpu_blocks, *shape[3:])
    return ModelRunner(
        runner.model,
        runner.gpu_cache,
        runner.cpu_cache,
        draft=model,
        draft_gpu_cache=torch.randn(shape),
        draft_cpu_cache=torch.randn(cpu_shape),
    )


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    """Another architecture's size: 1 layer, 1 KV head of 16, the model's vocabulary."""
    return build_hf_model(
        tmp_path_factory.mktemp("draft-small"),
        seed=9,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def near_draft(hf_llama: HFModel, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return noisy_copy(hf_llama, tmp_path_factory.mktemp("draft-near"))


def drafted(
    runner: ModelRunner, n: int, k: int, sampling: SamplingParams | None = None
) -> tuple[list[int], list[tuple[int, int]]]:
    """n tokens after PROMPT: a prefill, then passes asking the draft for k tokens (fewer near n);
    returns the tokens and each pass's (drafted, accepted)."""
    sp = sampling or SamplingParams()
    tokens = [runner.step([SequenceRequest("d", PROMPT, TABLE, 0, sampling=sp)]).outputs[0].token_id]
    passes = []
    while len(tokens) < n:
        pos = len(PROMPT) + len(tokens) - 1
        ask = min(k, n - len(tokens))
        o = runner.step([SequenceRequest("d", [tokens[-1]], TABLE, pos, sampling=sp, num_draft=ask)]).outputs[
            0
        ]
        got = [o.token_id] + [d.token_id for d in o.next_samples]
        assert len(got) == o.num_accepted + 1 and 1 <= o.num_drafted <= ask
        passes.append((o.num_drafted, o.num_accepted))
        tokens += got
    return tokens[:n], passes


@pytest.fixture(scope="module")
def want(hf_llama: HFModel) -> list[int]:
    return plain(make_runner(hf_llama.path), N, SamplingParams())


def test_the_model_as_its_own_draft_keeps_every_proposal(hf_llama: HFModel, want: list[int]) -> None:
    """Its draft KV is its own KV at every position (prefill and verified rows alike), so each
    proposal is the token plain decoding draws: every one is kept."""
    got, passes = drafted(draft_runner(hf_llama.path, hf_llama.path), N, 4)
    assert got == want
    assert all(d == a for d, a in passes) and sum(a for _, a in passes) >= N - 1 - len(passes)


@pytest.mark.parametrize("draft", ["small", "near"])
def test_greedy_tokens_are_plain_decodings_whatever_the_draft(
    hf_llama: HFModel, small_draft: HFModel, near_draft: pathlib.Path, want: list[int], draft: str
) -> None:
    path = small_draft.path if draft == "small" else near_draft
    got, passes = drafted(draft_runner(hf_llama.path, path), N, 4)
    assert got == want
    if draft == "near":  # some proposals kept, some not: both paths of the verification ran
        assert 0 < sum(a for _, a in passes) < sum(d for d, _ in passes)


def test_seeded_sampling_with_a_draft_gives_plain_samplings_tokens(
    hf_llama: HFModel, near_draft: pathlib.Path
) -> None:
    """Greedy proposals are a deterministic proposer's: each position is drawn with the uniform
    plain decoding uses there, so a seeded request's tokens do not depend on the draft."""
    for seed in range(3):
        sp = SamplingParams(temperature=1.0, seed=seed)
        ref = plain(make_runner(hf_llama.path), 12, sp)
        assert drafted(draft_runner(hf_llama.path, near_draft), 12, 3, sp)[0] == ref


def test_the_draft_cache_holds_the_drafts_kv_of_every_computed_position(
    hf_llama: HFModel, small_draft: HFModel
) -> None:
    """After drafted decoding, the draft's cache at every computed position is what the draft
    itself writes when it prefills the same tokens (as a model of its own)."""
    runner = draft_runner(hf_llama.path, small_draft.path)
    tokens, _ = drafted(runner, N, 4)
    seq = PROMPT + tokens[:-1]  # the last token is drawn, not computed
    alone = make_runner(small_draft.path)
    alone.step([SequenceRequest("a", seq, TABLE, 0)])
    assert runner.draft_gpu_cache is not None
    slots = [TABLE[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(seq))]

    def rows(cache: torch.Tensor) -> torch.Tensor:
        flat = cache.flatten(2, 3)  # [L, 2, blocks * block_size, heads, dim]
        return flat[:, :, slots]

    torch.testing.assert_close(rows(runner.draft_gpu_cache), rows(alone.gpu_cache), atol=1e-4, rtol=1e-4)


def test_a_stop_token_ends_the_proposal(hf_llama: HFModel, want: list[int]) -> None:
    """The model as its own draft proposes plain decoding's tokens; a stop token among them is
    the proposal's last."""
    runner = draft_runner(hf_llama.path, hf_llama.path)
    runner.step([SequenceRequest("d", PROMPT, TABLE, 0)])
    stop = want[3]
    o = runner.step(
        [SequenceRequest("d", [want[0]], TABLE, len(PROMPT), num_draft=6, stop_token_ids=frozenset({stop}))]
    ).outputs[0]
    first = want.index(stop)  # the first proposal that is the stop token
    assert o.num_drafted == first
    assert [o.token_id] + [d.token_id for d in o.next_samples] == want[1 : first + 2]


def test_cache_ops_move_the_drafts_blocks_too(hf_llama: HFModel, small_draft: HFModel) -> None:
    runner = draft_runner(hf_llama.path, small_draft.path)
    dg, dc = runner.draft_gpu_cache, runner.draft_cpu_cache
    assert dg is not None and dc is not None
    before_gpu, before_cpu = dg.clone(), dc.clone()
    runner.step([], CacheOpsRequest(swap_out=[(3, 1)], copies=[(5, 9)], swap_in=[(2, 11)]))
    torch.testing.assert_close(dc[:, :, 1], before_gpu[:, :, 3], rtol=0, atol=0)
    torch.testing.assert_close(dg[:, :, 9], before_gpu[:, :, 5], rtol=0, atol=0)
    torch.testing.assert_close(dg[:, :, 11], before_cpu[:, :, 2], rtol=0, atol=0)


def test_bad_draft_requests_are_refused_before_anything_is_written(
    hf_llama: HFModel, small_draft: HFModel
) -> None:
    with pytest.raises(InvalidStep, match="no draft model"):
        make_runner(hf_llama.path).step([SequenceRequest("d", [5], TABLE, 10, num_draft=2)])
    runner = draft_runner(hf_llama.path, small_draft.path)
    assert runner.draft_gpu_cache is not None
    caches = (runner.gpu_cache.clone(), runner.draft_gpu_cache.clone())
    bad = {
        "one new token": SequenceRequest("d", [5, 6], TABLE, 10, num_draft=2),
        "decode_steps": SequenceRequest("d", [5], TABLE, 10, num_draft=2, decode_steps=2),
        "return_logits": SequenceRequest("d", [5], TABLE, 10, num_draft=2, return_logits=True),
        "blocks of 4": SequenceRequest("d", [5], TABLE[:3], 10, num_draft=2),  # 13 tokens need 4
        r"not in \[1, 64\]": SequenceRequest("d", [5], list(range(20, 40)), 10, num_draft=65),
    }
    for why, req in bad.items():
        with pytest.raises(InvalidStep, match=why):
            runner.step([SequenceRequest("ok", PROMPT, list(range(40, 44)), 0), req])
    assert torch.equal(runner.gpu_cache, caches[0]) and torch.equal(runner.draft_gpu_cache, caches[1])


def test_a_draft_cache_that_does_not_fit_the_draft_is_refused(
    hf_llama: HFModel, small_draft: HFModel
) -> None:
    runner = draft_runner(hf_llama.path, small_draft.path)
    assert runner.draft is not None and runner.draft_gpu_cache is not None
    with pytest.raises(ValueError, match="does not fit draft model"):
        ModelRunner(
            runner.model,
            runner.gpu_cache,
            runner.cpu_cache,
            draft=runner.draft,
            draft_gpu_cache=runner.draft_gpu_cache[:, :, :10],
            draft_cpu_cache=runner.draft_cpu_cache,
        )
