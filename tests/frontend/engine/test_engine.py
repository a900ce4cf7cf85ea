"""The engine end to end on a real local stack, against transformers' greedy generate().

fp32 on CPU with the torch reference kernels: prefix-cache hits, n=2 samples
(fork + copy-on-write), chunked prefill and forced preemption must all leave
the generated tokens exactly equal to the dense-cache oracle.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.frontend.engine import EngineConfig, GenerationRequest, SamplingOptions
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.worker_svc.conftest import HFModel, build_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("engine-llama"), seed=3)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


def stack(hf: HFModel, **kw: object) -> LocalStack:
    cfg = StackConfig(model=str(hf.path), device="cpu", dtype="float32", block_size=4, **kw)  # type: ignore[arg-type]
    return LocalStack(cfg)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 120) for _ in range(11)]  # shared prefix, not block aligned
    return [system + [rng.randrange(1, 120) for _ in range(rng.randint(1, 9))] for _ in range(count)]


def test_greedy_batch_with_shared_prefixes_and_two_samples_matches_transformers(hf: HFModel) -> None:
    ps = prompts(0, 4)
    reqs = [GenerationRequest(f"r{i}", p, max_tokens=10, n=2 if i % 2 else 1) for i, p in enumerate(ps)]
    with stack(hf, num_gpu_blocks=96) as st:
        engine = st.engine()
        first = engine.add_request(reqs[0])
        engine.step()  # r0's prompt is computed here; the next Step commits it before admitting the rest
        assert engine.stats.bm_round_trips == 1 and engine.stats.worker_steps == 1
        outs = [first] + engine.generate(reqs[1:])
        bm_stats = st.block_manager.servicer._core.stats()  # noqa: SLF001 - white-box check
        assert engine.stats.bm_round_trips <= engine.stats.steps  # never more than one per iteration
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 10)
        for c in out.completions:
            assert c.token_ids == expected, out.request_id
            assert c.finish_reason == "length"
    assert len(outs[1].completions) == 2
    assert engine.stats.prefix_hit_tokens > 0, "the shared system prompt should be reused"
    assert bm_stats.num_cow_copies > 0, "n=2 samples share the prompt's tail until they diverge"
    assert bm_stats.num_sequences == 0 and bm_stats.num_used_blocks == 0


def test_chunked_prefill_and_forced_preemption_keep_outputs_exact(hf: HFModel) -> None:
    ps = prompts(1, 5)
    reqs = [GenerationRequest(f"q{i}", p, max_tokens=14, n=2 if i == 2 else 1) for i, p in enumerate(ps)]
    # 20 blocks of 4 tokens cannot hold 6 sequences of ~30 tokens: someone must be preempted.
    with stack(hf, num_gpu_blocks=20) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8))
        outs = engine.generate(reqs)
        bm = st.block_manager.servicer._core  # noqa: SLF001
        bm.check_invariants()
        assert bm.stats().num_sequences == 0
    assert engine.stats.preempted_recompute + engine.stats.preempted_swap > 0
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 14)
        assert [c.token_ids for c in out.completions] == [expected] * len(out.completions), out.request_id


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_tokens_and_streaming(hf: HFModel, decode_steps: int) -> None:
    p = prompts(2, 1)[0]
    expected = hf.greedy(p, 8)
    stop = expected[3]
    with stack(hf, num_gpu_blocks=32) as st:
        engine = st.engine(EngineConfig(decode_steps=decode_steps))
        engine.add_request(GenerationRequest("s", p, max_tokens=8, stop_token_ids=(stop,)))
        events = list(engine.stream())
        engine.flush()
        bm = st.block_manager.servicer._core  # noqa: SLF001
        assert bm.stats().num_sequences == 0 and bm.stats().num_used_blocks == 0
    cut = expected.index(stop) + 1
    assert [e.token_id for e in events] == expected[:cut]
    assert [e.finish_reason for e in events] == [None] * (cut - 1) + ["stop"]


def test_multi_step_decode_matches_transformers_in_fewer_iterations(hf: HFModel) -> None:
    """decode_steps=4 on a live stack: the greedy tokens are transformers', a seeded sample's are
    those of single steps, a request arriving mid-run is admitted at once (nobody waits out a
    multi-step call to be admitted: it waits for one call at most), and far fewer iterations
    ran than tokens were generated."""
    ps = prompts(5, 3)
    seeded = SamplingOptions(temperature=0.8, seed=5)
    outs, iterations = {}, {}
    for steps in (1, 4):
        with stack(hf, num_gpu_blocks=64) as st:
            engine = st.engine(EngineConfig(decode_steps=steps))
            engine.add_request(GenerationRequest("g", ps[0], max_tokens=21))
            engine.add_request(GenerationRequest("s", ps[1], max_tokens=13, sampling=seeded))
            for _ in range(4):
                engine.step()
            late = engine.add_request(GenerationRequest("late", ps[2], max_tokens=9))
            engine.step()
            assert not engine.scheduler.waiting, "the late request was admitted in the next iteration"
            for _ in engine.stream():
                pass
            engine.flush()
            bm = st.block_manager.servicer._core  # noqa: SLF001
            assert bm.stats().num_sequences == 0 and bm.stats().num_used_blocks == 0
            outs[steps] = {r: engine.outputs[r].completions[0].token_ids for r in ("g", "s", "late")}
            stats = engine.stats
            assert late.completions[0].token_ids == hf.greedy(ps[2], 9)
        iterations[steps] = stats.steps
        assert (stats.multi_step_calls > 0 and stats.multi_step_tokens > 20) == (steps == 4)
    assert iterations[1] > 21 > 2 * iterations[4], iterations  # "g" alone makes 21 tokens
    assert outs[4]["g"] == outs[1]["g"] == hf.greedy(ps[0], 21)
    assert outs[4]["s"] == outs[1]["s"]


def test_overlapping_the_block_manager_keeps_one_decode_step_a_call(hf: HFModel) -> None:
    """overlap_block_manager reserves each sequence's next slot while the workers compute: one slot,
    so multi-step decode stays off with it (a call of four steps would write past the reservation),
    and the tokens are transformers' all the same."""
    ps = prompts(2, 3)
    with stack(hf, num_gpu_blocks=64) as st:
        engine = st.engine(EngineConfig(decode_steps=4, overlap_block_manager=True))
        outs = engine.generate([GenerationRequest(f"r{i}", p, max_tokens=11) for i, p in enumerate(ps)])
        assert engine.stats.multi_step_calls == 0 and engine.stats.multi_step_tokens == 0
        for p, out in zip(ps, outs, strict=True):
            assert out.completions[0].token_ids == hf.greedy(p, 11)


def test_bad_requests_are_rejected_before_touching_the_services(hf: HFModel) -> None:
    with stack(hf, num_gpu_blocks=8) as st:
        engine = st.engine()
        for req, fragment in [
            (GenerationRequest("a", [], max_tokens=1), "empty"),
            (GenerationRequest("a", [1], max_tokens=0), "max_tokens"),
            (GenerationRequest("a", [10_000], max_tokens=1), "token ids"),
            (GenerationRequest("a", [1] * 40, max_tokens=1), "never fit"),
            (GenerationRequest("a/b", [1], max_tokens=1), "request_id"),
        ]:
            with pytest.raises(ValueError, match=fragment):
                engine.add_request(req)
        assert not engine.has_work()


def test_a_prompt_above_the_watermark_is_refused_at_add_not_in_the_iteration(hf: HFModel) -> None:
    # 8 blocks of 4 tokens, half held back: a 24-token prompt (6 blocks) fits the pool with its output
    # but could never be admitted; before, it waited and then failed every request's iteration.
    with stack(hf, num_gpu_blocks=8, block_manager_overrides={"watermark_fraction": 0.5}) as st:
        engine = st.engine()
        with pytest.raises(ValueError, match="can never be admitted"):
            engine.add_request(GenerationRequest("big", [1] * 24, max_tokens=1))
        assert not engine.has_work()
        out = engine.generate([GenerationRequest("ok", [1] * 16, max_tokens=2, n=2)])
    assert [len(c.token_ids) for c in out[0].completions] == [2, 2]


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_round_trips_through_the_cpu_pool(hf: HFModel, mode: str) -> None:
    ps = prompts(4, 5)
    reqs = [GenerationRequest(f"w{i}", p, max_tokens=14, n=2 if i == 1 else 1) for i, p in enumerate(ps)]
    with stack(
        hf, num_gpu_blocks=20, num_cpu_blocks=64, block_manager_overrides={"preemption_mode": mode}
    ) as st:
        engine = st.engine(EngineConfig(max_batch_tokens=8))
        outs = engine.generate(reqs)
        bm = st.block_manager.servicer._core  # noqa: SLF001
        bm.check_invariants()
        stats = bm.stats()
    assert engine.stats.preempted_swap > 0
    assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    for p, out in zip(ps, outs, strict=True):
        expected = hf.greedy(p, 14)
        assert [c.token_ids for c in out.completions] == [expected] * len(out.completions), out.request_id


def test_burst_with_one_new_prefix_computes_it_once_and_the_rest_hit_it(hf: HFModel) -> None:
    """Requests arriving together with the same new prefix: the first computes it, the others are
    held back (frontend/engine/admission.py) until it is committed and then hit it; a request with another
    prefix behind them is not held. Only committed KV is a hit, so nothing reads unwritten blocks:
    outputs equal transformers'. At most one Step and one worker step per iteration."""
    p = prompts(5, 1)[0] + [7, 8, 9, 10, 11]  # 3+ full blocks of 4
    other = [(t + 50) % 120 + 1 for t in p]  # shares no first block with p
    with stack(hf, num_gpu_blocks=64) as st:
        engine = st.engine()
        together = [engine.add_request(GenerationRequest(f"t{i}", p, max_tokens=4)) for i in range(3)]
        unrelated = engine.add_request(GenerationRequest("other", other, max_tokens=4))
        engine.step()
        assert [s.request.request_id for s in engine.running_sequences()] == ["t0", "other"]
        assert engine.stats.admissions_held == 2
        for _ in engine.stream():
            pass
        core = st.block_manager.servicer._core  # noqa: SLF001
        core.check_invariants()
        assert core.stats().num_sequences == 0
    hit = (len(p) - 1) // 4 * 4
    assert [o.num_cached_tokens for o in together] == [0, hit, hit]
    assert unrelated.num_cached_tokens == 0
    for o in together:
        assert o.completions[0].token_ids == hf.greedy(p, 4), o.request_id
    assert unrelated.completions[0].token_ids == hf.greedy(other, 4)
    s = engine.stats
    assert s.prefix_hit_tokens == 2 * hit
    assert s.bm_round_trips <= s.steps and s.worker_steps <= s.steps


def test_finished_prefix_hint_is_not_trusted_after_the_cache_dropped_blocks(hf: HFModel) -> None:
    """A finished sequence's prefix is a hint only while the manager's prefix_cache_drops has not
    moved: after a ResetPrefixCache (here while the engine is idle, so no Step reply saw it), a
    burst sharing that prefix is held again, computes it once, and the rest hit it (before, the
    stale hint admitted the burst together and none of them hit)."""
    p = prompts(8, 1)[0] + [3, 4, 5, 6, 7]
    with stack(hf, num_gpu_blocks=96) as st:
        engine = st.engine()
        engine.generate([GenerationRequest("warm", p, max_tokens=2)])
        engine.bm.reset_prefix_cache()
        trips, held = engine.stats.bm_round_trips, engine.stats.admissions_held
        burst = [engine.add_request(GenerationRequest(f"b{i}", p + [i + 1], max_tokens=2)) for i in range(3)]
        engine.step()
        assert [s.request.request_id for s in engine.running_sequences()] == ["b0"]
        assert engine.stats.admissions_held == held + 2
        assert engine.stats.bm_round_trips == trips + 2  # the idle engine's refresh + the Step
        for _ in engine.stream():
            pass
        assert st.block_manager.servicer._core.stats().num_sequences == 0  # noqa: SLF001
    hit = len(p) // 4 * 4
    assert [o.num_cached_tokens for o in burst] == [0, hit, hit]
    for i, o in enumerate(burst):
        assert o.completions[0].token_ids == hf.greedy(p + [i + 1], 2), o.request_id


def test_overlap_mode_keeps_the_burst_prefix_hits(hf: HFModel) -> None:
    """overlap_block_manager reserves decode slots before their tokens are known, which stops the
    manager hashing a sequence; a sequence whose prompt's last chunk is in flight is not reserved
    early, so its prompt blocks are committed and the held burst still hits them (before: almost
    no hits in overlap mode)."""
    p = prompts(9, 1)[0] + [7, 8, 9, 10, 11]
    with stack(hf, num_gpu_blocks=64) as st:
        engine = st.engine(EngineConfig(overlap_block_manager=True))
        burst = [engine.add_request(GenerationRequest(f"t{i}", p + [i + 1], max_tokens=5)) for i in range(3)]
        for _ in engine.stream():
            pass
        core = st.block_manager.servicer._core  # noqa: SLF001
        core.check_invariants()
        assert core.stats().num_sequences == 0
    hit = len(p) // 4 * 4
    assert [o.num_cached_tokens for o in burst] == [0, hit, hit]
    assert engine.stats.slots_reserved_ahead > 0
    for i, o in enumerate(burst):
        assert o.completions[0].token_ids == hf.greedy(p + [i + 1], 5), o.request_id


def test_burst_whose_prefix_is_already_committed_is_not_held(hf: HFModel) -> None:
    """Holding only pays when someone is still computing the prefix: once it is committed, a burst
    of requests sharing it is admitted in one iteration, every one with hits."""
    p = prompts(6, 1)[0] + [3, 4, 5, 6, 7]
    with stack(hf, num_gpu_blocks=96) as st:
        engine = st.engine()
        engine.generate([GenerationRequest("warm", p, max_tokens=2)])
        held_before = engine.stats.admissions_held
        burst = [engine.add_request(GenerationRequest(f"b{i}", p + [i + 1], max_tokens=2)) for i in range(3)]
        engine.step()
        assert len(engine.running_sequences()) == 3
        assert engine.stats.admissions_held == held_before
        for _ in engine.stream():
            pass
    assert all(o.num_cached_tokens == len(p) // 4 * 4 for o in burst)
    for i, o in enumerate(burst):
        assert o.completions[0].token_ids == hf.greedy(p + [i + 1], 2), o.request_id


def test_generate_forgets_its_requests_so_batch_after_batch_does_not_grow(hf: HFModel) -> None:
    ps = prompts(4, 3)
    with stack(hf, num_gpu_blocks=96) as st:
        engine = st.engine()
        first = engine.generate([GenerationRequest(f"r{i}", p, max_tokens=4) for i, p in enumerate(ps)])
        assert engine.outputs == {} and engine.scheduler.seqs == {}
        # The caller keeps the outputs; the same ids can run again, with the same tokens.
        again = engine.generate([GenerationRequest(f"r{i}", p, max_tokens=4) for i, p in enumerate(ps)])
        assert engine.outputs == {} and engine.scheduler.seqs == {}
        assert st.block_manager.servicer._core.stats().num_sequences == 0  # noqa: SLF001
    for a, b, p in zip(first, again, ps, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids == hf.greedy(p, 4)


def _penalized_greedy(hf: HFModel, prompt: list[int], n: int, freq: float, presence: float) -> list[int]:
    """Greedy decoding with OpenAI's frequency/presence penalties over transformers' logits."""
    out: list[int] = []
    for _ in range(n):
        logits = hf.last_logits(prompt + out).clone()
        for t in set(out):
            logits[t] -= freq * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_logit_bias_through_the_engine_match_transformers(hf: HFModel) -> None:
    """The token history reaches the worker every step (penalized requests only): greedy output
    equals transformers' generate with its repetition penalty, and a reference loop applying
    frequency and presence penalties; a logit bias of -100 keeps a token out."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from pagedkv.frontend.engine import SamplingOptions

    p = prompts(5, 1)[0]
    plain = hf.greedy(p, 12)
    rep = SamplingOptions(repetition_penalty=1.6)
    freq = SamplingOptions(frequency_penalty=1.5, presence_penalty=0.5)
    banned = plain[0]
    bias = SamplingOptions(logit_bias=((banned, -100.0),))
    reqs = [
        GenerationRequest("rep", p, max_tokens=12, sampling=rep),
        GenerationRequest("freq", p, max_tokens=12, sampling=freq),
        GenerationRequest("bias", p, max_tokens=12, sampling=bias),
        GenerationRequest("plain", p, max_tokens=12),
    ]
    with stack(hf, num_gpu_blocks=96) as st:
        outs = {o.request_id: o.completions[0].token_ids for o in st.engine().generate(reqs)}
    with torch.inference_mode():
        want_rep = hf.model.generate(  # type: ignore[attr-defined]
            torch.tensor([p]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.6)]),
            pad_token_id=None,
            eos_token_id=None,
        )[0, len(p) :].tolist()
    want_freq = _penalized_greedy(hf, p, 12, 1.5, 0.5)
    assert outs["plain"] == plain
    assert outs["rep"] == want_rep and want_rep != plain
    assert outs["freq"] == want_freq and want_freq != plain
    assert banned not in outs["bias"]
