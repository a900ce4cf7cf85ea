"""Malformed request bytes get INVALID_ARGUMENT with a message, and a (rate-limited) log line.

gRPC's own answer to bytes that do not parse as the method's request message is ``INTERNAL:
Exception deserializing request!``, with nothing in the service's log: the client cannot tell a
bug in its encoder from a server fault, and the operator sees nothing. This interceptor, the
innermost of every pagedkv server (block manager, cache host, workers), wraps each method's request
deserializer so that a parse failure reaches the handler as a marker, which then aborts with
``INVALID_ARGUMENT: malformed request: cannot parse <message type> (<n> bytes): <parser error>`` and
logs ``malformed_request`` (method, size, error; through the server's :class:`LogLimiter`).
Nothing else changes: well-formed requests go to the real handler untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from pagedkv.handlers import rewrap
from pagedkv.log_limit import LogLimiter

log = structlog.get_logger("pagedkv.grpc")


@dataclass(slots=True, frozen=True)
class Malformed:
    """What the wrapped deserializer returns instead of raising."""

    message: str
    size: int


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(deserialize, "__self__", None)  # FromString is bound to the message class
    type_name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", None) or "the request message"

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's malformed input
            return Malformed(f"cannot parse {type_name} ({len(data)} bytes): {e}", len(data))

    return parse


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    def __init__(self, limiter: LogLimiter | None = None) -> None:
        self.limiter = limiter or LogLimiter()
        self.num_malformed = 0

    def _reject(self, method: str, bad: Malformed, context: grpc.ServicerContext) -> None:
        self.num_malformed += 1
        self.limiter.info(log, "malformed_request", method=method, size=bad.size, error=bad.message)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {bad.message}")

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    self._reject(method, request, context)
                return fn(request, context)

            return run

        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, Malformed):
                    self._reject(method, request, context)
                yield request

        def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return fn(checked(requests, context), context)

            return run

        return rewrap(
            handler,
            lambda kind, fn: streaming(fn) if kind.startswith("stream_") else unary(fn),
            request_deserializer=_safe(handler.request_deserializer),
        )
