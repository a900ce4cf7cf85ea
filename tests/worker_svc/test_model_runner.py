"""The model runner against transformers' LlamaForCausalLM: same weights, same greedy tokens.

Every scenario drives the real block manager core for block tables and cache ops, and compares
the tokens with ``generate(do_sample=False)`` on the full token history (dense cache, fp32).
Block size 4 so that short generations cross many block boundaries.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.sampling import SamplingParams, TokenHistory, adjust_logits
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import (
    CacheOpsRequest,
    InvalidStep,
    ModelRunner,
    RunnerClosed,
    SequenceRequest,
)
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.generation import Scheduler, runner_step

BLOCK = 4
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2]  # 10 tokens: 2.5 blocks


def make_runner(path: object, num_gpu_blocks: int = 64, num_cpu_blocks: int = 16) -> ModelRunner:
    cfg = ModelConfig.from_dir(path)  # type: ignore[arg-type]
    model = load_model(str(path), cfg, torch.float32, torch.device("cpu"))
    shape = (cfg.num_layers, 2, num_gpu_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    gpu = torch.zeros(shape)
    cpu = torch.zeros((*shape[:2], num_cpu_blocks, *shape[3:]))
    return ModelRunner(model, gpu, cpu)


@pytest.fixture(scope="module")
def runner(hf_llama: HFModel) -> ModelRunner:
    return make_runner(hf_llama.path)


def test_prefill_logits_and_logprob_match_transformers(runner: ModelRunner, hf_llama: HFModel) -> None:
    res = runner.step([SequenceRequest("s", PROMPT, list(range(10, 13)), 0, return_logits=True)])
    ref = hf_llama.last_logits(PROMPT)
    out = res.outputs[0]
    assert out.logits is not None
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
    assert out.token_id == int(ref.argmax())
    assert out.logprob == pytest.approx(float(torch.log_softmax(ref, -1)[out.token_id]), abs=1e-4)


def test_greedy_decode_across_block_boundaries_matches_generate(
    runner: ModelRunner, hf_llama: HFModel
) -> None:
    sched = Scheduler(runner_step(runner), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 30)  # 40 tokens = 10 blocks
    assert len(sched.bm.block_table("a").block_ids) == 10
    assert sched.seqs["a"].generated == hf_llama.greedy(PROMPT, 30)


def test_decode_logits_match_transformers_on_full_history(runner: ModelRunner, hf_llama: HFModel) -> None:
    sched = Scheduler(runner_step(runner), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 6)
    st = sched.seqs["a"]
    st.tokens.append(st.generated[-1])
    sched.bm.append("a", 1, token_ids=[st.generated[-1]])
    req = SequenceRequest(
        "a", [st.tokens[-1]], sched.bm.block_table("a").block_ids, len(st.tokens) - 1, return_logits=True
    )
    out = runner.step([req]).outputs[0]
    torch.testing.assert_close(out.logits, hf_llama.last_logits(st.tokens), atol=1e-4, rtol=1e-4)


def test_mixed_prefill_and_decode_batch_equals_separate_runs(runner: ModelRunner, hf_llama: HFModel) -> None:
    other = [9, 8, 7, 6, 5, 4, 3]
    sched = Scheduler(runner_step(runner), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.run(["a"])  # prefill a
    sched.add("b", other)
    sched.add("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # a decodes while b and c prefill, all in one forward pass; a is listed between them.
    sched.push("a", sched.seqs["a"].generated[-1])
    sched.run(["b", "a", "c"])
    sched.generate(["b", "a", "c"], 12)
    assert sched.seqs["a"].generated == hf_llama.greedy(PROMPT, 14)
    assert sched.seqs["b"].generated == hf_llama.greedy(other, 13)
    assert sched.seqs["c"].generated == hf_llama.greedy([1, 2, 3, 4, 5, 6, 7, 8, 9], 13)


def test_prefix_cache_hit_prefills_only_the_uncached_part(runner: ModelRunner, hf_llama: HFModel) -> None:
    calls: list[list[SequenceRequest]] = []
    step = runner_step(runner)

    def spy(seqs: list[SequenceRequest], ops: CacheOpsRequest) -> list[tuple[int, float]]:
        calls.append(seqs)
        return step(seqs, ops)

    sched = Scheduler(spy, block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 3)
    prompt_b = PROMPT[:8] + [77, 78, 79]  # shares two full blocks with a
    hit = sched.add("b", prompt_b)
    assert hit == 8
    sched.generate(["b"], 10)
    first_b = next(s for c in calls for s in c if s.seq_id == "b")
    assert first_b.num_cached_tokens == 8 and first_b.token_ids == [77, 78, 79]
    assert sched.bm.block_table("b").block_ids[:2] == sched.bm.block_table("a").block_ids[:2]
    assert sched.seqs["b"].generated == hf_llama.greedy(prompt_b, 10)


def test_fork_with_copy_on_write_keeps_parent_and_child_apart(runner: ModelRunner, hf_llama: HFModel) -> None:
    sched = Scheduler(runner_step(runner), block_size=BLOCK)
    sched.add("p", PROMPT)
    sched.generate(["p"], 5)  # 14 tokens in cache + 1 pending: last block partially filled
    sched.fork("p", "c")
    parent_next = sched.seqs["p"].generated[-1]
    child_next = (parent_next + 1) % 128  # the child takes another branch (as beam search would)
    ops_p = sched.push("p", parent_next)
    ops_c = sched.push("c", child_next)
    copies = ops_p.copies + ops_c.copies
    assert len(copies) == 1, "exactly one copy-on-write of the shared last block"
    sched.run(["p", "c"], CacheOpsRequest(copies=copies))
    sched.generate(["p", "c"], 8)
    history = PROMPT + sched.seqs["p"].generated[:4]
    assert sched.seqs["p"].generated == hf_llama.greedy(PROMPT, 14)
    assert sched.seqs["c"].generated[5:] == hf_llama.greedy(history + [child_next], 9)


def test_swap_out_and_in_round_trip_preserves_kv(hf_llama: HFModel) -> None:
    runner = make_runner(hf_llama.path, num_gpu_blocks=32, num_cpu_blocks=8)
    sched = Scheduler(runner_step(runner), num_gpu_blocks=32, block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 7)  # 16 tokens cached = 4 blocks
    st = sched.seqs["a"]
    old = sched.bm.block_table("a").block_ids
    assert len(old) == 4 and st.num_cached == 16
    cpu_ids = [6, 2, 7, 3]
    runner.step([], CacheOpsRequest(swap_out=list(zip(old, cpu_ids, strict=True))))
    runner.gpu_cache[:, :, old] = torch.randn_like(runner.gpu_cache[:, :, old])  # the blocks get reused
    new = [30, 21, 22, 25, 31, 29]  # the last two are fresh room for the next tokens
    # swap in to other GPU blocks as part of the next decode step (ops run before the forward)
    st.tokens.append(st.generated[-1])
    req = SequenceRequest("a", [st.tokens[-1]], new, st.num_cached)
    out = runner.step([req], CacheOpsRequest(swap_in=list(zip(cpu_ids, new, strict=False))))
    tokens = [out.outputs[0].token_id]
    for _ in range(6):
        pos = len(st.tokens)
        st.tokens.append(tokens[-1])
        tokens.append(runner.step([SequenceRequest("a", [tokens[-1]], new, pos)]).outputs[0].token_id)
    assert st.generated + tokens == hf_llama.greedy(PROMPT, 14)


def test_swap_out_copy_swap_in_in_one_step_run_in_that_order(runner: ModelRunner) -> None:
    g = runner.gpu_cache
    g[:, :, 1] = 1.0
    g[:, :, 2] = 2.0
    runner.cpu_cache[:, :, 5] = 5.0
    # swap_out reads block 1 before the copy overwrites it; swap_in lands after the copy.
    runner.step([], CacheOpsRequest(swap_out=[(1, 4)], copies=[(2, 1)], swap_in=[(5, 2)]))
    assert bool((runner.cpu_cache[:, :, 4] == 1.0).all())
    assert bool((g[:, :, 1] == 2.0).all())
    assert bool((g[:, :, 2] == 5.0).all())


@pytest.mark.parametrize(
    ("req", "ops", "match"),
    [
        (SequenceRequest("x", [1, 2, 3, 4, 5], [0], 0), CacheOpsRequest(), "need 2 blocks"),
        (SequenceRequest("x", [1], [64], 0), CacheOpsRequest(), "block id 64"),
        (SequenceRequest("x", [500], [0], 0), CacheOpsRequest(), "vocab_size"),
        (SequenceRequest("x", [], [0], 0), CacheOpsRequest(), "no new token"),
        (SequenceRequest("x", [1], [0], 0), CacheOpsRequest(swap_in=[(16, 0)]), "ops.swap_in"),
        (
            SequenceRequest("x", [1], [0], 0, sampling=SamplingParams(logit_bias=((500, 1.0),))),
            CacheOpsRequest(),
            "sampling.logit_bias token id 500",
        ),
        (
            SequenceRequest("x", [1], [0], 0, sampling=SamplingParams(presence_penalty=3.0)),
            CacheOpsRequest(),
            "sampling.presence_penalty",
        ),
        (SequenceRequest("x", [1], [0], 0, allowed_token_mask=b"\xff" * 4), CacheOpsRequest(), "needs 16"),
        (
            SequenceRequest("x", [1], [0], 0, allowed_token_mask=bytes(16)),
            CacheOpsRequest(),
            "allows no token",
        ),
        (
            SequenceRequest("x", [1], [0], 0, history=TokenHistory((4, 4), (1, 2))),
            CacheOpsRequest(),
            "repeats a token",
        ),
        (
            SequenceRequest("x", [1], [0], 0, history=TokenHistory((4,), (1,), (600,))),
            CacheOpsRequest(),
            "history token id 600",
        ),
        (SequenceRequest("x", [1], [0], 0), CacheOpsRequest(copies=[(1, 3), (2, 3)]), "twice"),
        (SequenceRequest("x", [1], [0], 0, decode_steps=65), CacheOpsRequest(), r"not in \[1, 64\]"),
        (SequenceRequest("x", [1, 2], [0], 0, decode_steps=2), CacheOpsRequest(), "needs one new token"),
        (SequenceRequest("x", [1], [0], 2, decode_steps=3), CacheOpsRequest(), "write up to 5 tokens"),
        (
            SequenceRequest("x", [1], [0], 0, decode_steps=2, return_logits=True),
            CacheOpsRequest(),
            "combined with return_logits",
        ),
        (
            SequenceRequest("x", [1], [0], 0, decode_steps=2, history=TokenHistory((4,), (1,))),
            CacheOpsRequest(),
            "combined with a token history",
        ),
        (
            SequenceRequest("x", [1], [0], 0, decode_steps=2, allowed_token_mask=b"\xff" * 16),
            CacheOpsRequest(),
            "combined with an allowed_token_mask",
        ),
        (SequenceRequest("x", [1, 2], [0], 0, prompt_logprobs=21), CacheOpsRequest(), "over 20"),
        (
            SequenceRequest("x", [1, 2], [0], 0, next_prompt_token=3),
            CacheOpsRequest(),
            "next_prompt_token_id without prompt_logprobs",
        ),
        (
            SequenceRequest("x", [1, 2], [0], 0, prompt_logprobs=0, next_prompt_token=500),
            CacheOpsRequest(),
            "next_prompt_token_id 500",
        ),
        (
            SequenceRequest("x", [1], [0], 0, decode_steps=2, prompt_logprobs=0),
            CacheOpsRequest(),
            "combined with prompt_logprobs",
        ),
        # after a swap-out, so "before anything runs" covers the ops too
        (
            SequenceRequest("x", [1], [0], 0),
            CacheOpsRequest(swap_out=[(5, 0)], copies=[(1, 3), (3, 4)]),
            "also a source",
        ),
    ],
)
def test_invalid_steps_are_rejected_before_anything_runs(
    runner: ModelRunner, req: SequenceRequest, ops: CacheOpsRequest, match: str
) -> None:
    before = runner.gpu_cache.clone()
    with pytest.raises(InvalidStep, match=match):
        runner.step([req, SequenceRequest("ok", [1, 2], [3], 0)], ops)
    assert torch.equal(runner.gpu_cache, before)


def test_prompt_logprobs_score_every_position_across_chunks_as_transformers(
    runner: ModelRunner, hf_llama: HFModel
) -> None:
    """A prompt in two chunks asks for prompt logprobs beside a decoding sequence that does not: the
    first chunk's last position scores the next chunk's first token (next_prompt_token), the second
    chunk's positions score its own later tokens, so every prompt token after the first is scored
    once, with transformers' log-softmax, vLLM's rank and the top tokens; the sequence beside it,
    and the sampled token itself, are what they are without prompt logprobs."""
    blocks = list(range(20, 23))
    other = SequenceRequest("d", [9, 8, 7], [30], 0)
    runner.step([other])
    first = SequenceRequest("p", PROMPT[:6], blocks, 0, prompt_logprobs=3, next_prompt_token=PROMPT[6])
    decode = SequenceRequest("d", [1], [30], 3)
    a, d = runner.step([first, decode]).outputs
    assert d.prompt_logprobs == []
    last = SequenceRequest("p", PROMPT[6:], blocks, 6, prompt_logprobs=3)
    b = runner.step([last]).outputs[0]
    scored = a.prompt_logprobs + b.prompt_logprobs
    assert [x.token_id for x in scored] == PROMPT[1:]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_llama.model(torch.tensor([PROMPT])).logits[0].float(), -1)  # type: ignore[operator]
    for pos, x in enumerate(scored):
        row = ref[pos]
        assert x.logprob == pytest.approx(float(row[x.token_id]), abs=1e-4)
        assert x.rank == int((row >= row[x.token_id]).sum())
        assert [t for t, _ in x.top] == row.topk(3).indices.tolist()
        assert [lp for _, lp in x.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    # The token drawn after the prompt, and the other sequence's, are those of plain steps.
    runner.step([SequenceRequest("q", PROMPT[:6], list(range(40, 43)), 0)])
    plain = runner.step([SequenceRequest("q", PROMPT[6:], list(range(40, 43)), 6)]).outputs[0]
    assert (b.token_id, b.logprob) == pytest.approx((plain.token_id, plain.logprob), abs=1e-5)
    assert d.token_id == runner.step([SequenceRequest("e", [9, 8, 7, 1], [31], 0)]).outputs[0].token_id


def test_tied_head_model(tmp_path: object) -> None:
    from tests.worker_svc.conftest import build_hf_model

    hf = build_hf_model(tmp_path, seed=3, tie_word_embeddings=True, rope_scaling=None)  # type: ignore[arg-type]
    runner = make_runner(hf.path)
    sched = Scheduler(runner_step(runner), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 12)
    assert sched.seqs["a"].generated == hf.greedy(PROMPT, 12)


def test_triton_kernels_in_the_interpreter_agree_with_reference(
    hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tiny run through the Triton kernels (interpreted on CPU): same tokens, close logits."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py on CPU)")
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", backend)
        r = make_runner(hf_llama.path, num_gpu_blocks=8, num_cpu_blocks=0)
        from pagedkv import kernels

        assert kernels.backend_for(r.gpu_cache) == backend
        sched = Scheduler(runner_step(r), num_gpu_blocks=8, block_size=BLOCK)
        sched.add("a", PROMPT[:6])
        sched.generate(["a"], 3)
        st = sched.seqs["a"]
        last = r.step(
            [
                SequenceRequest(
                    "a",
                    [st.generated[-1]],
                    sched.bm.block_table("a").block_ids + [7],
                    len(st.tokens),
                    return_logits=True,
                )
            ]
        ).outputs[0]
        results[backend] = (st.generated, last.logits)
    assert results["triton"][0] == results["reference"][0]
    torch.testing.assert_close(results["triton"][1], results["reference"][1], atol=1e-4, rtol=1e-4)


def test_prefill_gets_max_query_len_from_the_host(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer's prefill call is told the longest query run, so it never reads it off the device."""
    from pagedkv import kernels
    from pagedkv.kernels import backend

    seen: list[object] = []
    ops = backend.get(kernels.backend_for(runner.gpu_cache))  # the backend module the layers call
    real = ops.paged_prefill_attention

    def spy(*args: object, **kw: object) -> torch.Tensor:
        seen.append(kw.get("max_query_len"))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "paged_prefill_attention", spy)
    runner.step(
        [
            SequenceRequest("p", PROMPT, [20, 21, 22], 0),
            SequenceRequest("q", [4, 5, 6], [23], 0),
            SequenceRequest("d", [9], [24], 3),
        ]
    )
    assert seen == [len(PROMPT)] * runner.model.cfg.num_layers


def test_step_metadata_is_validated_once_per_step_not_per_layer(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block tables and lengths are checked (and the backend chosen) once per forward pass."""
    from pagedkv.kernels import checks

    calls: list[int] = []
    real = checks.block_tables_and_lens

    def spy(*args: object, **kw: object) -> object:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(checks, "block_tables_and_lens", spy)
    assert runner.model.cfg.num_layers > 1
    runner.step([SequenceRequest("p", PROMPT, [20, 21, 22], 0), SequenceRequest("d", [9], [24], 3)])
    assert len(calls) == 2  # prefill and decode metadata, once each for all layers


def test_close_waits_for_the_step_in_flight_then_refuses_steps(hf_llama: HFModel) -> None:
    """Shutdown must not unmap the cache under a running step: close() takes the step lock first."""
    import threading

    r = make_runner(hf_llama.path, num_gpu_blocks=8, num_cpu_blocks=0)
    in_forward, finish = threading.Event(), threading.Event()
    real_forward = r.model.forward
    events: list[str] = []

    def slow_forward(*args: object, **kw: object) -> torch.Tensor:
        in_forward.set()
        assert finish.wait(30)
        out = real_forward(*args, **kw)  # type: ignore[arg-type]
        events.append("forward done")
        return out

    r.model.forward = slow_forward  # type: ignore[method-assign]
    stepper = threading.Thread(target=lambda: r.step([SequenceRequest("s", PROMPT[:3], [0], 0)]))
    stepper.start()
    assert in_forward.wait(30)
    closer = threading.Thread(target=lambda: r.close(release=lambda: events.append("released")))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and events == []  # blocked behind the step
    finish.set()
    stepper.join(30)
    closer.join(30)
    assert events == ["forward done", "released"]
    assert r.gpu_cache.numel() == 0  # views dropped
    with pytest.raises(RunnerClosed):
        r.step([SequenceRequest("s", [1], [0], 3)])


def test_fork_samples_draw_from_the_prompt_row_as_their_own_steps_would(runner: ModelRunner) -> None:
    """n > 1: each forked sample's first token is what a step of its own (same prompt, its own seed)
    would draw; the parent's own token is unchanged by the forks."""
    parent = SamplingParams(temperature=1.0, seed=7)
    forks = [SamplingParams(temperature=1.0, seed=s) for s in (8, 9, 10)] + [SamplingParams()]
    out = runner.step(
        [
            SequenceRequest("p", PROMPT, [20, 21, 22], 0, sampling=parent, fork_sampling=forks),
            SequenceRequest("q", PROMPT[:5], [23, 24], 0),
        ]
    ).outputs
    assert len(out[0].fork_samples) == len(forks) and out[1].fork_samples == []
    alone = [
        runner.step([SequenceRequest("x", PROMPT, [30, 31, 32], 0, sampling=p)]).outputs[0]
        for p in [parent, *forks]
    ]
    assert (out[0].token_id, out[0].logprob) == pytest.approx((alone[0].token_id, alone[0].logprob), abs=1e-5)
    for drawn, ref in zip(out[0].fork_samples, alone[1:], strict=True):
        tok, lp = drawn.token_id, drawn.logprob
        assert tok == ref.token_id
        assert lp == pytest.approx(ref.logprob, abs=1e-5)
    assert len({d.token_id for d in out[0].fork_samples[:3]}) > 1, (
        "different seeds draw different tokens here"
    )
    with pytest.raises(InvalidStep, match=r"fork_sampling\[0\]"):
        runner.step(
            [SequenceRequest("p", PROMPT, [20, 21, 22], 0, fork_sampling=[SamplingParams(temperature=-1)])]
        )


def test_a_step_applies_each_sequences_penalties_with_its_history_forks_included(runner: ModelRunner) -> None:
    """Greedy with penalties: the token is the argmax of the step's own logits adjusted with the
    history sent along; a forked sample sees its parent's history; a plain neighbour is unaffected."""
    plain = runner.step([SequenceRequest("a", PROMPT, [40, 41, 42], 0, return_logits=True)]).outputs[0]
    assert plain.logits is not None
    top2 = plain.logits.topk(2).indices.tolist()
    history = TokenHistory(output_ids=(top2[0],), output_counts=(3,), prompt_ids=tuple(PROMPT))
    pen = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5)
    out = runner.step(
        [
            SequenceRequest("p", PROMPT, [20, 21, 22], 0, sampling=pen, fork_sampling=[pen], history=history),
            SequenceRequest("q", PROMPT, [23, 24, 25], 0),
        ]
    ).outputs
    want = int(adjust_logits(plain.logits[None], [pen], [history])[0].argmax())
    assert want != top2[0]  # the penalty moved the choice (else this test could not fail)
    assert out[0].token_id == want and out[0].fork_samples[0].token_id == want
    assert out[1].token_id == top2[0]
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(plain.logits, -1)[want]), abs=1e-5)


def test_a_grammar_mask_constrains_the_sequence_and_its_forks_only(runner: ModelRunner) -> None:
    plain = runner.step([SequenceRequest("a", PROMPT, [40, 41, 42], 0, return_logits=True)]).outputs[0]
    assert plain.logits is not None
    order = plain.logits.argsort(descending=True).tolist()
    allowed = {order[5], order[9]}  # not the model's favourite
    words = [0] * 4
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = b"".join(w.to_bytes(4, "little") for w in words)
    out = runner.step(
        [
            SequenceRequest(
                "p",
                PROMPT,
                [20, 21, 22],
                0,
                fork_sampling=[SamplingParams(temperature=1.0, seed=1)],
                allowed_token_mask=mask,
            ),
            SequenceRequest("q", PROMPT, [23, 24, 25], 0),
        ]
    ).outputs
    assert out[0].token_id == order[5] and out[0].fork_samples[0].token_id in allowed
    assert out[1].token_id == order[0]


def test_multi_step_decode_equals_as_many_single_steps(hf_llama: HFModel) -> None:
    """decode_steps: one call runs each sequence's decode steps on the tokens it draws; tokens,
    logprobs, top logprobs and the KV written are those of as many single steps (greedy, and seeded
    sampling, which draws by position), each sequence going as far as its own count; a stop token
    ends a sequence's steps at once, and the step counts the tokens it computed."""
    one, many = make_runner(hf_llama.path), make_runner(hf_llama.path)
    seeded = SamplingParams(temperature=0.9, seed=11, num_top_logprobs=3)
    prompts = {"g": (PROMPT, SamplingParams(), [0, 1, 2, 3]), "s": (PROMPT[:7], seeded, [4, 5, 6])}
    for r in (one, many):  # the prompts, one step each
        r.step([SequenceRequest(k, p[:-1], b, 0, sampling=sp) for k, (p, sp, b) in prompts.items()])
    singles: dict[str, list[tuple[int, float, list[tuple[int, float]]]]] = {"g": [], "s": []}
    counts = {"g": 5, "s": 3}
    for k, (p, sp, b) in prompts.items():
        last, pos = p[-1], len(p) - 1
        for _ in range(counts[k]):
            o = one.step([SequenceRequest(k, [last], b, pos, sampling=sp)]).outputs[0]
            singles[k].append((o.token_id, o.logprob, o.top))
            last, pos = o.token_id, pos + 1
    res = many.step(
        [
            SequenceRequest(k, [p[-1]], b, len(p) - 1, sampling=sp, decode_steps=counts[k])
            for k, (p, sp, b) in prompts.items()
        ]
    )
    assert res.num_tokens == 5 + 3
    for k, o in zip(prompts, res.outputs, strict=True):
        got = [(o.token_id, o.logprob, o.top)] + [(d.token_id, d.logprob, d.top) for d in o.next_samples]
        assert [g[0] for g in got] == [s[0] for s in singles[k]]
        for g, s in zip(got, singles[k], strict=True):
            assert g[1] == pytest.approx(s[1], abs=1e-5)
            assert [t for t, _ in g[2]] == [t for t, _ in s[2]]
    assert len(res.outputs[1].top) == 3
    torch.testing.assert_close(many.gpu_cache[:, :, :7], one.gpu_cache[:, :, :7])
    # A stop token: the sequence's steps end with the token that matched.
    p, sp, b = prompts["g"]
    stop = singles["g"][2][0]
    fresh = make_runner(hf_llama.path)
    fresh.step([SequenceRequest("g", p[:-1], b, 0)])
    o = fresh.step(
        [SequenceRequest("g", [p[-1]], b, len(p) - 1, decode_steps=5, stop_token_ids=frozenset({stop}))]
    )
    drawn = [o.outputs[0].token_id] + [d.token_id for d in o.outputs[0].next_samples]
    assert drawn == [s[0] for s in singles["g"]][: drawn.index(stop) + 1] and drawn[-1] == stop
    assert o.num_tokens == len(drawn)
