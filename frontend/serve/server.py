"""`pagedkv serve`: an OpenAI-compatible HTTP front door over one continuous-batching engine.

One process, one engine, many users: every request from every client goes into the same engine,
whose thread (frontend/serve/engine_loop.py) batches them iteration by iteration. This module is only
the HTTP side (FastAPI + uvicorn): parse and validate (frontend/serve/openai_api.py), submit, stream
tokens back as they are produced, abort on disconnect, and serve /v1/models, /health and
/metrics. Routes:

    POST /v1/completions        prompt: token ids, lists of them, or text (with a tokenizer)
    POST /v1/chat/completions   when the tokenizer has a chat template
    POST /tokenize, /detokenize vLLM's shapes (frontend/serve/tokenize_api.py)
    GET  /v1/models
    GET  /health                200 only when the block manager and a worker answer (no API key)
    GET  /metrics               Prometheus (frontend/serve/metrics.py)

See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import math
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedkv.frontend.engine import Engine, GenerationRequest, PromptLogprob, TokenEvent
from pagedkv.frontend.serve.detokenize import IncrementalText, token_bytes
from pagedkv.frontend.serve.engine_loop import Admitted, EngineLoop, Failed, Finished
from pagedkv.frontend.serve.inbox import Inbox
from pagedkv.frontend.serve.metrics import ServeMetrics
from pagedkv.frontend.serve.openai_api import (
    MAX_REQUEST_ID,
    ApiError,
    Parsed,
    RequestLimits,
    parse_chat,
    parse_completion,
)
from pagedkv.frontend.serve.settings import ServeSettings, load_settings
from pagedkv.frontend.serve.text import load_model_text
from pagedkv.frontend.serve.tokenize_api import detokenize, tokenize
from pagedkv.frontend.serve.tool_parsers import ToolCallStream, parser_by_name
from pagedkv.tls import TlsConfigError, is_loopback

log = structlog.get_logger("pagedkv.serve")

HEALTH_PATH = "/health"
# A streaming request asks this often whether its client left (besides failing to send a token);
# a non-streaming one has a task waiting for the disconnect (_watch_client).
DISCONNECT_POLL_S = 0.5


@dataclass(slots=True)
class ServerState:
    """What the routes share: the engine loop, the limits requests are checked against."""

    loop: EngineLoop
    limits: RequestLimits
    metrics: ServeMetrics
    max_waiting: int
    retry_after_s: int
    health: Any  # () -> (ok, detail), blocking

    @property
    def model_name(self) -> str:
        return self.limits.model_name


# --- one request, from submission to the last token ----------------------------------------------
@dataclass(slots=True)
class _Choice:
    index: int  # OpenAI choice index: prompt_index * n + sample index
    text: IncrementalText
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # when top_logprobs was asked
    finish_reason: str | None = None
    calls: ToolCallStream | None = None  # chat with tools: the text read for tool calls

    @property
    def openai_finish_reason(self) -> str | None:
        """``tool_calls`` for a sample that ended by itself (not cut by length) having made calls."""
        if self.finish_reason == "stop" and self.calls is not None and self.calls.calls:
            return "tool_calls"
        return self.finish_reason


class _Run:
    """The engine requests of one HTTP request (one per prompt) and their choices."""

    def __init__(self, state: ServerState, parsed: Parsed, kind: str) -> None:
        self.state = state
        self.parsed = parsed
        self.kind = kind
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        # The engine's ids stay unique whatever id the client gave (two may send the same one).
        engine_id = f"{prefix}-{uuid.uuid4().hex}"
        # The response's id: the client's request_id when it sent one, as vLLM shapes it.
        self.client_id = parsed.request_id
        self.id = f"{prefix}-{parsed.request_id}" if parsed.request_id else engine_id
        self.created = int(time.time())
        self.request_ids = [f"{engine_id}-{i}" for i in range(len(parsed.prompts))]
        self.queue: Inbox[tuple[int, object]] = Inbox(asyncio.get_running_loop())
        self.early: collections.deque[tuple[int, object]] = collections.deque()  # tokens seen during submit
        tools = parsed.tools
        self.choices = {
            (p, s): _Choice(
                p * parsed.n + s,
                IncrementalText(
                    state.limits.text,
                    parsed.stop,
                    skip_special_tokens=parsed.skip_special_tokens,
                    spaces_between_special_tokens=parsed.spaces_between_special_tokens,
                    include_stop_str_in_output=parsed.include_stop_str_in_output,
                    min_tokens=parsed.min_tokens,
                ),
                calls=ToolCallStream(parser_by_name(tools.parser), tools.max_calls) if tools else None,
            )
            for p in range(len(parsed.prompts))
            for s in range(parsed.n)
        }
        self.cached_tokens = 0
        self.finished_prompts = 0
        self.active = False
        # Parsed.prompt_logprobs: each prompt's scores, from its Finished.
        self.prompt_scores: dict[int, tuple[PromptLogprob | None, ...]] = {}

    async def submit(self) -> None:
        """Hand every prompt to the engine; raise ApiError if any is refused (others aborted)."""
        arrival = time.monotonic()
        p = self.parsed
        for i, (rid, prompt) in enumerate(zip(self.request_ids, p.prompts, strict=True)):
            req = GenerationRequest(
                rid,
                prompt,
                max_tokens=p.max_tokens,
                n=p.n,
                sampling=p.sampling,
                stop_token_ids=p.stop_token_ids,
                # vLLM's priority: lower first; the block manager's: higher keeps its blocks.
                priority=-p.priority,
                cache_salt=p.cache_salt,
                prompt_logprobs=p.prompt_logprobs,
                beam=p.beam,
            )

            def sink(item: object, i: int = i) -> None:
                self.queue.put((i, item))

            self.state.loop.submit(req, sink, arrival)
        self.active = True
        admitted = 0
        while admitted < len(self.request_ids):
            got = await self.queue.get()
            item = got[1]
            if not isinstance(item, (Failed, Admitted)):
                self.early.append(got)  # an earlier prompt already produced tokens: keep them in order
                continue
            if isinstance(item, Failed):
                self.abort()
                raise ApiError(
                    item.status,
                    item.message,
                    None,
                    "invalid_request_error" if item.status == 400 else "server_error",
                )
            if isinstance(item, Admitted):
                admitted += 1

    def abort(self) -> None:
        if self.active:
            for rid in self.request_ids:
                self.state.loop.abort(rid)
            self.active = False

    def on_token(self, prompt: int, ev: TokenEvent) -> _Choice | None:
        """Record a token; returns its choice if it belongs to the response."""
        c = self.choices[(prompt, ev.index)]
        if c.finish_reason is not None:
            return None  # already stopped by a stop string; the engine had produced this one meanwhile
        c.text.add(ev.token_id)
        c.logprobs.append(ev.logprob)
        if self.parsed.top_logprobs:
            c.top.append(ev.top_logprobs)
        if c.text.stopped:
            c.finish_reason = "stop"
            self.state.loop.abort(self.request_ids[prompt], ev.index, "stop")
        elif ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            c.text.finish()
        return c

    def on_finished(self, prompt: int, fin: Finished) -> None:
        self.cached_tokens += fin.num_cached_tokens
        if fin.prompt_logprobs is not None:
            self.prompt_scores[prompt] = fin.prompt_logprobs
        for s, reason in enumerate(fin.finish_reasons):
            c = self.choices[(prompt, s)]
            if c.finish_reason is None:
                c.finish_reason = reason
                c.text.finish()
        self.finished_prompts += 1
        if self.finished_prompts == len(self.request_ids):
            self.active = False

    @property
    def done(self) -> bool:
        return self.finished_prompts == len(self.request_ids)

    def usage(self) -> dict[str, Any]:
        completion = sum(len(c.text.tokens) for c in self.choices.values())
        prompt = sum(len(p) for p in self.parsed.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    # --- response shapes ---------------------------------------------------------------------
    def _token_strings(self, ids: list[int]) -> list[str]:
        tok = self.state.limits.text.tokenizer
        if tok is None or self.parsed.return_tokens_as_token_ids:
            return [f"token_id:{t}" for t in ids]
        return [str(tok.decode([t])) for t in ids]

    def _echo(self, c: _Choice) -> str:
        """With echo: the prompt's text (chat: the final message's), which the answer's text starts
        with (its first chunk's)."""
        return self.parsed.echo[c.index // self.parsed.n] if self.parsed.echo else ""

    def _bytes(self, token_id: int, shown: str) -> list[int]:
        """The token's own bytes (part of a character for a byte-level BPE token that decodes to U+FFFD)."""
        tok = self.state.limits.text.tokenizer
        return token_bytes(tok, token_id) if tok is not None else list(shown.encode())

    def _logprobs(
        self, ids: list[int], lps: list[float], tops: Sequence[tuple[tuple[int, float], ...]] = ()
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens; ``tops``: each token's alternatives
        (most likely first), present when the request asked for top logprobs."""
        if not self.parsed.logprobs:
            return None
        strs = self._token_strings(ids)
        alts = [
            list(zip(self._token_strings([t for t, _ in top]), (lp for _, lp in top), strict=True))
            for top in tops
        ]
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": self._bytes(t, s),
                        "top_logprobs": [
                            {"token": a, "logprob": alp, "bytes": self._bytes(at, a)}
                            for (at, _), (a, alp) in zip(
                                tops[i] if alts else (), alts[i] if alts else [], strict=True
                            )
                        ],
                    }
                    for i, (t, s, lp) in enumerate(zip(ids, strs, lps, strict=False))
                ]
            }
        offsets, pos = [], 0
        for s in strs:
            offsets.append(pos)
            pos += len(s)
        top_logprobs = [dict(a) for a in alts] if self.parsed.top_logprobs else None
        return {"tokens": strs, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}

    def _prompt_logprobs(self, prompt: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs of one prompt: per token, null for the first, else a dict from
        token id to {logprob, rank, decoded_token} holding the token itself, then the most likely
        ones (rank 1 first; the token's own entry takes its top rank when it is one of them, as
        vLLM's dict does). decoded_token is the tokenizer's text of the token alone (null without a
        tokenizer; return_tokens_as_token_ids does not change it, as in vLLM), and a logprob of
        -inf is -9999.0, as vLLM clamps it."""
        tok = self.state.limits.text.tokenizer

        def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
            decoded = str(tok.decode([token])) if tok is not None else None
            shown = -9999.0 if logprob == -math.inf else logprob
            return {"logprob": shown, "rank": rank, "decoded_token": decoded}

        out: list[dict[str, dict[str, Any]] | None] = []
        for x in self.prompt_scores.get(prompt, ()):
            if x is None:
                out.append(None)
                continue
            scores = {str(x.token_id): entry(x.token_id, x.logprob, x.rank)}
            for rank, (t, lp) in enumerate(x.top, start=1):
                scores[str(t)] = entry(t, lp, rank)
            out.append(scores)
        return out

    def response(self) -> dict[str, Any]:
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            ids, lps = c.text.tokens, c.logprobs
            text = c.text.full
            message: dict[str, Any] = {"role": "assistant", "content": self._echo(c) + text}
            if c.calls is not None:
                c.calls.feed(text, final=True)
                message = _with_calls(message, c.calls)
            item: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.openai_finish_reason,
                "token_ids": ids,
                "logprobs": self._logprobs(ids, lps, c.top[: len(ids)]),
            }
            if self.kind == "chat":
                item["message"] = message
            else:
                item["text"] = self._echo(c) + text
                if self.parsed.return_token_ids:
                    item["prompt_token_ids"] = self.parsed.prompts[c.index // self.parsed.n]
                if self.parsed.prompt_logprobs is not None:  # vLLM: in each choice, its prompt's
                    item["prompt_logprobs"] = self._prompt_logprobs(c.index // self.parsed.n)
            choices.append(item)
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.kind == "chat" and self.parsed.return_token_ids:
            out["prompt_token_ids"] = self.parsed.prompts[0]
        if self.kind == "chat" and self.parsed.prompt_logprobs is not None:  # vLLM: beside choices
            out["prompt_logprobs"] = self._prompt_logprobs(0)
        return out

    def chunk(
        self,
        c: _Choice,
        token_ids: list[int],
        lps: list[float],
        first: bool,
        tops: Sequence[tuple[tuple[int, float], ...]] = (),
    ) -> dict[str, Any]:
        final = c.finish_reason is not None
        text = c.text.delta(final=final)
        delta: dict[str, Any] = {"content": text}
        if c.calls is not None:
            content, calls = c.calls.feed(text, final)
            delta = {"content": content or None}
            if calls:
                delta["tool_calls"] = [d.openai() for d in calls]
        item: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.openai_finish_reason,
            "token_ids": token_ids,
            "logprobs": self._logprobs(token_ids, lps, tops),
        }
        if self.kind == "chat":
            if first:
                delta["role"] = "assistant"
                if self.parsed.echo:
                    delta["content"] = self._echo(c) + (delta.get("content") or "")
            item["delta"] = delta
        else:
            item["text"] = (self._echo(c) if first else "") + text
            if first and self.parsed.return_token_ids:
                item["prompt_token_ids"] = self.parsed.prompts[c.index // self.parsed.n]
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [item],
        }
        if self.kind == "chat" and first and self.parsed.return_token_ids:
            out["prompt_token_ids"] = self.parsed.prompts[0]
        if self.parsed.include_usage:
            out["usage"] = None
        return out


def _with_calls(message: dict[str, Any], calls: ToolCallStream) -> dict[str, Any]:
    """The assistant message of a chat with tools: its content (null when it is only calls or
    whitespace around them) and its calls."""
    if not calls.calls:
        return {**message, "content": calls.content}
    return {
        **message,
        "content": calls.content if calls.content.strip() else None,
        "tool_calls": [c.openai() for c in calls.calls],
    }


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _ClientGone:
    """Put in a non-streaming run's queue when its client disconnected."""


CLIENT_GONE = _ClientGone()


async def _watch_client(request: Request, run: _Run) -> None:
    """Abort ``run`` when the client of a non-streaming request disconnects. Once the body is read,
    uvicorn answers ``receive()`` only when the connection is lost (or the response went out, and
    this task is cancelled before that), reading the socket meanwhile, so it sees the client go."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.abort()
    run.queue.put((-1, CLIENT_GONE))


async def _next(run: _Run, request: Request) -> tuple[int, object]:
    """The next item for this run; aborts it (and raises) when a streaming client went away."""
    if run.early:
        return run.early.popleft()
    while True:
        try:
            return await run.queue.get(DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                run.abort()
                raise asyncio.CancelledError("client disconnected") from None


async def _serve(state: ServerState, request: Request, parsed: Parsed, kind: str) -> Response:
    waiting = state.loop.num_waiting()
    if waiting + len(parsed.prompts) > state.max_waiting:
        state.metrics.reject(503)
        raise ApiError(
            503,
            f"the server is busy: {waiting} requests are waiting (max_waiting "
            f"{state.max_waiting}); retry later",
            None,
            "server_error",
            "overloaded",
        )
    if not state.loop.alive:
        raise ApiError(503, "the engine is not running", None, "server_error")
    if state.loop.unavailable is not None:
        state.metrics.reject(503)
        raise ApiError(503, state.loop.unavailable, None, "server_error")
    run = _Run(state, parsed, kind)
    try:
        await run.submit()
    except BaseException:
        run.abort()
        raise
    id_header = {"X-Request-Id": run.client_id} if run.client_id else {}
    if parsed.stream:
        return StreamingResponse(
            _stream(run, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **id_header},
        )
    watcher = asyncio.create_task(_watch_client(request, run))
    try:
        while not run.done:
            prompt, item = await _next(run, request)
            if isinstance(item, TokenEvent):
                run.on_token(prompt, item)
            elif isinstance(item, Finished):
                run.on_finished(prompt, item)
            elif isinstance(item, Failed):
                raise ApiError(item.status, item.message, None, "server_error")
            elif item is CLIENT_GONE:
                log.info("client_gone", request_id=run.id)
                return Response(status_code=499)  # nobody reads it: the connection is closed
    finally:
        watcher.cancel()
        run.abort()  # no-op once done
    return JSONResponse(run.response(), headers=id_header)


async def _stream(run: _Run, request: Request) -> AsyncIterator[bytes]:
    seen: set[int] = set()
    closed: set[int] = set()  # choices whose finish_reason chunk was sent
    try:
        while not run.done:
            prompt, item = await _next(run, request)
            if isinstance(item, TokenEvent):
                c = run.on_token(prompt, item)
                if c is None:
                    continue
                first = c.index not in seen
                seen.add(c.index)
                if c.finish_reason is not None:
                    closed.add(c.index)
                yield _sse(
                    run.chunk(
                        c,
                        [item.token_id],
                        [item.logprob],
                        first,
                        [item.top_logprobs] if run.parsed.top_logprobs else (),
                    )
                )
            elif isinstance(item, Finished):
                run.on_finished(prompt, item)
                # A sample that ended without a last token (aborted): its finish_reason, and the
                # text it still held back, in a chunk of its own.
                for s in range(run.parsed.n):
                    c = run.choices[(prompt, s)]
                    if c.index not in closed:
                        closed.add(c.index)
                        yield _sse(run.chunk(c, [], [], c.index not in seen))
                        seen.add(c.index)
            elif isinstance(item, Failed):
                yield _sse(ApiError(item.status, item.message, None, "server_error").body())
                return
        if run.parsed.include_usage:
            yield _sse(
                {
                    "id": run.id,
                    "object": "chat.completion.chunk" if run.kind == "chat" else "text_completion",
                    "created": run.created,
                    "model": run.state.model_name,
                    "choices": [],
                    "usage": run.usage(),
                }
            )
        yield b"data: [DONE]\n\n"
    finally:
        run.abort()  # the client went away mid-stream: free its blocks in the next iteration


# --- the app ---------------------------------------------------------------------------------------
class ApiKeyMiddleware:
    """Bearer API key on every route except /health (plain ASGI: streaming passes through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = hashlib.sha256(api_key.encode()).digest() if api_key else b""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self._key or scope.get("path") == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        got = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                got = value
        # Compare digests: constant time whatever the lengths.
        ok = got.startswith(b"Bearer ") and hmac.compare_digest(
            hashlib.sha256(got[7:].strip()).digest(), self._key
        )
        if not ok:
            err = ApiError(
                401,
                "missing or wrong API key: send `Authorization: Bearer <key>`",
                None,
                "invalid_request_error",
                "invalid_api_key",
            )
            await JSONResponse(err.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _header_id(request: Request, parsed: Parsed) -> Parsed:
    """An X-Request-Id header names the request, over the body's request_id (as vLLM has it)."""
    given = request.headers.get("x-request-id")
    if given is None:
        return parsed
    if not (0 < len(given) <= MAX_REQUEST_ID and all("!" <= ch <= "~" for ch in given)):
        raise ApiError(
            400,
            f"X-Request-Id: 1 to {MAX_REQUEST_ID} printable ASCII characters without spaces",
            "X-Request-Id",
        )
    parsed.request_id = given
    return parsed


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def create_app(state: ServerState, api_key: str = "", allowed_origins: Sequence[str] = ()) -> Any:
    """The ASGI app: routes, behind the API key (when set), behind CORS (when origins are allowed:
    outermost, so that a browser's preflight, which carries no key, is answered, and so are 401s)."""
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(state.retry_after_s)} if e.status == 503 else None
        if e.status == 400:
            state.metrics.reject(400)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = parse_completion(await _json_body(request), state.limits)
        return await _serve(state, request, _header_id(request, parsed), "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        parsed = parse_chat(await _json_body(request), state.limits)
        return await _serve(state, request, _header_id(request, parsed), "chat")

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(tokenize(await _json_body(request), state.limits))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(detokenize(await _json_body(request), state.limits))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        lim = state.limits
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": lim.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pagedkv",
                        "max_model_len": lim.max_model_len,
                    }
                ],
            }
        )

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        ok, detail = await asyncio.to_thread(state.health)
        if ok and not state.loop.alive:
            ok, detail = False, "the engine loop stopped"
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "detail": detail}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    guarded: Any = ApiKeyMiddleware(app, api_key) if api_key else app
    if not allowed_origins:
        return guarded
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(
        guarded,
        allow_origins=list(allowed_origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type"],
        max_age=600,
    )


# --- running it --------------------------------------------------------------------------------------
class OpenAIServer:
    """A started server: engine loop + uvicorn on its own thread. ``stop()`` ends both and frees."""

    def __init__(self, settings: ServeSettings, on_iteration: Any = None) -> None:
        """``on_iteration(engine)`` runs on the engine thread after every iteration (monitoring hooks)."""
        import uvicorn

        from pagedkv.frontend.clients.block_manager import BlockManagerClient
        from pagedkv.frontend.clients.worker import WorkerClient

        if not settings.tls_cert and not settings.allow_insecure and not is_loopback(settings.host):
            raise TlsConfigError(
                f"refusing to serve plain HTTP on non-loopback address {settings.host!r}: set "
                "--tls-cert/--tls-key "
                "(PAGEDKV_TLS_CERT/PAGEDKV_TLS_KEY), or pass --allow-insecure (PAGEDKV_ALLOW_INSECURE=true) "
                "on a "
                "network you trust"
            )
        if bool(settings.tls_cert) != bool(settings.tls_key):
            raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
        if settings.tls_client_ca and not settings.tls_cert:
            raise TlsConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key as well")
        workers = settings.worker_targets
        if not workers:
            raise ValueError("--workers: at least one worker host:port is needed")
        text = load_model_text(settings.model or None)
        conn = settings.client_kwargs()
        self._closers: list[Any] = []
        self.bm = BlockManagerClient(settings.block_manager, **conn)
        self._closers.append(self.bm.close)
        self.workers = [WorkerClient(t, step_transport=settings.step_transport, **conn) for t in workers]
        self._closers.extend(w.close for w in self.workers)
        try:
            engine = Engine(self.bm, self.workers, settings.engine_config())
            # What each worker's steps travel on (the engine read every WorkerInfo): shm or grpc.
            log.info(
                "worker_step_transport",
                setting=settings.step_transport,
                **{w.target: w.transport for w in self.workers},
            )
            if settings.kv_cache_dtype is not None:
                pool_kv = self.bm.get_config(timeout_s=settings.timeout_s).kv_cache_dtype or "auto"
                if pool_kv != settings.kv_cache_dtype:
                    raise ValueError(
                        "KV cache dtype mismatch: settings (--kv-cache-dtype) have "
                        f"{settings.kv_cache_dtype}, the block manager at {settings.block_manager} "
                        f"has {pool_kv}"
                    )
            info = self.workers[0].get_info(timeout_s=settings.timeout_s)
            import pathlib

            name = (
                settings.model_name
                or (pathlib.Path(settings.model).name if settings.model else "")
                or info.model_name
                or "pagedkv"
            )
            limits = RequestLimits(
                name,
                engine.vocab_size,
                engine.block_size,
                engine.num_gpu_blocks,
                text,
                tool_call_parser=settings.tool_call_parser,
                scheduling_policy=settings.scheduling_policy,
            )
            self.metrics = ServeMetrics(
                name, self._pool_usage, settings.metrics_vllm_names, engine_stats=lambda: engine.stats
            )
            self.metrics.weight_bytes.labels(name, info.weight_format or "auto").set(info.weight_bytes)
            self.loop = EngineLoop(engine, self.metrics, on_iteration=on_iteration)
            self.state = ServerState(
                self.loop, limits, self.metrics, settings.max_waiting, settings.retry_after_s, self._health
            )
            app = create_app(self.state, settings.resolved_api_key(), settings.origins)
            self._sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((settings.host, settings.port))
            self._closers.append(self._sock.close)
            self.port = int(self._sock.getsockname()[1])
            self.scheme = "https" if settings.tls_cert else "http"
            config = uvicorn.Config(
                app,
                log_config=None,
                access_log=False,
                log_level="warning",
                timeout_graceful_shutdown=5,
                ssl_certfile=settings.tls_cert or None,
                ssl_keyfile=settings.tls_key or None,
                ssl_ca_certs=settings.tls_client_ca or None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca else ssl.CERT_NONE,
            )
            self._server = uvicorn.Server(config)
        except BaseException:
            self.close_clients()
            raise
        self.host = settings.host
        self._thread = threading.Thread(target=self._serve, name="pagedkv-http", daemon=True)

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def _pool_usage(self) -> tuple[int, int] | None:
        try:
            s = self.bm.get_stats(timeout_s=2.0)
        except Exception:  # noqa: BLE001 - a scrape without pool numbers beats a failed scrape
            return None
        return int(s.num_used_blocks), int(s.num_gpu_blocks)

    def _health(self) -> tuple[bool, str]:
        if self.loop.unavailable is not None:
            return False, "the block manager stayed unreachable past --block-manager-outage-s"
        try:
            if self.bm.health("pagedkv.v1.BlockManager", timeout_s=1.0) != 1:
                return False, "block manager not SERVING"
        except Exception as e:  # noqa: BLE001
            return False, f"block manager: {type(e).__name__}"
        for w in self.workers:
            try:
                if w.health("pagedkv.v1.Worker", timeout_s=1.0) == 1:
                    return True, "block manager and a worker answer"
            except Exception:  # noqa: BLE001
                continue
        return False, "no worker answers"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        self.loop.start()
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start")
            if time.monotonic() > deadline:
                raise TimeoutError("the HTTP server did not start in time")
            time.sleep(0.02)
        log.info("serving", url=self.url, model=self.state.model_name, workers=len(self.workers))
        return self

    def wait(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        """Stop accepting, end the engine loop (aborting and freeing whatever runs), close clients."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(15)
        self.loop.stop()
        self.close_clients()

    def close_clients(self) -> None:
        while self._closers:
            try:
                self._closers.pop()()
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    import signal
    import sys

    from pagedkv.logging_setup import configure_logging

    settings = load_settings(argv)
    configure_logging(settings.log_level, settings.log_format)
    try:
        server = OpenAIServer(settings)
        server.start()
    except (TlsConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - grpc errors reaching the block manager/workers
        print(f"pagedkv serve: cannot reach the block manager/workers: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not server.loop.alive and server.loop.error is not None:
            log.error("engine_loop_died", error=repr(server.loop.error))
            server.stop()
            return 1
    server.stop()
    return 0
