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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pagedkv.tls import auth_metadata, channel


class TokenError(ValueError):
    """The token file cannot be read or is empty."""


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
    return (os.environ.get("PAGEDKV_TOKEN", "") if env_token is None else env_token).strip()


@dataclass(slots=True, frozen=True)
class Dialer:
    """Client credentials of one role; ``channel(target)`` plus ``metadata`` on every call."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = field(default="", repr=False)

    @classmethod
    def from_settings(cls, settings: Any) -> Dialer:
        """From a role's settings (fields tls_ca, tls_client_cert, tls_client_key, token_file, token)."""
        token = settings.token.get_secret_value() if settings.token else ""
        return cls(tls_ca=settings.tls_ca, tls_cert=settings.tls_client_cert, tls_key=settings.tls_client_key,
                   token=read_token(settings.token_file, token))

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
