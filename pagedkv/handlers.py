"""Re-wrapping a gRPC method handler, for the server interceptors (auth, malformed requests).

A ``grpc.RpcMethodHandler`` carries its behaviour in one of four attributes, one per
streaming kind, and is rebuilt with the matching ``*_rpc_method_handler`` factory; every
interceptor that changes a handler's behaviour (or its request parser) does that same dance,
so it is written once here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behaviour = Callable[..., Any]

KINDS: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def rewrap(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[str, Behaviour], Behaviour],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by ``wrap(kind, behaviour)`` (kind: one of
    :data:`KINDS`; a kind ending in ``_stream`` answers with a generator), and its request
    parser by `request_deserializer` when given."""
    for kind, make in KINDS.items():
        fn = getattr(handler, kind)
        if fn is not None:
            return make(
                wrap(kind, fn),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise ValueError("the method handler has no behaviour")
