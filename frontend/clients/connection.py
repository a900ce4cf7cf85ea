"""Command-line flags for reaching secured services: TLS and a bearer token.

Shared by `pagedkv generate`, `demo` and `loadtest`. The token is read from
PAGEDKV_TOKEN or a file, never from a flag value, so it does not show up in
the process list or shell history. The variable names are the ones the roles
read for their own outbound connections (pagedkv/dial.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv import envs
from pagedkv.dial import check_token_transport, read_token
from pagedkv.tls import add_client_tls_args


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection security (for a stack started with TLS / tokens)")
    add_client_tls_args(group)
    group.add_argument(
        "--token-file",
        default=envs.get_str("PAGEDKV_TOKEN_FILE"),
        help="file holding the bearer token [env PAGEDKV_TOKEN_FILE; else the token is env PAGEDKV_TOKEN]",
    )
    group.add_argument(
        "--allow-insecure",
        action="store_true",
        default=envs.get_bool("PAGEDKV_ALLOW_INSECURE"),
        help="allow sending the token without TLS (trusted networks only) [env PAGEDKV_ALLOW_INSECURE]",
    )


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for BlockManagerClient / WorkerClient from the parsed flags
    (raises pagedkv.dial.TokenError for an unreadable or empty token file, InsecureTokenError for a
    token without TLS and without --allow-insecure)."""
    token = read_token(args.token_file)
    check_token_transport(token, bool(args.tls_ca or args.tls_cert or args.tls_key), args.allow_insecure)
    return {
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "token": token,
        "allow_insecure": args.allow_insecure,
    }
