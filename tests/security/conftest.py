"""Fixtures: throwaway certificates, a tokens file, and block managers over real TLS."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.auth import hash_token
from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.tls import channel
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

TOOLS = Path(__file__).resolve().parents[2] / "tools"

TOKENS = {
    "alice": "tok-alice-0123456789",
    "bob": "tok-bob-0123456789",
    "root": "tok-root-0123456789",
    "reader": "tok-reader-0123456789",
}


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """tools/make_certs.sh (openssl, or its `cryptography` fallback), as a user would run it."""
    out = tmp_path_factory.mktemp("certs")
    if shutil.which("openssl") is None:
        pytest.importorskip("cryptography")
    subprocess.run(["bash", str(TOOLS / "make_certs.sh"), str(out)], check=True, capture_output=True)
    names = {
        "ca": "ca.pem",
        "server": "server.pem",
        "server_key": "server.key",
        "client": "client.pem",
        "client_key": "client.key",
    }
    return {k: str(out / v) for k, v in names.items()}


def write_tokens(path: Path, **quotas: dict) -> str:
    tenants = [
        {"name": "alice", "token_sha256": hash_token(TOKENS["alice"]), **quotas.get("alice", {})},
        {"name": "bob", "token_sha256": hash_token(TOKENS["bob"]), **quotas.get("bob", {})},
        {"name": "root", "token_sha256": hash_token(TOKENS["root"]), "admin": True},
        {"name": "reader", "token_sha256": hash_token(TOKENS["reader"]), "allow": ["GetStats", "GetConfig"]},
    ]
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


@pytest.fixture
def secure_factory(certs: dict[str, str], tmp_path: Path) -> Iterator[object]:
    """make(quotas=..., mtls=True, **settings) -> (BlockManagerServer, open_channel(client_cert=True))."""
    started: list[BlockManagerServer] = []

    def make(quotas: dict | None = None, mtls: bool = True, auth: bool = True, **overrides: object):  # type: ignore[no-untyped-def]
        kw: dict = {"port": 0, "tls_cert": certs["server"], "tls_key": certs["server_key"]}
        if mtls:
            kw["tls_client_ca"] = certs["ca"]
        if auth:
            kw["auth_tokens_file"] = write_tokens(tmp_path / f"tokens{len(started)}.json", **(quotas or {}))
        kw.update(overrides)
        running = start_server(BlockManagerSettings(**kw))
        started.append(running)
        return running

    yield make
    for r in started:
        r.stop(0)


def open_channel(certs: dict[str, str], port: int, client_cert: bool = True) -> grpc.Channel:
    if client_cert:
        return channel(
            f"localhost:{port}", tls_ca=certs["ca"], tls_cert=certs["client"], tls_key=certs["client_key"]
        )
    return channel(f"localhost:{port}", tls_ca=certs["ca"])


class Caller:
    """A stub plus a tenant's token metadata."""

    def __init__(self, ch: grpc.Channel, tenant: str | None) -> None:
        self.stub = pb_grpc.BlockManagerStub(ch)
        self.md = (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        method = getattr(self.stub, name)
        return lambda req, **kw: method(req, metadata=self.md, timeout=10, **kw)
