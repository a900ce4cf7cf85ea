"""Beam search end to end on a real local stack, against transformers' beam search on the same
weights (``generate(num_beams=n, num_return_sequences=n, do_sample=False, length_penalty=...)``).

fp32 on CPU with the torch reference kernels, the tiny random Llama of the engine tests: the n
hypotheses (tokens, order, scores) are transformers', for n = 2 and 4, with an end token that
finishes some early and with a forced preemption; the beams are forks that hold fewer blocks than
n independent sequences, and the block manager holds nothing after any request, an aborted one
included.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest, RequestOutput
from pagedkv.frontend.engine.beam import BeamParams
from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.kv_capacity import blocks_for_tokens
from tests.worker_svc.conftest import HFModel, build_hf_model

BS = 4


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("beam-llama"), seed=3)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


def stack(
    hf: HFModel, num_gpu_blocks: int = 96, roles: tuple[str, ...] = (), **overrides: object
) -> LocalStack:
    cfg = StackConfig(
        model=str(hf.path),
        device="cpu",
        dtype="float32",
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        num_workers=max(1, len(roles)),
        roles=roles,
        block_manager_overrides=dict(overrides),
    )
    return LocalStack(cfg)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 120) for _ in range(length)]


def held(st: LocalStack) -> tuple[int, int]:
    s = st.block_manager.servicer._core.stats()  # noqa: SLF001 - white-box check
    return s.num_sequences, s.num_used_blocks


def run(engine: Engine, st: LocalStack, request: GenerationRequest) -> tuple[RequestOutput, int]:
    """The request to its end, and the most blocks the manager held meanwhile."""
    out = engine.add_request(request)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, held(st)[1])
    engine.flush()
    engine.release_request(request.request_id)
    return out, peak


def check(out: RequestOutput, want: list[tuple[list[int], float]], ends: list[int]) -> None:
    assert [c.token_ids for c in out.completions] == [t for t, _ in want]
    assert [c.beam_score for c in out.completions] == pytest.approx([s for _, s in want], abs=1e-4)
    for c in out.completions:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in ends else "length")


@pytest.mark.parametrize("n", [2, 4])
def test_the_beams_are_transformers_and_share_their_blocks(hf: HFModel, n: int) -> None:
    max_tokens = 10
    with stack(hf, enable_prefix_caching=False) as st:  # only forks may share blocks
        engine = st.engine()
        for seed, length in ((1, 13), (2, 6)):
            prompt = prompt_of(seed, length)
            # An end token the search meets: the second best beam's third token without one.
            end = hf.beam_search(prompt, n, max_tokens)[1][0][2]
            for ends, lp in (([], 1.0), ([end], 1.0), ([end], 0.5)):
                want = hf.beam_search(prompt, n, max_tokens, ends, lp)
                req = GenerationRequest(
                    f"b{n}-{seed}-{len(ends)}-{lp}",
                    prompt,
                    max_tokens=max_tokens,
                    n=n,
                    stop_token_ids=tuple(ends),
                    beam=BeamParams(lp),
                )
                out, peak = run(engine, st, req)
                check(out, want, ends)
                independent = n * blocks_for_tokens(len(prompt) + max_tokens - 1, BS)
                assert peak < independent, (peak, independent)
                assert held(st) == (0, 0), "every beam, pruned or answered, was freed"
        bm = st.block_manager.servicer._core  # noqa: SLF001
        assert bm.stats().num_cow_copies > 0, "beams copy their shared last block where they part"
        bm.check_invariants()


def test_an_end_token_finishes_hypotheses_early(hf: HFModel) -> None:
    """Some hypothesis is shorter than max_tokens in the cases above: the end-token path ran."""
    shorter = 0
    for seed, length in ((1, 13), (2, 6)):
        prompt = prompt_of(seed, length)
        end = hf.beam_search(prompt, 4, 10)[1][0][2]
        shorter += any(len(t) < 10 for t, _ in hf.beam_search(prompt, 4, 10, [end]))
    assert shorter


def test_preempted_beams_give_the_same_answer_and_free_everything(hf: HFModel) -> None:
    """A pool too small for two searches and a long request: beams are preempted (their fork
    groups recomputed) and come back; both answers are still transformers'."""
    prompts = [prompt_of(5, 11), prompt_of(6, 9)]
    with stack(hf, num_gpu_blocks=18) as st:
        engine = st.engine()
        reqs = [
            GenerationRequest(f"p{i}", p, max_tokens=12, n=n, beam=BeamParams())
            for i, (p, n) in enumerate(zip(prompts, (4, 2), strict=True))
        ]
        other = GenerationRequest("long", prompt_of(7, 14), max_tokens=16)
        outs = engine.generate([*reqs, other])
        engine.flush()
        assert engine.stats.preempted_recompute + engine.stats.preempted_swap > 0
        assert held(st) == (0, 0)
    for req, out in zip(reqs, outs, strict=False):
        check(out, hf.beam_search(req.prompt, req.n, 12), [])
    assert outs[2].completions[0].token_ids == hf.greedy(other.prompt, 16)


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_an_aborted_search_leaves_no_block(hf: HFModel, steps: int) -> None:
    with stack(hf) as st:
        engine = st.engine()
        req = GenerationRequest("a", prompt_of(9, 10), max_tokens=12, n=4, beam=BeamParams())
        out = engine.add_request(req)
        for _ in range(steps):
            engine.step()
        assert held(st)[0] > (0 if steps == 1 else 1), "the search was under way"
        assert engine.abort_request("a")
        for _ in engine.stream():
            pass
        engine.flush()
        assert held(st) == (0, 0)
        assert out.finished and {c.finish_reason for c in out.completions} == {"abort"}
        assert engine.release_request("a") and not engine.scheduler.seqs


@pytest.mark.parametrize(
    ("config", "roles"),
    [
        (EngineConfig(overlap_block_manager=True), ()),
        (EngineConfig(decode_steps=4), ()),
        (EngineConfig(speculative=SpeculativeConfig()), ()),
        (EngineConfig(defer_appends=False), ()),
        (EngineConfig(max_batch_tokens=4), ()),  # a chunked prefill
        (EngineConfig(), ("prefill", "decode")),  # the prefill pipeline
    ],
    ids=["overlap", "multi-step", "speculative", "no-deferred-appends", "chunked", "prefill-decode"],
)
def test_every_engine_mode_gives_the_same_beams(
    hf: HFModel, config: EngineConfig, roles: tuple[str, ...]
) -> None:
    """Beams decode one step at a time whatever the engine may do for samples (no multi-step, no
    speculation, no slot reserved or block granted ahead: the decision may fork them), beside a
    plain request and a search of one token (decided from the prompt alone)."""
    prompt = prompt_of(4, 11)
    with stack(hf, num_gpu_blocks=64, roles=roles) as st:
        engine = st.engine(config)
        outs = engine.generate(
            [
                GenerationRequest("b", prompt, max_tokens=10, n=3, beam=BeamParams()),
                GenerationRequest("s", prompt[:7], max_tokens=12),
                GenerationRequest("one", prompt, max_tokens=1, n=3, beam=BeamParams()),
            ]
        )
        engine.flush()
        assert held(st) == (0, 0)
    check(outs[0], hf.beam_search(prompt, 3, 10), [])
    check(outs[2], hf.beam_search(prompt, 3, 1), [])
    assert outs[1].completions[0].token_ids == hf.greedy(prompt[:7], 12)
