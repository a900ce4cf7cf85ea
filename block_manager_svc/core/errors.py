"""Errors the core raises, each tagged with the status a client should see.

The core knows nothing of gRPC; it names the failure class with an
`ErrorCode` whose members match gRPC status names one to one, so the servicer
maps them mechanically and other frontends (an in-process engine, tests) can
branch on them too. Each error also has a `reason`, an UPPER_SNAKE_CASE cause
a program can act on (the servicer sends it as google.rpc.ErrorInfo.reason;
see REASONS). Every error is raised before any state changes.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9


# Every reason the core gives, and what a client can do about it.
REASONS = {
    "INVALID_ARGUMENT": "the request is malformed; fix it (the message names the field)",
    "SEQUENCE_NOT_FOUND": "no such sequence (never allocated, or freed)",
    "SEQUENCE_PREEMPTED": "preempted for recompute earlier in the same call; re-Allocate it",
    "SEQUENCE_EXISTS": "the id is taken; pick another or Free it first",
    "SEQUENCE_SWAPPED_OUT": "swapped to the CPU pool; SwapIn it first",
    "SEQUENCE_NOT_SWAPPED_OUT": "SwapIn of a sequence that is running",
    "POOL_EXHAUSTED": "not enough GPU blocks now; retry after frees, or preempt",
    "TENANT_QUOTA_EXCEEDED": "the tenant's quota is used up; free its sequences",
    "GRANT_UNSUPPORTED_WITH_KV_GROUPS": "Grant with several KV-cache groups; append without it",
    "ROLLBACK_BELOW_COMMITTED": "Rollback below the committed length; committed KV is never taken back",
}


class CoreError(Exception):
    """A request the core refused; the state is exactly as before the call."""

    code: ErrorCode = ErrorCode.INVALID_ARGUMENT
    reason: str = "INVALID_ARGUMENT"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason


class InvalidArgument(CoreError):
    code = ErrorCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class NotFound(CoreError):
    code = ErrorCode.NOT_FOUND
    reason = "SEQUENCE_NOT_FOUND"


class AlreadyExists(CoreError):
    code = ErrorCode.ALREADY_EXISTS
    reason = "SEQUENCE_EXISTS"


class ResourceExhausted(CoreError):
    code = ErrorCode.RESOURCE_EXHAUSTED
    reason = "POOL_EXHAUSTED"


class FailedPrecondition(CoreError):
    code = ErrorCode.FAILED_PRECONDITION
    reason = "SEQUENCE_SWAPPED_OUT"
