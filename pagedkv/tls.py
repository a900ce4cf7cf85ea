"""TLS for every pagedkv gRPC server and client (docs/security.md).

Server rule (one for the block manager, the cache host and the workers):
- ``tls_cert`` + ``tls_key`` set: the port is TLS; with ``tls_client_ca`` also
  set it is mutual TLS (client certificates required and verified).
- neither set: plaintext, allowed only when binding a loopback address
  (127.0.0.0/8, ::1, localhost) or when ``allow_insecure`` is given
  explicitly (docker-compose sets PAGEDKV_ALLOW_INSECURE=true inside its
  private network). Anything else refuses to start with a message.

Clients: ``channel(target, tls_ca=..., tls_cert=..., tls_key=...)`` makes a
secure channel when any TLS file is given, else a plaintext one.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from pagedkv import envs


class TlsConfigError(RuntimeError):
    """The TLS settings are incomplete or unsafe; the message says how to fix them."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"cannot read {what} {path!r}: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    if h in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    if bool(cert) != bool(key):
        raise TlsConfigError("TLS needs both tls_cert and tls_key (PAGEDKV_TLS_CERT, PAGEDKV_TLS_KEY)")
    ca = _read(client_ca, "client CA bundle") if client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def add_port(
    server: grpc.Server,
    host: str,
    port: int,
    *,
    tls_cert: str = "",
    tls_key: str = "",
    tls_client_ca: str = "",
    allow_insecure: bool = False,
) -> int:
    """Bind ``host:port`` by the rule above; returns the bound port (raises RuntimeError)."""
    address = f"{host}:{port}"
    if tls_client_ca and not tls_cert:
        raise TlsConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
    try:
        if tls_cert or tls_key:
            bound = server.add_secure_port(address, server_credentials(tls_cert, tls_key, tls_client_ca))
        else:
            if not allow_insecure and not is_loopback(host):
                raise TlsConfigError(
                    f"refusing to serve plaintext gRPC on non-loopback address {host!r}: set "
                    "--tls-cert/--tls-key (PAGEDKV_TLS_CERT/PAGEDKV_TLS_KEY), or pass --allow-insecure "
                    "(PAGEDKV_ALLOW_INSECURE=true) on a network you trust"
                )
            bound = server.add_insecure_port(address)
    except TlsConfigError:
        raise
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from e
    if bound == 0:
        raise RuntimeError(f"cannot listen on {address} (address in use or not local?)")
    return bound


def channel_credentials(tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> grpc.ChannelCredentials:
    if bool(tls_cert) != bool(tls_key):
        raise TlsConfigError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca, "CA bundle") if tls_ca else None,
        private_key=_read(tls_key, "TLS key") if tls_key else None,
        certificate_chain=_read(tls_cert, "TLS certificate") if tls_cert else None,
    )


def channel(
    target: str,
    *,
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    options: Sequence[tuple[str, Any]] | None = None,
    aio: bool = False,
) -> Any:
    """A sync (or grpc.aio) channel: TLS when any TLS file is given, else plaintext."""
    mod: Any = grpc.aio if aio else grpc
    if tls_ca or tls_cert or tls_key:
        return mod.secure_channel(target, channel_credentials(tls_ca, tls_cert, tls_key), options=options)
    return mod.insecure_channel(target, options=options)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (works on plaintext and TLS channels alike)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def add_client_tls_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--tls-ca/--tls-cert/--tls-key`` (defaults from ``PAGEDKV_TLS_CA`` / ``PAGEDKV_TLS_CLIENT_CERT``
    / ``PAGEDKV_TLS_CLIENT_KEY``) for a command that dials a role: one definition for every client
    (``frontend/clients/connection.py``, ``pagedkv/healthcheck.py``), so the flags and variables never
    drift."""
    parser.add_argument(
        "--tls-ca",
        default=envs.get_str("PAGEDKV_TLS_CA"),
        help="CA bundle to verify the servers (turns TLS on) [env PAGEDKV_TLS_CA]",
    )
    parser.add_argument(
        "--tls-cert",
        default=envs.get_str("PAGEDKV_TLS_CLIENT_CERT"),
        help="client certificate for mutual TLS [env PAGEDKV_TLS_CLIENT_CERT]",
    )
    parser.add_argument(
        "--tls-key",
        default=envs.get_str("PAGEDKV_TLS_CLIENT_KEY"),
        help="client key for mutual TLS [env PAGEDKV_TLS_CLIENT_KEY]",
    )
