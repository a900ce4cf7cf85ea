"""How a role dials another role: client-side TLS and a bearer token (docs/security.md).

Every outbound connection of every role -- worker -> cache host, worker -> block manager, cache
host -> block manager, and the frontend's clients -- is secured the same way: a CA bundle that
verifies the server (turns TLS on), optionally a client certificate and key (mutual TLS), and an
optional bearer token sent as ``authorization`` metadata on every call. Roles read them from their
settings (``--tls-ca``, ``--tls-client-cert``, ``--tls-client-key``, ``--token-file`` and the
``PAGEDKV_TLS_CA``, ``PAGEDKV_TLS_CLIENT_CERT``, ``PAGEDKV_TLS_CLIENT_KEY``, ``PAGEDKV_TOKEN_FILE``,
``PAGEDKV_TOKEN`` variables): the same variable names the frontend's commands read, so one
environment secures a whole deployment. The token is never a flag value (it would show in the
process list) and never appears in a repr or a log line.

A bearer token never travels over a plaintext connection: a role (or client) given a token and no
TLS refuses to start (:class:`InsecureTokenError`, :func:`check_token_transport`) unless
``--allow-insecure`` (``PAGEDKV_ALLOW_INSECURE=true``) says the network is trusted. This module is
the one place that rule lives; every client of every role goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pagedkv import envs
from pagedkv.tls import auth_metadata, channel


class TokenError(ValueError):
    """The token file cannot be read or is empty."""


class InsecureTokenError(TokenError):
    """A bearer token would be sent over a plaintext connection; the message names the flags."""


def check_token_transport(token: str, secure: bool, allow_insecure: bool) -> None:
    """Refuse to send ``token`` over a plaintext channel unless explicitly allowed: on a network
    someone else can read, a token sent in the clear is a token given away."""
    if token and not secure and not allow_insecure:
        raise InsecureTokenError(
            "refusing to send a bearer token over a plaintext connection: set --tls-ca (PAGEDKV_TLS_CA) to "
            "dial with TLS, or pass --allow-insecure (PAGEDKV_ALLOW_INSECURE=true) on a network you trust"
        )


def read_token(token_file: str = "", env_token: str | None = None) -> str:
    """The bearer token: from ``token_file`` when given, else ``PAGEDKV_TOKEN`` (or ``env_token``)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise TokenError(f"cannot read token file {token_file!r}: {e.strerror}") from None
        if not token:
            raise TokenError(f"token file {token_file!r} is empty")
        return token
    return (envs.get_str("PAGEDKV_TOKEN") if env_token is None else env_token).strip()


@dataclass(slots=True, frozen=True)
class Dialer:
    """Client credentials of one role; ``channel(target)`` plus ``metadata`` on every call."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)
    allow_insecure: bool = False  # a token over plaintext (check_token_transport)

    def __post_init__(self) -> None:
        check_token_transport(self.token, self.secure, self.allow_insecure)

    @classmethod
    def from_settings(cls, settings: Any) -> Dialer:
        """From a role's settings (fields tls_ca, tls_client_cert, tls_client_key, token_file, token,
        allow_insecure); raises TokenError (InsecureTokenError: a token without TLS)."""
        token = settings.token.get_secret_value() if settings.token else ""
        return cls(
            tls_ca=settings.tls_ca,
            tls_cert=settings.tls_client_cert,
            tls_key=settings.tls_client_key,
            token=read_token(settings.token_file, token),
            allow_insecure=bool(getattr(settings, "allow_insecure", False)),
        )

    @property
    def secure(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_key)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return auth_metadata(self.token)

    def channel(self, target: str, **kw: Any) -> grpc.Channel:
        """A channel to ``target``: TLS when any TLS file is set, else plaintext (pagedkv/tls.py)."""
        return channel(target, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, **kw)


PLAIN = Dialer()
