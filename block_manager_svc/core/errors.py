"""Errors the core raises, each tagged with the status a client should see.

The core knows nothing of gRPC; it names the failure class with an
`ErrorCode` whose members match gRPC status names one to one, so the servicer
maps them mechanically and other frontends (an in-process engine, tests) can
branch on them too. Every error is raised before any state changes.
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


class CoreError(Exception):
    """A request the core refused; the state is exactly as before the call."""

    code: ErrorCode = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CoreError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(CoreError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(CoreError):
    code = ErrorCode.ALREADY_EXISTS


class ResourceExhausted(CoreError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class FailedPrecondition(CoreError):
    code = ErrorCode.FAILED_PRECONDITION
