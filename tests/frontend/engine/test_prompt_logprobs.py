"""vLLM's prompt logprobs through the engine on a real local stack, against transformers.

fp32 on CPU with the torch reference kernels: each prompt token after the first gets the
log-softmax of transformers' logits at the position before it (its rank and the most likely
tokens too), across a chunked prefill, although another request had already put the prompt's
prefix in the prefix cache: a request that asks for prompt logprobs takes no hit (every position
must be computed), and the KV it writes is still shared with the requests after it.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.frontend.engine import EngineConfig, GenerationRequest, PromptLogprob, RequestOutput
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("prompt-logprobs-llama"), seed=5)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


def reference(hf: HFModel, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``prompt`` (row p: the distribution of p + 1)."""
    with torch.inference_mode():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, -1)


def check_scores(out: RequestOutput, prompt: list[int], ref: torch.Tensor, num_top: int) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt)
    assert scores[0] is None  # nothing comes before the first token
    for pos in range(1, len(prompt)):
        x = scores[pos]
        assert isinstance(x, PromptLogprob), f"position {pos} was not scored"
        row = ref[pos - 1]
        assert x.token_id == prompt[pos]
        assert x.logprob == pytest.approx(float(row[x.token_id]), abs=TOL)
        # vLLM's rank: the tokens at least as likely, itself included (bounds allow fp32 near-ties).
        assert int((row > x.logprob + TOL).sum()) < x.rank <= int((row >= x.logprob - TOL).sum())
        assert len(x.top) == num_top
        assert [lp for _, lp in x.top] == pytest.approx(row.topk(num_top).values.tolist(), abs=TOL)
        assert all(float(row[t]) == pytest.approx(lp, abs=TOL) for t, lp in x.top)


def test_prompt_logprobs_cover_every_position_across_chunks_despite_a_cached_prefix(hf: HFModel) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(1, 120) for _ in range(13)]  # three full blocks of 4 and one token
    first = shared + [rng.randrange(1, 120) for _ in range(4)]
    asks = shared + [rng.randrange(1, 120) for _ in range(9)]  # 22 tokens: three chunks of 8
    with LocalStack(
        StackConfig(model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64)
    ) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8))
        (plain,) = engine.generate([GenerationRequest("plain", first, max_tokens=3)])
        assert plain.num_cached_tokens == 0 and plain.prompt_logprobs is None
        # The shared prefix is committed now: a request that asks for prompt logprobs skips it.
        (scored,) = engine.generate([GenerationRequest("scored", asks, max_tokens=4, n=2, prompt_logprobs=3)])
        assert scored.num_cached_tokens == 0, "prompt logprobs need every position: no hit"
        hits_before = engine.stats.prefix_hit_tokens
        # What "scored" wrote is shared: the same prompt without prompt logprobs hits its blocks,
        # past the prefix "plain" had cached (its own blocks there were duplicates, not cached).
        again, zero = engine.generate(
            [
                GenerationRequest("again", asks, max_tokens=4),
                GenerationRequest("zero", [*asks[:5], 3, 9], max_tokens=2, prompt_logprobs=0),
            ]
        )
        bm = st.block_manager.servicer._core  # noqa: SLF001 - white-box check
        bm.check_invariants()
        assert bm.stats().num_sequences == 0
    assert again.num_cached_tokens == 20 and engine.stats.prefix_hit_tokens == hits_before + 20
    expected = hf.greedy(asks, 4)
    assert [c.token_ids for c in scored.completions] == [expected, expected]
    assert again.completions[0].token_ids == expected  # the shared KV is the right KV
    check_scores(scored, asks, reference(hf, asks), 3)
    check_scores(zero, [*asks[:5], 3, 9], reference(hf, [*asks[:5], 3, 9]), 0)
    assert again.prompt_logprobs is None


def test_a_one_token_prompt_has_only_the_first_entry(hf: HFModel) -> None:
    with LocalStack(
        StackConfig(model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=16)
    ) as st:
        (out,) = st.engine().generate([GenerationRequest("one", [42], max_tokens=2, prompt_logprobs=2)])
    assert out.prompt_logprobs == [None] and out.completions[0].token_ids == hf.greedy([42], 2)


def test_prompt_logprobs_beyond_the_workers_bound_are_refused() -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        GenerationRequest("r", [1, 2], prompt_logprobs=21).validate()
