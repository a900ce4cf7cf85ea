"""Structured error causes (protos/pagedkv/v1/errors.proto): how a server says *why* a call
failed in a form a program can act on, and how a client reads it.

The human-readable status message stays as it is; the cause travels next to it as an
``ErrorInfo`` in the trailing metadata key :data:`ERROR_INFO_KEY`. A client that must tell one
cause from another (the engine, for a lost cache host) asks :func:`reason_of`, never the message.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from pagedkv.v1.errors_pb2 import ErrorInfo, ErrorReason

ERROR_INFO_KEY = "pagedkv-error-bin"  # "-bin": gRPC carries the value as bytes
CACHE_HOST_LOST = ErrorReason.ERROR_REASON_CACHE_HOST_LOST

__all__ = [
    "CACHE_HOST_LOST",
    "ERROR_INFO_KEY",
    "ErrorInfo",
    "ErrorReason",
    "abort",
    "error_info",
    "reason_of",
]


def abort(
    context: grpc.ServicerContext, code: grpc.StatusCode, message: str, reason: int, **metadata: str
) -> NoReturn:
    """``context.abort(code, message)`` with an ErrorInfo naming `reason` in the trailers."""
    info = ErrorInfo(reason=reason, metadata=metadata)  # type: ignore[arg-type]
    context.set_trailing_metadata(((ERROR_INFO_KEY, info.SerializeToString()),))
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def error_info(err: Any) -> ErrorInfo | None:
    """The ErrorInfo a failed call carried (a grpc.RpcError, sync or aio), or None."""
    trailers = getattr(err, "trailing_metadata", None)
    try:
        items = trailers() if callable(trailers) else None
    except Exception:  # noqa: BLE001 - an error without call state has no trailers
        return None
    for key, value in items or ():
        if key == ERROR_INFO_KEY and isinstance(value, bytes):
            try:
                return ErrorInfo.FromString(value)
            except Exception:  # noqa: BLE001 - a malformed detail is no detail
                return None
    return None


def reason_of(err: Any) -> int:
    """The ErrorReason of a failed call (ERROR_REASON_UNSPECIFIED when it carried none)."""
    info = error_info(err)
    return info.reason if info is not None else ErrorReason.ERROR_REASON_UNSPECIFIED
