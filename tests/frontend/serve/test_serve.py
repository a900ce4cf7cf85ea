"""`pagedkv serve` through the official `openai` client: outputs equal transformers' greedy generate().

One in-process stack (block manager, cache host, worker; fp32 reference kernels) and one server
with a tokenizer built locally, for the whole module. Every request uses ignore_eos so that the
oracle (which never stops at EOS) and the server generate the same number of tokens.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.server import OpenAIServer
from tests.frontend.serve_fixtures import metric_samples, model_with_tokenizer, serving, stack_config
from tests.worker_svc.conftest import HFModel

openai = pytest.importorskip("openai")

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return model_with_tokenizer(tmp_path_factory.mktemp("serve-llama"))


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    with LocalStack(stack_config(hf, num_gpu_blocks=160)) as st:
        yield st


@pytest.fixture(scope="module")
def server(stack: LocalStack, hf: HFModel) -> Iterator[OpenAIServer]:
    with serving(stack, model=str(hf.path), model_name="tiny", max_num_seqs=32) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> object:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def bm_stats(stack: LocalStack):  # -> pb.Stats
    with BlockManagerClient(stack.block_manager_target) as bm:
        return bm.get_stats()


def wait_pool_empty(stack: LocalStack, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = bm_stats(stack)
        if s.num_sequences == 0 and s.num_used_blocks == 0:
            return
        assert time.monotonic() < deadline, (
            f"still allocated: {s.num_sequences} seqs, {s.num_used_blocks} blocks"
        )
        time.sleep(0.05)


def test_token_id_prompts_batch_and_usage(client, hf: HFModel, stack: LocalStack) -> None:
    prompts = [[5, 9, 17, 33, 2, 64, 7], [5, 9, 17, 33, 2, 64, 7, 100, 101, 11]]
    r = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=9, temperature=0, extra_body=NO_EOS
    )
    assert r.object == "text_completion" and r.model == "tiny"
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts, strict=True):
        assert c.token_ids == hf.greedy(p, 9)
        assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == 17 and r.usage.completion_tokens == 18
    # The second prompt extends the first: its first full blocks are prefix-cache hits.
    again = client.completions.create(
        model="tiny", prompt=prompts[1], max_tokens=2, temperature=0, extra_body=NO_EOS
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= 4
    wait_pool_empty(stack)


def test_cached_tokens_of_a_multi_prompt_request_is_the_sum_over_its_prompts(
    client, stack: LocalStack
) -> None:
    """Two prompts, each already in the prefix cache by a different amount: one request with both
    reports the sum (not the first's, the last's or the largest)."""
    a = [7, 21, 33, 45, 57, 69, 81, 93, 105, 117, 12, 24, 36]  # 3 full blocks of 4 + 1
    b = [8, 22, 34, 46, 58, 70, 82, 94, 106]  # 2 full blocks + 1
    alone = []
    for p in (a, b):
        client.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0, extra_body=NO_EOS)
        again = client.completions.create(
            model="tiny", prompt=p, max_tokens=1, temperature=0, extra_body=NO_EOS
        )
        alone.append(again.usage.prompt_tokens_details.cached_tokens)
    assert alone[0] != alone[1] and min(alone) > 0, alone
    both = client.completions.create(
        model="tiny", prompt=[a, b], max_tokens=1, temperature=0, extra_body=NO_EOS
    )
    assert both.usage.prompt_tokens_details.cached_tokens == sum(alone)
    assert both.usage.prompt_tokens == len(a) + len(b)
    streamed = list(
        client.completions.create(
            model="tiny",
            prompt=[a, b],
            max_tokens=1,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == sum(alone)
    wait_pool_empty(stack)


def test_n2_greedy_samples_both_match_and_seeded_sampling_reproduces(client, hf: HFModel) -> None:
    p = [3, 14, 15, 92, 65, 35]
    r = client.completions.create(model="tiny", prompt=p, max_tokens=8, n=2, temperature=0, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.token_ids for c in r.choices] == [hf.greedy(p, 8)] * 2
    kw = dict(
        model="tiny", prompt=p, max_tokens=8, n=2, temperature=1.0, top_p=0.9, seed=7, extra_body=NO_EOS
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert all(len(c.token_ids) == 8 for c in a.choices)


def test_penalties_logit_bias_and_min_p_reach_the_sampler(client, hf: HFModel, stack: LocalStack) -> None:
    """The SDK's own fields (presence/frequency penalty, logit_bias) and vLLM's (repetition_penalty,
    min_p) change what is generated as the reference says; nothing stays allocated."""
    p = [3, 14, 15, 92, 65, 35]
    plain = hf.greedy(p, 10)
    r = client.completions.create(
        model="tiny",
        prompt=p,
        max_tokens=10,
        temperature=0,
        frequency_penalty=-1.5,
        presence_penalty=-0.5,
        extra_body=NO_EOS,
    )
    want: list[int] = []
    for _ in range(10):
        logits = hf.last_logits(p + want).clone()
        for t in set(want):
            logits[t] -= -1.5 * want.count(t) - 0.5  # negative: repeating is encouraged
        want.append(int(logits.argmax()))
    assert r.choices[0].token_ids == want, (r.choices[0].token_ids, want, plain)
    assert want != plain
    forced = client.completions.create(
        model="tiny", prompt=p, max_tokens=4, temperature=1.0, logit_bias={"77": 100}, extra_body=NO_EOS
    )
    assert forced.choices[0].token_ids == [77] * 4
    rep = client.completions.create(
        model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body={**NO_EOS, "repetition_penalty": 0.3}
    )
    want = []
    for _ in range(10):  # < 1: the prompt's and the output's tokens are favoured
        logits = hf.last_logits(p + want).clone()
        seen = list(set(p + want))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 0.3, logits[seen] * 0.3)
        want.append(int(logits.argmax()))
    assert rep.choices[0].token_ids == want and want != plain
    # min_p = 1 keeps only the most likely token: sampling becomes greedy.
    top = client.completions.create(
        model="tiny", prompt=p, max_tokens=10, temperature=1.5, seed=3, extra_body={**NO_EOS, "min_p": 1.0}
    )
    assert top.choices[0].token_ids == plain
    wait_pool_empty(stack)


def test_logprobs_n_returns_the_models_top_alternatives(client, hf: HFModel, server: OpenAIServer) -> None:
    """logprobs=3 (completions) and top_logprobs=3: each position's 3 most likely tokens with their
    log-probabilities under transformers' model; streaming gives the same per chunk."""
    import torch

    p = [4, 8, 15, 16, 23, 42]
    r = client.completions.create(
        model="tiny", prompt=p, max_tokens=5, temperature=0, logprobs=3, extra_body=NO_EOS
    )
    ids = r.choices[0].token_ids
    assert ids == hf.greedy(p, 5)
    lp = r.choices[0].logprobs
    with torch.inference_mode():
        logits = hf.model(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float()  # type: ignore[attr-defined]
    ref = torch.log_softmax(logits, -1)
    tok = server.state.limits.text.tokenizer
    assert len(lp.top_logprobs) == 5
    for i, alts in enumerate(lp.top_logprobs):
        want_lp, want_ids = ref[i].topk(3)
        assert (
            list(alts) == [tok.decode([t]) for t in want_ids.tolist()] or len(set(alts)) < 3
        )  # same strings
        assert sorted(alts.values(), reverse=True) == pytest.approx(want_lp.tolist(), abs=1e-4)
        assert max(alts.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)  # greedy: the top one
    chunks = [
        c
        for c in client.completions.create(
            model="tiny", prompt=p, max_tokens=5, temperature=0, logprobs=3, stream=True, extra_body=NO_EOS
        )
        if c.choices
    ]
    assert len(chunks) == 5
    for c, alts in zip(
        chunks, lp.top_logprobs, strict=False
    ):  # (the second run hits the prefix cache: fp32 rounding differs)
        got = c.choices[0].logprobs.top_logprobs[0]
        assert list(got) == list(alts) and list(got.values()) == pytest.approx(list(alts.values()), abs=1e-4)


def test_streaming_one_token_per_chunk(client, hf: HFModel, server: OpenAIServer) -> None:
    p = [7, 7, 8, 21, 34, 55, 89]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    token_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].token_ids for c in token_chunks] == [[t] for t in hf.greedy(p, 10)]
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 9 + ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    text = "".join(c.choices[0].text for c in token_chunks)
    tok = server.state.limits.text.tokenizer
    assert text == tok.decode(hf.greedy(p, 10), skip_special_tokens=True)


def test_text_prompt_stop_string_and_chat(client, hf: HFModel, server: OpenAIServer) -> None:
    tok = server.state.limits.text.tokenizer
    text = "w40 w41 w99 w7 w8 w77"
    ids = tok.encode(text)
    assert ids == [40, 41, 99, 7, 8, 77]
    expected = hf.greedy(ids, 8)
    r = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].token_ids == expected
    assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    # A stop string: the text ends before it, finish_reason "stop", nothing generated past it.
    stop_at = next(i for i, t in enumerate(expected) if t >= 6 and i >= 2)
    stop = f"w{expected[stop_at]}"
    s = client.completions.create(
        model="tiny", prompt=text, max_tokens=8, temperature=0, stop=[stop], extra_body=NO_EOS
    )
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].token_ids == expected[: stop_at + 1]
    assert s.choices[0].text == tok.decode(expected[:stop_at], skip_special_tokens=True) + " "
    # Chat: the template's prompt, then the same greedy tokens as transformers on it.
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w50 w51 w52"}]
    chat_ids = [
        int(t)
        for t in tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    ]
    c = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    assert c.object == "chat.completion"
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].token_ids == hf.greedy(chat_ids, 6)
    assert c.choices[0].message.content == tok.decode(hf.greedy(chat_ids, 6), skip_special_tokens=True)
    stream = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True, extra_body=NO_EOS
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == c.choices[0].message.content
    # Chat logprobs with top_logprobs: the chosen token is the most likely alternative (greedy).
    lc = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    content = lc.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in hf.greedy(chat_ids, 6)]
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_models_health_and_eos(client, hf: HFModel, server: OpenAIServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200
    # Without ignore_eos the config's eos_token_id (2) stops generation, as transformers would.
    p = [5, 9, 17, 33]
    with_eos = hf.model.generate(  # type: ignore[attr-defined]
        __import__("torch").tensor([p]),
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )[0, len(p) :].tolist()
    r = client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0)
    assert r.choices[0].token_ids == with_eos
    assert r.choices[0].finish_reason == ("stop" if with_eos[-1] == 2 else "length")


def _post_json(server: OpenAIServer, path: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_in_vllms_shapes(client, server: OpenAIServer) -> None:
    """The server's own tokenizer and chat template: a chat tokenized here is the prompt a chat
    request is charged for (usage.prompt_tokens)."""
    status, out = _post_json(
        server, "/tokenize", {"model": "tiny", "prompt": "w7 w8 w9", "return_token_strs": True}
    )
    assert status == 200, out
    assert out == {"count": 3, "max_model_len": 512, "tokens": [7, 8, 9], "token_strs": ["w7", "w8", "w9"]}
    _, plain = _post_json(server, "/tokenize", {"prompt": "w7 w8 w9", "add_special_tokens": False})
    assert plain["tokens"] == [7, 8, 9] and plain["token_strs"] is None  # this tokenizer adds no BOS
    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w7 w8"}]
    _, chat = _post_json(server, "/tokenize", {"model": "tiny", "messages": messages})
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == len(chat["tokens"]) == r.usage.prompt_tokens
    _, no_gen = _post_json(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_gen["tokens"] == chat["tokens"][:-1]  # the template's "assistant"
    status, out = _post_json(server, "/detokenize", {"model": "tiny", "tokens": [7, 8, 9]})
    assert status == 200 and out == {"prompt": "w7 w8 w9"}
    for path, body, param in (
        ("/detokenize", {"tokens": [7, 128]}, "tokens"),
        ("/detokenize", {"tokens": "7"}, "tokens"),
        ("/tokenize", {"prompt": "w7", "messages": messages}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "w7", "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"model": "other", "prompt": "w7"}, "model"),
    ):
        status, out = _post_json(server, path, body)
        assert status in (400, 404) and out["error"]["param"] == param, (path, body, out)


def test_16_concurrent_streaming_clients_are_batched(
    server: OpenAIServer, hf: HFModel, stack: LocalStack
) -> None:
    before = metric_samples(
        urllib.request.urlopen(server.url + "/metrics").read().decode(), "pagedkv_iteration_requests_bucket"
    )
    prompts = [[(i * 7 + j * 3) % 120 + 6 for j in range(5 + i % 7)] for i in range(16)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def one(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            start.wait()
            toks: list[int] = []
            for ch in c.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, stream=True, extra_body=NO_EOS
            ):
                toks.extend(ch.choices[0].token_ids)
            results[i] = toks
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i, p in enumerate(prompts):
        assert results[i] == hf.greedy(p, 12), i
    after = metric_samples(
        urllib.request.urlopen(server.url + "/metrics").read().decode(), "pagedkv_iteration_requests_bucket"
    )
    total = after['{le="+Inf",model_name="tiny"}'] - before.get('{le="+Inf",model_name="tiny"}', 0)
    single = after['{le="1.0",model_name="tiny"}'] - before.get('{le="1.0",model_name="tiny"}', 0)
    assert total - single > 0, "no engine iteration gave tokens to more than one request"
    assert after['{le="4.0",model_name="tiny"}'] < after['{le="+Inf",model_name="tiny"}'], (
        "16 concurrent clients should share iterations with more than 4 requests"
    )
    wait_pool_empty(stack)


def test_metrics_names_and_vllm_names(stack: LocalStack, server: OpenAIServer) -> None:
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    for name in (
        "pagedkv_num_requests_waiting",
        "pagedkv_num_requests_running",
        "pagedkv_kv_cache_usage_perc",
        "pagedkv_time_to_first_token_seconds_bucket",
        "pagedkv_time_per_output_token_seconds_bucket",
        "pagedkv_e2e_request_latency_seconds_bucket",
        "pagedkv_kv_cache_used_blocks",
        "pagedkv_prefix_cache_hits_total",
        "pagedkv_prefix_cache_queries_total",
    ):
        assert name in text, name
    assert "vllm:" not in text
    usage = metric_samples(text, "pagedkv_kv_cache_usage_perc")
    assert all(0.0 <= v <= 1.0 for v in usage.values())
    # The weights the worker computes with (the built-in model: dense fp32), as its GetWorkerInfo says.
    runner = stack.workers[0].servicer.runner
    assert runner is not None
    weights = metric_samples(text, "pagedkv_model_weight_bytes")
    assert len(weights) == 1 and 'weight_format="auto"' in next(iter(weights))
    assert next(iter(weights.values())) == runner.model.weight_bytes > 0
    with serving(stack, model_name="tiny", metrics_vllm_names=True) as other:
        c = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0)
        c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0, extra_body=NO_EOS)
        text = urllib.request.urlopen(other.url + "/metrics").read().decode()
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text, name
    assert metric_samples(text, "vllm:e2e_request_latency_seconds_count") == {'{model_name="tiny"}': 1.0}


def test_readme_openai_example_runs(server: OpenAIServer, capsys: pytest.CaptureFixture[str]) -> None:
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    snippet = next(
        b
        for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if "from openai" in b and "token_ids" in b
    )
    code = snippet.replace("http://127.0.0.1:8000", server.url).replace(
        'model="pagedkv-tiny-default"', 'model="tiny"'
    )
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    lines = capsys.readouterr().out.splitlines()
    # One token per chunk; up to 16 (the tiny model may sample its EOS, id 2, earlier).
    assert 1 <= len(lines) <= 16 and all(re.fullmatch(r"\[\d+\]", line) for line in lines)
