"""How `pagedkv up --tls-dir DIR --auth-tokens-file FILE` secures every connection of the stack.

Servers: every role serves mutual TLS with ``DIR/server.pem``, ``DIR/server.key`` and client
certificates verified against ``DIR/ca.pem`` (the layout ``tools/make_certs.sh DIR`` writes). The
block manager, the cache host and the workers require bearer tokens from the tokens file.

Connections between the roles (cache host -> block manager, worker -> block manager and cache host)
present ``DIR/client.pem`` / ``DIR/client.key`` and a token of their own. That token is made here,
at start-up: a fresh random one whose hash is added, as tenant ``pagedkv-stack``, to a private copy
of the user's tokens file, allowed only ``GetConfig`` and ``GetCacheInfo`` (what the roles call at
start-up and to watch the cache host) and ``ResetPrefixCache`` (a starting cache host's, which needs
an admin: the tenant is one). The user's file is never changed and the stack's token never
leaves the processes of the stack (it reaches them by environment variable, not by a flag).

The frontend (`pagedkv serve`) serves HTTPS with the same server certificate and client CA, dials
with the client certificate, and gets a token of its own (tenant ``pagedkv-frontend``, every method:
its engine allocates and steps), made the same way and handed over the same way.

Clients (``pagedkv generate / demo / loadtest``) connect with ``--tls-ca DIR/ca.pem --tls-cert
DIR/client.pem --tls-key DIR/client.key`` and one of the user's tokens (``PAGEDKV_TOKEN`` or
``--token-file``).
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field

from pagedkv.auth import TokenFileError, TokenStore, hash_token, read_tokens_file

STACK_TENANT = "pagedkv-stack"
FRONTEND_TENANT = "pagedkv-frontend"
# ResetPrefixCache: a starting cache host drops the manager's prefix hits on the previous instance's
# memory (worker_svc/peers.py, forget_stale_prefixes); it is for admins, so the stack tenant is one.
STACK_METHODS = ("GetConfig", "GetCacheInfo", "ResetPrefixCache")
TLS_FILES = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")


class StackSecurityError(RuntimeError):
    """Missing certificate files or a bad tokens file; the message says how to fix it."""


@dataclass(slots=True)
class StackSecurity:
    """The flags, environment and health-probe credentials of a secured (or plain) stack."""

    tls_dir: str = ""
    auth_tokens_file: str = ""
    role_tokens_file: str = ""  # the user's tenants + the stack's own, in a private directory
    role_token: str = field(default="", repr=False)
    frontend_token: str = field(default="", repr=False)
    allow_insecure: bool = False  # tokens without TLS (pagedkv/dial.py refuses them otherwise)
    _workdir: str = ""

    @classmethod
    def prepare(
        cls, tls_dir: str | None, auth_tokens_file: str | None, allow_insecure: bool = False
    ) -> StackSecurity:
        """Check the files and, with tokens, write the private tokens file (call ``close`` after)."""
        sec = cls(
            tls_dir=str(pathlib.Path(tls_dir).resolve()) if tls_dir else "",
            auth_tokens_file=auth_tokens_file or "",
            allow_insecure=allow_insecure,
        )
        if sec.auth_tokens_file and not sec.tls_dir and not allow_insecure:
            raise StackSecurityError(
                "--auth-tokens-file without --tls-dir would send the stack's bearer tokens in plaintext: add "
                "--tls-dir DIR (tools/make_certs.sh DIR), or pass --allow-insecure on a network you trust"
            )
        if sec.tls_dir:
            missing = [n for n in TLS_FILES if not (pathlib.Path(sec.tls_dir) / n).is_file()]
            if missing:
                raise StackSecurityError(
                    f"--tls-dir {tls_dir}: missing {', '.join(missing)}; create a throwaway CA and "
                    "certificates "
                    f"with `tools/make_certs.sh {tls_dir}` or put your own there under these names"
                )
        if sec.auth_tokens_file:
            try:
                data = read_tokens_file(sec.auth_tokens_file)
                TokenStore.from_dict(data, sec.auth_tokens_file)  # the user's file must be valid on its own
            except TokenFileError as e:
                raise StackSecurityError(str(e)) from None
            tenants = list(data["tenants"])
            reserved = next(
                (t.get("name") for t in tenants if t.get("name") in (STACK_TENANT, FRONTEND_TENANT)), None
            )
            if reserved:
                raise StackSecurityError(
                    f"{sec.auth_tokens_file}: tenant name {reserved!r} is reserved for "
                    "the stack's own connections"
                )
            sec.role_token = secrets.token_urlsafe(32)
            tenants.append(
                {
                    "name": STACK_TENANT,
                    "token_sha256": hash_token(sec.role_token),
                    "admin": True,
                    "allow": list(STACK_METHODS),
                }
            )
            sec.frontend_token = secrets.token_urlsafe(32)
            tenants.append({"name": FRONTEND_TENANT, "token_sha256": hash_token(sec.frontend_token)})
            sec._workdir = tempfile.mkdtemp(prefix="pagedkv-up-auth-")  # mode 0700
            path = pathlib.Path(sec._workdir) / "tokens.json"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"tenants": tenants}, f)
            sec.role_tokens_file = str(path)
        return sec

    def _tls(self, name: str) -> str:
        return str(pathlib.Path(self.tls_dir) / name)

    def server_args(self) -> list[str]:
        """Flags of every role's own server: mutual TLS and the tokens file."""
        args: list[str] = []
        if self.tls_dir:
            args += [
                "--tls-cert",
                self._tls("server.pem"),
                "--tls-key",
                self._tls("server.key"),
                "--tls-client-ca",
                self._tls("ca.pem"),
            ]
        if self.role_tokens_file:
            args += ["--auth-tokens-file", self.role_tokens_file]
        return args

    def dial_args(self) -> list[str]:
        """Flags of a role that dials another (cache host, worker): client-side TLS."""
        if not self.tls_dir:
            return []
        return [
            "--tls-ca",
            self._tls("ca.pem"),
            "--tls-client-cert",
            self._tls("client.pem"),
            "--tls-client-key",
            self._tls("client.key"),
        ]

    def frontend_args(self) -> list[str]:
        """Flags of `pagedkv serve`: HTTPS with mutual TLS, and client TLS to the other roles."""
        if not self.tls_dir:
            return []
        return [
            "--tls-cert",
            self._tls("server.pem"),
            "--tls-key",
            self._tls("server.key"),
            "--tls-client-ca",
            self._tls("ca.pem"),
            *self.dial_args(),
        ]

    def frontend_env(self) -> dict[str, str]:
        """The frontend's own token (its engine calls every method), by environment variable."""
        return {"PAGEDKV_TOKEN": self.frontend_token, **self._insecure()} if self.frontend_token else {}

    def env(self) -> dict[str, str]:
        """Environment of the stack's processes: the stack's token (never a flag)."""
        return {"PAGEDKV_TOKEN": self.role_token, **self._insecure()} if self.role_token else {}

    def _insecure(self) -> dict[str, str]:
        """Tokens over plaintext, when --allow-insecure said so (else no role would start)."""
        return {"PAGEDKV_ALLOW_INSECURE": "true"} if self.allow_insecure and not self.tls_dir else {}

    def client_tls(self) -> dict[str, str]:
        """tls_ca / tls_cert / tls_key for a client of this stack (health probes, demo's engine)."""
        if not self.tls_dir:
            return {}
        return {
            "tls_ca": self._tls("ca.pem"),
            "tls_cert": self._tls("client.pem"),
            "tls_key": self._tls("client.key"),
        }

    def client_flags(self) -> str:
        """What `pagedkv generate / demo / loadtest` need to reach this stack, for the ready message."""
        parts = []
        if self.tls_dir:
            parts.append(
                f"--tls-ca {self._tls('ca.pem')} --tls-cert {self._tls('client.pem')} "
                f"--tls-key {self._tls('client.key')}"
            )
        if self.auth_tokens_file:
            parts.append("--token-file FILE (or PAGEDKV_TOKEN; a token of " + self.auth_tokens_file + ")")
            if not self.tls_dir:  # the client's own rule: no token over plaintext unless allowed
                parts.append("--allow-insecure")
        return " ".join(parts)

    def close(self) -> None:
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = ""
