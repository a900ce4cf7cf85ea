"""Speculative decoding end to end on an in-process stack with a random tiny Llama (fp32, CPU,
reference kernels): greedy tokens with n-gram speculation are those without it, for 1 and 8
sequences, on copy-heavy prompts whose proposals the model accepts; multi-step decode, stop
tokens and max_tokens compose with it; nothing stays allocated afterwards, nor after a request
aborted between the Step that appended its proposals and their verification.

With a draft model (``StackConfig.speculative_model``: the model with noise on its weights, which
agrees with it often, not always): greedy tokens are transformers' for 1 and 8 sequences, the
accepted tokens' blocks enter the prefix cache under their own ids (a later prompt that repeats
them hits them and still gets transformers' tokens), an abort mid-way leaves nothing allocated,
and an engine asking workers without a draft for one refuses to start."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from pagedkv.frontend.engine import EngineConfig, EngineStats, GenerationRequest
from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model, noisy_copy

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("spec-llama"), seed=5)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256,
        kernel_backend="reference",
    )  # fmt: skip
    with LocalStack(cfg) as st:
        yield st


def copy_prompts(count: int) -> list[list[int]]:
    """A passage, then the passage again up to a point: the model is asked to go on copying."""
    out = []
    for i in range(count):
        rng = random.Random(i)
        passage = [rng.randrange(1, 120) for _ in range(16)]
        out.append(passage + [7] + passage[: rng.randint(3, 8)])
    return out


def run(
    st: LocalStack, prompts: list[list[int]], config: EngineConfig
) -> tuple[list[list[int]], EngineStats]:
    engine = st.engine(config)
    outs = engine.generate(GenerationRequest(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts))
    engine.flush()
    core = st.block_manager.servicer._core  # noqa: SLF001 - white-box check
    core.check_invariants()
    assert core.stats().num_sequences == 0 and core.stats().num_used_blocks == 0
    engine.close()
    return [o.completions[0].token_ids for o in outs], engine.stats


@pytest.mark.parametrize("num_seqs", [1, 8])
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_greedy_tokens_equal_plain_decoding(stack: LocalStack, num_seqs: int, decode_steps: int) -> None:
    prompts = copy_prompts(num_seqs)
    plain, _ = run(stack, prompts, EngineConfig(decode_steps=decode_steps))
    spec, stats = run(stack, prompts, EngineConfig(decode_steps=decode_steps, speculative=SPEC))
    assert spec == plain
    assert stats.spec_passes > 0
    assert stats.spec_accepted > 0, "no proposal was ever accepted on a copy-heavy prompt"
    assert stats.spec_emitted == stats.spec_accepted + stats.spec_passes


def test_stop_token_and_max_tokens(stack: LocalStack, hf: HFModel) -> None:
    p = copy_prompts(1)[0]
    ref = hf.greedy(p, 40)
    stop = ref[32]
    cut = ref.index(stop) + 1
    engine = stack.engine(EngineConfig(speculative=SPEC))
    reqs = [
        GenerationRequest("stop", p, max_tokens=40, stop_token_ids=(stop,)),
        GenerationRequest("len", p, max_tokens=33),
    ]
    stop_out, len_out = engine.generate(reqs)
    engine.flush()
    engine.close()
    assert stop_out.completions[0].token_ids == ref[:cut]
    assert stop_out.completions[0].finish_reason == "stop"
    assert len_out.completions[0].token_ids == ref[:33]
    assert engine.stats.spec_accepted > 0
    core = stack.block_manager.servicer._core  # noqa: SLF001
    assert core.stats().num_sequences == 0 and core.stats().num_used_blocks == 0


def test_abort_mid_verification_leaves_nothing_allocated(stack: LocalStack) -> None:
    """Aborted right after the Step that appended its proposals' slots (no deferred appends):
    the Free of the next Step releases those too."""
    engine = stack.engine(EngineConfig(speculative=SPEC, defer_appends=False, decode_steps=1))
    p = copy_prompts(2)
    engine.add_request(GenerationRequest("keep", p[0], max_tokens=40))
    engine.add_request(GenerationRequest("gone", p[1], max_tokens=40))
    sched = engine.scheduler
    gone = sched.seq_id("gone", 0)
    aborted = False
    real_batches = sched.batches

    def abort_after_the_step(**kw: bool):
        nonlocal aborted
        seq = sched.seqs.get(gone)
        if not aborted and seq is not None and seq.proposed and seq.blocks.slots == len(seq.tokens):
            assert engine.abort_request("gone")
            aborted = True
        return real_batches(**kw)

    sched.batches = abort_after_the_step  # type: ignore[method-assign,assignment]
    for _ in engine.stream():
        pass
    engine.flush()
    assert aborted, "no Step appended proposals for the aborted request"
    assert engine.release_request("gone")
    engine.close()
    core = stack.block_manager.servicer._core  # noqa: SLF001
    assert core.stats().num_sequences == 0 and core.stats().num_used_blocks == 0


DRAFT = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, max_num_seqs=8)


@pytest.fixture(scope="module")
def draft_stack(hf: HFModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    draft = noisy_copy(hf, tmp_path_factory.mktemp("spec-draft"))
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256,
        kernel_backend="reference", speculative_model=str(draft),
    )  # fmt: skip
    with LocalStack(cfg) as st:
        yield st


@pytest.mark.parametrize("num_seqs", [1, 8])
def test_draft_model_greedy_tokens_are_transformers(
    draft_stack: LocalStack, hf: HFModel, num_seqs: int
) -> None:
    prompts = copy_prompts(num_seqs)
    got, stats = run(draft_stack, prompts, EngineConfig(speculative=DRAFT))
    assert got == [hf.greedy(p, 40) for p in prompts]
    assert 0 < stats.spec_accepted < stats.spec_proposed, "the draft should agree sometimes, not always"
    assert stats.spec_emitted == stats.spec_accepted + stats.spec_passes


def test_tokens_a_draft_proposed_are_prefix_cached_under_their_own_ids(
    draft_stack: LocalStack, hf: HFModel
) -> None:
    """The accepted proposals had no slots during their pass; the next Step appends them with
    their ids, so their blocks are hashed as those tokens: a prompt that goes on past the first
    answer's tokens hits those blocks, and its answer is still transformers'."""
    p = copy_prompts(1)[0]
    engine = draft_stack.engine(EngineConfig(speculative=DRAFT))
    first = engine.generate([GenerationRequest("a", p, max_tokens=40)])[0].completions[0].token_ids
    q = p + first[:30]
    second = engine.generate([GenerationRequest("b", q, max_tokens=20)])[0]
    engine.flush()
    engine.close()
    assert engine.stats.spec_accepted > 0
    assert second.num_cached_tokens > len(p) + 8, "the hit should cover blocks of generated tokens"
    assert second.completions[0].token_ids == hf.greedy(q, 20)


def test_abort_of_a_drafting_request_leaves_nothing_allocated(draft_stack: LocalStack) -> None:
    engine = draft_stack.engine(EngineConfig(speculative=DRAFT))
    p = copy_prompts(2)
    engine.add_request(GenerationRequest("keep", p[0], max_tokens=40))
    engine.add_request(GenerationRequest("gone", p[1], max_tokens=40))
    seen = 0
    for ev in engine.stream():
        if ev.request_id == "gone":
            seen += 1
            if seen == 6:
                assert engine.abort_request("gone")
    engine.flush()
    assert seen >= 6 and engine.stats.spec_passes > 0
    engine.close()
    core = draft_stack.block_manager.servicer._core  # noqa: SLF001
    core.check_invariants()
    assert core.stats().num_sequences == 0 and core.stats().num_used_blocks == 0


def test_an_engine_asking_workers_without_a_draft_refuses_to_start(stack: LocalStack) -> None:
    with pytest.raises(ValueError, match="--speculative-model"):
        stack.engine(EngineConfig(speculative=DRAFT))
