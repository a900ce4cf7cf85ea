"""Command-line flags for reaching secured services: TLS and a bearer token.

Shared by `pagedkv generate` and `pagedkv demo`. The token is read from
PAGEDKV_TOKEN or a file, never from a flag value, so it does not show up in
the process list or shell history.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection security (for a stack started with TLS / tokens)")
    group.add_argument("--tls-ca", default=os.environ.get("PAGEDKV_TLS_CA", ""),
                       help="CA bundle to verify the servers (turns TLS on) [env PAGEDKV_TLS_CA]")
    group.add_argument("--tls-cert", default=os.environ.get("PAGEDKV_TLS_CLIENT_CERT", ""),
                       help="client certificate for mutual TLS [env PAGEDKV_TLS_CLIENT_CERT]")
    group.add_argument("--tls-key", default=os.environ.get("PAGEDKV_TLS_CLIENT_KEY", ""),
                       help="client key for mutual TLS [env PAGEDKV_TLS_CLIENT_KEY]")
    group.add_argument("--token-file", default="",
                       help="file holding the bearer token (default: env PAGEDKV_TOKEN)")


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for BlockManagerClient / WorkerClient from the parsed flags."""
    token = os.environ.get("PAGEDKV_TOKEN", "")
    if args.token_file:
        token = pathlib.Path(args.token_file).read_text().strip()
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key, "token": token}
