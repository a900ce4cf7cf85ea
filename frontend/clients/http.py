"""A small client of `pagedkv serve` for our own tools (`pagedkv generate`, `pagedkv demo`,
bench/serve_bench.py): one JSON POST (blocking) and streamed completions (asyncio).

Why not the `openai` SDK here: it is a test dependency only, and the benchmark must timestamp each
server-sent event the moment its bytes arrive, with no extra layers between (what vLLM's
benchmark_serving does with aiohttp). Plain HTTP/1.1 over asyncio streams, chunked transfer
decoding, TLS through an ``ssl.SSLContext``, the API key as a bearer token.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from typing import Any


class HttpError(RuntimeError):
    """A non-2xx answer; ``message`` is the server's OpenAI error message when it sent one."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500]


def _headers(api_key: str) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def post_json(
    url: str,
    body: dict[str, Any],
    *,
    api_key: str = "",
    timeout_s: float = 600.0,
    ssl_context: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    """POST ``body`` to ``url`` and return the JSON answer; raises HttpError or OSError."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=_headers(api_key), method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ssl_context) as r:  # noqa: S310
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise HttpError(e.code, _error_message(e.read())) from None


def get_text(
    url: str, *, api_key: str = "", timeout_s: float = 30.0, ssl_context: ssl.SSLContext | None = None
) -> str:
    req = urllib.request.Request(url, headers=_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ssl_context) as r:  # noqa: S310
            return str(r.read().decode())
    except urllib.error.HTTPError as e:
        raise HttpError(e.code, _error_message(e.read())) from None


async def stream_events(
    url: str, body: dict[str, Any], *, api_key: str = "", ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """POST with ``stream: true`` and yield (arrival time.perf_counter(), event JSON) per SSE event,
    until ``data: [DONE]``."""
    u = urllib.parse.urlsplit(url)
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    ctx = ssl_context if tls else None
    if tls and ctx is None:
        ctx = ssl.create_default_context()
    reader, writer = await asyncio.open_connection(u.hostname, port, ssl=ctx)
    try:
        payload = json.dumps({**body, "stream": True}).encode()
        head = [
            f"POST {u.path or '/'} HTTP/1.1",
            f"Host: {u.hostname}:{port}",
            "Connection: close",
            f"Content-Length: {len(payload)}",
            "Accept: text/event-stream",
        ]
        head += [f"{k}: {v}" for k, v in _headers(api_key).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            raw = await _read_body(reader, chunked, headers)
            raise HttpError(status, _error_message(raw))
        buf = b""
        async for piece in _pieces(reader, chunked):
            now = time.perf_counter()
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        raise HttpError(500, str(obj["error"].get("message")))
                    yield now, obj
    finally:
        writer.close()


async def _pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _read_body(reader: asyncio.StreamReader, chunked: bool, headers: dict[str, str]) -> bytes:
    if chunked:
        return b"".join([p async for p in _pieces(reader, True)])
    n = int(headers.get("content-length", "0") or 0)
    return await reader.readexactly(n) if n else await reader.read()
