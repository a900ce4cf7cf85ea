"""`pagedkv serve` refusing what it must: bad input for every field, unknown models, overload (503
with Retry-After), missing API keys, and a client that disconnects mid-stream. After each, the
block manager's GetStats shows nothing left allocated.

The server here has no tokenizer (token ids only) and a small pool: 64 blocks of 4 tokens.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.server import OpenAIServer
from tests.frontend.serve_fixtures import metric_samples, serving, stack_config
from tests.worker_svc.conftest import HFModel, build_hf_model

openai = pytest.importorskip("openai")
KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    hf: HFModel = build_hf_model(tmp_path_factory.mktemp("serve-errors-llama"), seed=5)
    with LocalStack(stack_config(hf, num_gpu_blocks=64)) as st:
        yield st


@pytest.fixture(scope="module")
def server(stack: LocalStack) -> Iterator[OpenAIServer]:
    with serving(stack, model_name="tiny", api_key=KEY) as srv:
        yield srv


def post(
    server: OpenAIServer,
    path: str,
    body: object,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request(
        "POST", path, body=data, headers={"Content-Type": "application/json", **AUTH, **(headers or {})}
    )
    r = conn.getresponse()
    payload = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, payload, {k.lower(): v for k, v in r.getheaders()}


def get(server: OpenAIServer, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def assert_pool_empty(stack: LocalStack, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with BlockManagerClient(stack.block_manager_target) as bm:
        while True:
            s = bm.get_stats()
            if s.num_sequences == 0 and s.num_used_blocks == 0:
                return
            assert time.monotonic() < deadline, (
                f"left allocated: {s.num_sequences} seqs, {s.num_used_blocks} blocks"
            )
            time.sleep(0.05)


GOOD = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}

# (field overrides, bad param, words the message must contain). 64 blocks x 4 tokens = 256 tokens.
BAD_FIELDS = [
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": 5}, "prompt", "expected"),
    ({"prompt": [1, "a"]}, "prompt", "integer token ids"),
    ({"prompt": [1, 2.5]}, "prompt", "integer token ids"),
    ({"prompt": [1, True]}, "prompt", "integer token ids"),
    ({"prompt": [1, 128]}, "prompt", "out of range"),
    ({"prompt": [-1]}, "prompt", "out of range"),
    ({"prompt": "hello"}, "prompt", "tokenizer"),
    ({"prompt": [1] * 300}, "prompt", "do not fit"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": "4"}, "max_tokens", "integer"),
    ({"max_tokens": 4.5}, "max_tokens", "integer"),
    ({"max_tokens": 254}, "max_tokens", "exceeds"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"top_k": 1000}, "top_k", "vocabulary"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 65}, "n", "less than or equal to 64"),
    ({"n": True}, "n", "integer"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"stop": "x"}, "stop", "tokenizer"),
    ({"stop": [""]}, "stop", "empty"),
    ({"stop": 5}, "stop", "string"),
    ({"stop_token_ids": [500]}, "stop_token_ids", "out of range"),
    ({"stop_token_ids": "1"}, "stop_token_ids", "list"),
    ({"ignore_eos": "no"}, "ignore_eos", "boolean"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": "1"}, "repetition_penalty", "number"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"128": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1, 2]}, "logit_bias", "dictionary"),
    ({"echo": True, "logprobs": 1}, "echo", "not supported together with logprobs"),
    ({"best_of": 3}, "best_of", "best_of == n"),
    ({"model": 7}, "model", "string"),
]


@pytest.mark.parametrize(
    "override,param,words", BAD_FIELDS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_FIELDS)]
)
def test_bad_field_is_400_naming_it(server: OpenAIServer, override: dict, param: str, words: str) -> None:
    status, body, _ = post(server, "/v1/completions", {**GOOD, **override})
    assert status == 400, body
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"], body["error"]["message"]
    assert body["error"]["message"].startswith(param)


def test_penalties_and_echo_false_are_accepted(server: OpenAIServer) -> None:
    """Penalties, min_p and logit_bias are served, the neutral values (what clients send by default)
    and ints included."""
    for neutral in (
        {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1},
        {"repetition_penalty": 1.0, "echo": False},
        {"presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.3, "min_p": 0.1},
        {"logit_bias": {"5": -100, "7": 2.5}, "temperature": 1.0, "seed": 1},
    ):
        status, body, _ = post(server, "/v1/completions", {**GOOD, **neutral})
        assert status == 200, body
        assert len(body["choices"][0]["token_ids"]) >= 1


def test_a_request_filling_the_context_exactly_runs_one_more_token_is_refused(
    server: OpenAIServer, stack: LocalStack
) -> None:
    """64 blocks x 4 = 256 tokens per sequence: prompt 200 + max_tokens 56 runs to its end."""
    body = {**GOOD, "prompt": [1 + i % 100 for i in range(200)], "ignore_eos": True, "temperature": 0}
    status, out, _ = post(server, "/v1/completions", {**body, "max_tokens": 56})
    assert status == 200, out
    assert len(out["choices"][0]["token_ids"]) == 56 and out["choices"][0]["finish_reason"] == "length"
    status, out, _ = post(server, "/v1/completions", {**body, "max_tokens": 57})
    assert status == 400 and out["error"]["param"] == "max_tokens", out
    assert "257 exceeds the 256 tokens" in out["error"]["message"]
    assert_pool_empty(stack)


def test_bad_requests_leave_nothing_allocated(server: OpenAIServer, stack: LocalStack) -> None:
    for override, _, _ in BAD_FIELDS:
        post(server, "/v1/completions", {**GOOD, **override, "stream": override.get("stream", False)})
    for raw in (b"{not json", b"[1, 2]", b""):
        status, body, _ = post(server, "/v1/completions", None, raw=raw)
        assert status == 400 and body["error"]["message"], raw
    status, body, _ = post(
        server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert (
        status == 400 and body["error"]["param"] == "messages" and "chat template" in body["error"]["message"]
    )
    status, body, _ = post(server, "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body, _ = post(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "top_logprobs": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert (
        status == 400
        and body["error"]["param"] == "top_logprobs"
        and "logprobs: true" in body["error"]["message"]
    )
    status, body, _ = post(
        server,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "logprobs": True,
            "top_logprobs": 21,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    assert_pool_empty(stack)
    # And the server still serves.
    status, body, _ = post(server, "/v1/completions", {**GOOD, "temperature": 0})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 4
    assert_pool_empty(stack)


def test_unknown_model_is_404_and_openai_client_sees_the_errors(server: OpenAIServer) -> None:
    status, body, _ = post(server, "/v1/completions", {**GOOD, "model": "gpt-4"})
    assert (
        status == 404 and body["error"]["code"] == "model_not_found" and "gpt-4" in body["error"]["message"]
    )
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=9)
    assert "temperature" in str(e.value)


def test_api_key_on_every_route_but_health(server: OpenAIServer) -> None:
    for path in ("/v1/models", "/metrics"):
        assert get(server, path)[0] == 401
        assert get(server, path, {"Authorization": "Bearer wrong"})[0] == 401
        assert get(server, path, AUTH)[0] == 200
    status, body, _ = post(server, "/v1/completions", GOOD, headers={"Authorization": "Bearer nope"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get(server, "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def open_stream(server: OpenAIServer, body: dict) -> socket.socket:
    """A raw streaming request; returns the socket after the first token chunk arrived."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    got = b""
    while b"data: {" not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return sock


def counter(server: OpenAIServer, name: str, label: str = "") -> float:
    text = get(server, "/metrics", AUTH)[1].decode()
    return sum(v for k, v in metric_samples(text, name).items() if label in k)


def test_disconnect_mid_stream_aborts_and_frees(server: OpenAIServer, stack: LocalStack) -> None:
    before = counter(server, "pagedkv_generation_tokens_total")
    aborts = counter(server, "pagedkv_request_success_total", 'finished_reason="abort"')
    sock = open_stream(
        server,
        {
            "model": "tiny",
            "prompt": [4, 5, 6, 7, 8],
            "max_tokens": 240,
            "temperature": 0,
            "ignore_eos": True,
            "n": 2,
        },
    )
    sock.close()
    assert_pool_empty(stack)
    produced = counter(server, "pagedkv_generation_tokens_total") - before
    assert produced < 2 * 240, f"the request ran to the end ({produced} tokens) instead of being aborted"
    assert counter(server, "pagedkv_request_success_total", 'finished_reason="abort"') == aborts + 1


def test_disconnect_during_a_non_streaming_request_aborts_and_frees(
    server: OpenAIServer, stack: LocalStack
) -> None:
    """No token can fail to send here: the server must see the connection close while it waits."""
    before = counter(server, "pagedkv_generation_tokens_total")
    aborts = counter(server, "pagedkv_request_success_total", 'finished_reason="abort"')
    body = {
        "model": "tiny",
        "prompt": [4, 5, 6, 7, 9],
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    deadline = time.monotonic() + 30
    while counter(server, "pagedkv_generation_tokens_total") == before:  # it runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    assert_pool_empty(stack)
    produced = counter(server, "pagedkv_generation_tokens_total") - before
    assert produced < 2 * 240, f"the request ran to the end ({produced} tokens) instead of being aborted"
    assert counter(server, "pagedkv_request_success_total", 'finished_reason="abort"') == aborts + 1
    # The server still answers (the aborted handler ended cleanly).
    status, out, _ = post(server, "/v1/completions", GOOD)
    assert status == 200, out


def _request(
    server: OpenAIServer, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(method, path, body=body or None, headers=headers)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}


def test_cors_only_for_the_allowed_origins(stack: LocalStack, server: OpenAIServer) -> None:
    app, other = "https://app.example.com", "https://evil.example.com"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    body = json.dumps(GOOD).encode()
    post_headers = {"Content-Type": "application/json", "Origin": app}
    with serving(stack, model_name="tiny", api_key=KEY, allowed_origins=f"{app}, https://b.example") as srv:
        # The browser's preflight carries no key: answered, for the allowed origin only.
        status, h = _request(srv, "OPTIONS", "/v1/completions", {"Origin": app, **preflight})
        assert status == 200 and h["access-control-allow-origin"] == app
        assert "authorization" in h["access-control-allow-headers"].lower()
        status, h = _request(srv, "OPTIONS", "/v1/completions", {"Origin": other, **preflight})
        assert status == 400 and "access-control-allow-origin" not in h
        status, h = _request(srv, "POST", "/v1/completions", {**post_headers, **AUTH}, body)
        assert status == 200 and h["access-control-allow-origin"] == app
        status, h = _request(
            srv, "POST", "/v1/completions", post_headers, body
        )  # no key: the page can read the 401
        assert status == 401 and h["access-control-allow-origin"] == app
        status, h = _request(srv, "POST", "/v1/completions", {**post_headers, **AUTH, "Origin": other}, body)
        assert status == 200 and "access-control-allow-origin" not in h
    # Without --allowed-origins: no CORS headers; a preflight is just an unauthenticated request.
    status, h = _request(server, "OPTIONS", "/v1/completions", {"Origin": app, **preflight})
    assert status == 401 and "access-control-allow-origin" not in h
    status, h = _request(server, "POST", "/v1/completions", {**post_headers, **AUTH}, body)
    assert status == 200 and "access-control-allow-origin" not in h


def test_tokenize_without_a_tokenizer_is_400(server: OpenAIServer) -> None:
    status, body, _ = post(server, "/tokenize", {"prompt": "hello"})
    assert status == 400 and "no tokenizer" in body["error"]["message"]
    status, body, _ = post(server, "/detokenize", {"tokens": [1, 2]})
    assert status == 400 and "no tokenizer" in body["error"]["message"]


def test_over_max_waiting_is_503_with_retry_after(stack: LocalStack) -> None:
    with serving(stack, model_name="tiny", max_num_seqs=1, max_waiting=1) as srv:
        # The tiny model makes 200 tokens in well under a second: pace the engine (10 ms an
        # iteration) so the long request surely still holds the slot when the third one arrives.
        step = srv.loop.engine.step
        srv.loop.engine.step = lambda: (time.sleep(0.01), step())[1]  # type: ignore[method-assign]
        long = {"model": "tiny", "prompt": [9, 9, 9], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        sock = open_stream(srv, long)  # runs: the one sequence slot is taken
        waiter_status: list[int] = []
        t = threading.Thread(
            target=lambda: waiter_status.append(post(srv, "/v1/completions", {**GOOD, "temperature": 0})[0])
        )
        t.start()
        deadline = time.monotonic() + 10
        while srv.loop.num_waiting() < 1:
            assert time.monotonic() < deadline, "the second request never waited"
            time.sleep(0.01)
        status, body, headers = post(srv, "/v1/completions", GOOD)
        assert status == 503, body
        assert headers.get("retry-after") == "1"
        assert "busy" in body["error"]["message"]
        sock.close()  # frees the slot: the waiting request runs
        t.join(30)
        assert waiter_status == [200]
    assert_pool_empty(stack)


def test_tls_and_mutual_tls_and_no_plaintext_off_loopback(stack: LocalStack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil
    import ssl
    import subprocess
    from pathlib import Path

    from pagedkv.frontend.serve.settings import ServeSettings
    from pagedkv.tls import TlsConfigError

    with pytest.raises(TlsConfigError, match="non-loopback"):
        OpenAIServer(
            ServeSettings(
                host="0.0.0.0",
                port=0,
                block_manager=stack.block_manager_target,
                workers=",".join(stack.worker_targets),
            )
        )
    if shutil.which("openssl") is None:
        pytest.importorskip("cryptography")
    tools = Path(__file__).resolve().parents[3] / "tools"
    subprocess.run(["bash", str(tools / "make_certs.sh"), str(tmp_path)], check=True, capture_output=True)
    c = {
        k: tmp_path / v
        for k, v in {
            "ca": "ca.pem",
            "server": "server.pem",
            "server_key": "server.key",
            "client": "client.pem",
            "client_key": "client.key",
        }.items()
    }
    with serving(
        stack,
        model_name="tiny",
        tls_cert=str(c["server"]),
        tls_key=str(c["server_key"]),
        tls_client_ca=str(c["ca"]),
    ) as srv:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(c["ca"]))
        ctx.load_cert_chain(str(c["client"]), str(c["client_key"]))
        conn = http.client.HTTPSConnection("127.0.0.1", srv.port, context=ctx, timeout=30)
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == "tiny"
        conn.close()
        no_cert = ssl.create_default_context(cafile=str(c["ca"]))
        conn = http.client.HTTPSConnection("127.0.0.1", srv.port, context=no_cert, timeout=30)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            conn.request("GET", "/v1/models")
            conn.getresponse().read()
        conn.close()


def test_outbound_bearer_token_to_the_block_manager(
    stack: LocalStack, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The server's own gRPC connections take the client token (PAGEDKV_TOKEN / --token-file)."""
    from pagedkv.auth import hash_token
    from pagedkv.dial import InsecureTokenError
    from pagedkv.frontend.serve.settings import ServeSettings

    token = "tok-frontend-0123456789"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tenants": [{"name": "frontend", "token_sha256": hash_token(token)}]}))
    from pagedkv.block_manager_svc.server import start_server
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    # The stack's workers keep their own (open) block manager; the frontend's engine allocates from a
    # second one with the same geometry that requires a token (only the engine talks to it).
    geometry = stack.block_manager.servicer._core.stats()  # noqa: SLF001 - same geometry
    bm = start_server(
        BlockManagerSettings(
            port=0,
            num_gpu_blocks=geometry.num_gpu_blocks,
            block_size=geometry.block_size,
            auth_tokens_file=str(tokens),
        )
    )
    try:
        common = dict(port=0, block_manager=f"127.0.0.1:{bm.port}", workers=",".join(stack.worker_targets))
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            OpenAIServer(ServeSettings(**common))  # type: ignore[arg-type]
        (tmp_path / "token").write_text(token + "\n")
        monkeypatch.setenv("PAGEDKV_TOKEN_FILE", str(tmp_path / "token"))
        # A token over plaintext gRPC is refused unless explicitly allowed (pagedkv/dial.py).
        with pytest.raises(InsecureTokenError, match="--allow-insecure"):
            OpenAIServer(ServeSettings(**common))  # type: ignore[arg-type]
        with OpenAIServer(ServeSettings(**common, allow_insecure=True)) as srv:  # type: ignore[arg-type]
            status, body, _ = post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
            assert status == 200 and len(body["choices"][0]["token_ids"]) == 3
    finally:
        bm.stop(0)
