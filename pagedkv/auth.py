"""Bearer-token authentication for pagedkv gRPC servers (docs/security.md).

Clients send ``authorization: Bearer <token>`` call metadata. The server holds
only SHA-256 hashes of tokens (a tokens file, TOML or JSON), compares them with
``hmac.compare_digest`` against every entry (no early exit, so timing says
nothing about which entry, if any, matched) and never logs a token or its hash.

Tokens file::

    [[tenants]]
    name = "acme"                       # [A-Za-z0-9._-], 1..64 characters
    token_sha256 = "<hex sha256 of the token>"   # python -m pagedkv.auth hash TOKEN
    admin = false                       # admins see every tenant's stats and events
    max_gpu_blocks = 2048               # quotas, 0 / absent = unlimited
    max_cpu_blocks = 0
    max_sequences = 256
    allow = ["GetStats", "WatchEvents"] # optional: the only methods this token may call

Several entries may share a tenant name (token rotation); quotas and admin
come from the first. Missing or unknown token -> UNAUTHENTICATED; a known
token calling a method outside its ``allow`` list -> PERMISSION_DENIED. The
gRPC health service is exempt (orchestrators probe it without credentials).

The authenticated tenant reaches the handlers through :data:`current_tenant`
(a contextvar set for the duration of the handler).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
import tomllib

from pagedkv.handlers import rewrap
from pagedkv.log_limit import LogLimiter

log = structlog.get_logger("pagedkv.auth")

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    admin: bool = False
    max_gpu_blocks: int = 0
    max_cpu_blocks: int = 0
    max_sequences: int = 0
    allow: frozenset[str] | None = None

    @property
    def prefix(self) -> str:
        return self.name + "\x1f"


current_tenant: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("pagedkv_tenant", default=None)
# Set by the metrics interceptor around a call so it can label it with the tenant found here.
call_labels: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "pagedkv_call_labels", default=None
)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenFileError(RuntimeError):
    pass


def read_tokens_file(path: str | Path) -> Any:
    """The parsed tokens file (``.json`` is JSON, anything else TOML), not yet validated."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TokenFileError(f"cannot read tokens file {str(p)!r}: {e.strerror}") from None
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise TokenFileError(
            f"tokens file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}"
        ) from None


class TokenStore:
    """Token hashes -> tenants; ``authenticate`` is constant-time over the entries."""

    def __init__(self, entries: list[tuple[bytes, Tenant]]) -> None:
        if not entries:
            raise TokenFileError("the tokens file defines no tenants")
        self._entries = entries
        self.tenants: dict[str, Tenant] = {}
        for _, t in entries:
            self.tenants.setdefault(t.name, t)

    @classmethod
    def load(cls, path: str | Path) -> TokenStore:
        return cls.from_dict(read_tokens_file(path), str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "tokens") -> TokenStore:
        items = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise TokenFileError(f"{where}: expected a list 'tenants'")
        entries: list[tuple[bytes, Tenant]] = []
        known = {
            "name",
            "token_sha256",
            "admin",
            "max_gpu_blocks",
            "max_cpu_blocks",
            "max_sequences",
            "allow",
        }
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise TokenFileError(f"{where}: tenants[{i}] is not a table")
            unknown = set(item) - known
            if unknown:
                raise TokenFileError(f"{where}: tenants[{i}] has unknown keys {sorted(unknown)}")
            name = item.get("name", "")
            if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
                raise TokenFileError(f"{where}: tenants[{i}].name must match {TENANT_NAME.pattern}")
            digest = str(item.get("token_sha256", "")).lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise TokenFileError(f"{where}: tenants[{i}] ({name}): token_sha256 must be 64 hex digits")
            quotas = {}
            for k in ("max_gpu_blocks", "max_cpu_blocks", "max_sequences"):
                v = item.get(k, 0)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise TokenFileError(f"{where}: tenants[{i}] ({name}): {k} must be an integer >= 0")
                quotas[k] = v
            allow = item.get("allow")
            if allow is not None and not (isinstance(allow, list) and all(isinstance(a, str) for a in allow)):
                raise TokenFileError(f"{where}: tenants[{i}] ({name}): allow must be a list of method names")
            entries.append(
                (
                    bytes.fromhex(digest),
                    Tenant(
                        name=name,
                        admin=bool(item.get("admin", False)),
                        allow=frozenset(allow) if allow is not None else None,
                        **quotas,
                    ),
                )
            )
        return cls(entries)

    def authenticate(self, token: str) -> Tenant | None:
        got = hashlib.sha256(token.encode()).digest()
        found: Tenant | None = None
        for digest, tenant in self._entries:  # every entry, no early exit
            if hmac.compare_digest(got, digest):
                found = tenant
        return None if found is None else self.tenants[found.name]


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def abort_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)
        yield  # pragma: no cover - makes this a generator

    return rewrap(handler, lambda kind, _fn: abort_stream if kind.endswith("_stream") else abort)


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
    def bind(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            labels = call_labels.get()
            if labels is not None:
                labels.append(tenant.name)
            token = current_tenant.set(tenant)
            try:
                return fn(request, context)
            finally:
                current_tenant.reset(token)

        return run

    def bind_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            token = current_tenant.set(tenant)
            try:
                yield from fn(request, context)
            finally:
                current_tenant.reset(token)

        return run

    return rewrap(handler, lambda kind, fn: bind_stream(fn) if kind.endswith("_stream") else bind(fn))


class AuthInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED without a valid bearer token; PERMISSION_DENIED outside ``allow``."""

    def __init__(
        self,
        store: TokenStore,
        exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,),
        limiter: LogLimiter | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter or LogLimiter()  # a client without a token could flood the log
        self.exempt = exempt_prefixes
        self.num_rejected = 0

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(self.exempt):
            return handler
        token = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                if isinstance(value, str) and value[:7].lower() == "bearer ":
                    token = value[7:].strip()
                break
        tenant = self.store.authenticate(token) if token else None
        if tenant is None:
            self.num_rejected += 1
            # Never log the token (nor its hash): only that one was (not) present.
            self.limiter.info(log, "unauthenticated", method=method, token_present=bool(token))
            return _aborting(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid bearer token (metadata 'authorization: Bearer <token>')",
            )
        if tenant.allow is not None and method.rsplit("/", 1)[-1] not in tenant.allow:
            self.limiter.info(log, "permission_denied", method=method, tenant=tenant.name)
            return _aborting(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not call {method.rsplit('/', 1)[-1]}",
            )
        return _with_tenant(handler, tenant)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.auth hash TOKEN``: the token_sha256 line for a tokens file;
    ``python -m pagedkv.auth new``: a fresh random token and its hash."""
    import secrets

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["hash"] and len(args) == 2:
        print(hash_token(args[1]))
        return 0
    if args[:1] == ["new"]:
        token = secrets.token_urlsafe(32)
        print(f"token = {token}\ntoken_sha256 = {hash_token(token)}")
        return 0
    print("usage: python -m pagedkv.auth hash TOKEN | new", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
