"""Structured error causes: how a server says *why* a call failed in a form a program can act on,
and how a client reads it.

Every service uses the standard rich error model: a ``google.rpc.Status`` (code, message) whose
details hold one ``google.rpc.ErrorInfo`` (``reason``, ``domain``, ``metadata``), sent by grpcio in
the ``grpc-status-details-bin`` trailer, which grpcurl and every gRPC ecosystem client decode
(grpcio-status's ``rpc_status.from_call`` in Python). The human-readable message stays as it is;
a client that must tell one cause from another (the engine, for a lost cache host) asks
:func:`reason_of`, never the message. Domains: ``pagedkv.block_manager`` (reasons in
block_manager_svc/core/errors.py) and ``pagedkv.worker`` (:data:`CACHE_HOST_LOST`).
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DETAILS_KEY = "grpc-status-details-bin"  # where grpcio carries the serialized google.rpc.Status
WORKER_DOMAIN = "pagedkv.worker"
# A worker's cache host died or was replaced (FAILED_PRECONDITION from Worker.Step): the KV cache
# content is gone and every sequence must be re-prefilled once a worker re-attaches. Metadata:
# cache_instance_id, the instance the worker is (or was last) attached to.
CACHE_HOST_LOST = "CACHE_HOST_LOST"

__all__ = [
    "CACHE_HOST_LOST",
    "DETAILS_KEY",
    "WORKER_DOMAIN",
    "abort",
    "error_info",
    "reason_of",
    "rich_status",
]


def rich_status(
    code: grpc.StatusCode, message: str, reason: str, domain: str, metadata: dict[str, str] | None = None
) -> grpc.Status:
    """A status with the message and one ErrorInfo(reason, domain, metadata) in its details, for
    ``context.abort_with_status``."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata or {})
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str,
    domain: str = WORKER_DOMAIN,
    **metadata: str,
) -> NoReturn:
    """Fail the call with `code` and `message`, the cause as an ErrorInfo in the status details."""
    context.abort_with_status(rich_status(code, message, reason, domain, metadata))
    raise AssertionError("unreachable")  # abort_with_status raises


def error_info(err: Any) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo in a failed call's status details (a grpc.RpcError, sync or aio), or None."""
    trailers = getattr(err, "trailing_metadata", None)
    try:
        items = trailers() if callable(trailers) else None
    except Exception:  # noqa: BLE001 - an error without call state has no trailers
        return None
    for key, value in items or ():
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # noqa: BLE001 - a malformed detail is no detail
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return None


def reason_of(err: Any) -> str:
    """The ErrorInfo reason of a failed call ("" when it carried none)."""
    info = error_info(err)
    return info.reason if info is not None else ""
