"""Outbound connections: a role configured with a CA refuses servers it cannot verify, and no role
sends its bearer token over plaintext (pagedkv/dial.py, docs/security.md).

- The worker (dialing the block manager and the cache host), the cache host (dialing the block
  manager, the real `pagedkv cache-host` process) and the frontend (`pagedkv serve`'s engine) with
  ``--tls-ca`` refuse a plaintext server (TLS handshake: WRONG_VERSION_NUMBER) and a TLS server
  whose certificate another CA signed (CERTIFICATE_VERIFY_FAILED); the control, the right CA,
  connects.
- Given a token and no TLS, every role and client refuses to start with InsecureTokenError naming
  ``--allow-insecure``; with it (or PAGEDKV_ALLOW_INSECURE=true) it starts.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from pydantic import SecretStr

from pagedkv.block_manager_svc.server import BlockManagerServer, start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.dial import InsecureTokenError
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.serve.server import OpenAIServer
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import serve_cache
from pagedkv.worker_svc.cache.layout import CacheGeometry
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.server import start_worker
from pagedkv.worker_svc.settings import WorkerSettings
from tests.security.conftest import TOOLS

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")} | {
    "PAGEDKV_KERNEL_BACKEND": "reference"
}
PLAINTEXT = "WRONG_VERSION_NUMBER"  # a TLS client's handshake answered by a plaintext server
FOREIGN = "CERTIFICATE_VERIFY_FAILED"  # a server certificate our CA did not sign
BLOCK_SIZE, NUM_BLOCKS = 16, 32


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A second, unrelated CA and a server certificate it signed (what an impostor would serve)."""
    out = tmp_path_factory.mktemp("other-ca")
    subprocess.run(["bash", str(TOOLS / "make_certs.sh"), str(out)], check=True, capture_output=True)
    return out


@dataclass(slots=True)
class Peers:
    """A block manager and a cache host each in three flavours: plaintext, foreign CA, our CA."""

    bm: dict[str, str]
    cache_host: dict[str, str]


@pytest.fixture(scope="module")
def peers(certs: dict[str, str], other_ca: pathlib.Path) -> Iterator[Peers]:
    tls = {
        "plain": {},
        "foreign": {"tls_cert": str(other_ca / "server.pem"), "tls_key": str(other_ca / "server.key")},
        "ours": {"tls_cert": certs["server"], "tls_key": certs["server_key"]},
    }
    cfg = load_model_config(None)
    cache = cache_memory.create(
        CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, NUM_BLOCKS, 0),
        torch.float32,
        torch.device("cpu"),
        shm_prefix=f"pagedkv-otls-{os.getpid()}",
    )
    bms: list[BlockManagerServer] = []
    hosts = []
    try:
        for kw in tls.values():
            bms.append(
                start_server(
                    BlockManagerSettings(port=0, num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **kw)
                )
            )
            hosts.append(serve_cache(cache, cfg.name, **kw))
        # 127.0.0.1, not localhost: the servers bind IPv4 loopback only, and with localhost gRPC may
        # report its last attempt ([::1]: connection refused) instead of the handshake's reason.
        yield Peers(
            bm={k: f"127.0.0.1:{r.port}" for k, r in zip(tls.keys(), bms, strict=True)},
            cache_host={k: f"127.0.0.1:{h.port}" for k, h in zip(tls.keys(), hosts, strict=True)},
        )
    finally:
        for r in bms:
            r.stop(0)
        for h in hosts:
            h.stop(0)
        cache.close()


def worker_settings(**kw: object) -> WorkerSettings:
    base = dict(
        port=0,
        device="cpu",
        block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_BLOCKS,
        connect_timeout_s=1.0,
        cache_host_check_interval_s=0,
    )
    return WorkerSettings(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("server, reason", [("plain", PLAINTEXT), ("foreign", FOREIGN)])
def test_a_worker_with_a_ca_refuses_an_unverifiable_block_manager_and_cache_host(
    peers: Peers, certs: dict[str, str], server: str, reason: str
) -> None:
    with pytest.raises(TimeoutError, match=reason) as e:
        start_worker(
            worker_settings(
                block_manager=peers.bm[server], cache_host=peers.cache_host["ours"], tls_ca=certs["ca"]
            )
        )
    assert f"block manager at {peers.bm[server]}" in str(e.value)
    with pytest.raises(TimeoutError, match=reason) as e:
        start_worker(worker_settings(cache_host=peers.cache_host[server], tls_ca=certs["ca"]))
    assert f"cache host at {peers.cache_host[server]}" in str(e.value)


def test_a_worker_with_a_ca_reaches_servers_our_ca_signed(
    peers: Peers, certs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    worker = start_worker(
        worker_settings(
            block_manager=peers.bm["ours"], cache_host=peers.cache_host["ours"], tls_ca=certs["ca"]
        )
    )
    worker.close()


def _cache_host(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "cache-host",
            "--port",
            "0",
            "--device",
            "cpu",
            "--block-size",
            str(BLOCK_SIZE),
            "--connect-timeout-s",
            "1",
            "--log-format",
            "json",
            "--shm-prefix",
            f"pagedkv-otls-ch-{os.getpid()}",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("server, reason", [("plain", PLAINTEXT), ("foreign", FOREIGN)])
def test_the_cache_host_with_a_ca_refuses_an_unverifiable_block_manager(
    peers: Peers, certs: dict[str, str], server: str, reason: str
) -> None:
    r = _cache_host(["--block-manager", peers.bm[server], "--tls-ca", certs["ca"]], ENV)
    assert r.returncode == 2, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert '"config_error"' in out and reason in out and f"block manager at {peers.bm[server]}" in out, out[
        -2000:
    ]


@pytest.mark.parametrize("server, reason", [("plain", PLAINTEXT), ("foreign", FOREIGN)])
def test_the_frontend_with_a_ca_refuses_an_unverifiable_block_manager(
    peers: Peers, certs: dict[str, str], server: str, reason: str
) -> None:
    settings = ServeSettings(
        port=0,
        block_manager=peers.bm[server],
        workers=peers.cache_host["ours"],
        tls_ca=certs["ca"],
        timeout_s=1.0,
    )
    with pytest.raises(grpc.RpcError) as e:
        OpenAIServer(settings)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE and reason in e.value.details()  # type: ignore[attr-defined]
    with BlockManagerClient(peers.bm["ours"], tls_ca=certs["ca"]) as ok:  # the control
        assert ok.get_config().num_gpu_blocks == NUM_BLOCKS


# --- a bearer token never goes over plaintext -----------------------------------------------------


def test_a_worker_with_a_token_and_no_tls_refuses_to_start_unless_allowed(
    peers: Peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    with pytest.raises(InsecureTokenError, match="--allow-insecure") as e:
        start_worker(worker_settings(cache_host=peers.cache_host["plain"], token=SecretStr("tok-worker-123")))
    assert "PAGEDKV_ALLOW_INSECURE" in str(e.value) and "tok-worker-123" not in str(e.value)
    worker = start_worker(
        worker_settings(
            cache_host=peers.cache_host["plain"], token=SecretStr("tok-worker-123"), allow_insecure=True
        )
    )
    worker.close()


def test_the_cache_host_with_a_token_and_no_tls_refuses_to_start_unless_allowed(peers: Peers) -> None:
    env = ENV | {"PAGEDKV_TOKEN": "tok-cache-host-123"}
    r = _cache_host(["--block-manager", peers.bm["plain"]], env)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "--allow-insecure" in out and "plaintext" in out, out[-2000:]
    assert "tok-cache-host-123" not in out
    # Allowed by the environment variable: it gets past the dial (and then fails on purpose: the
    # block manager's geometry does not match --block-size 4).
    r = _cache_host(
        ["--block-manager", peers.bm["plain"], "--block-size", "4"], env | {"PAGEDKV_ALLOW_INSECURE": "true"}
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "--allow-insecure" not in out and "block_size" in out, out[-2000:]


def test_the_frontend_and_clients_with_a_token_and_no_tls_refuse_unless_allowed(peers: Peers) -> None:
    common = dict(
        port=0,
        block_manager=peers.bm["plain"],
        workers=peers.cache_host["plain"],
        timeout_s=1.0,
        token=SecretStr("tok-frontend-123"),
    )
    with pytest.raises(InsecureTokenError, match="--allow-insecure"):
        OpenAIServer(ServeSettings(**common))  # type: ignore[arg-type]
    with pytest.raises(InsecureTokenError, match="--allow-insecure"):
        BlockManagerClient(peers.bm["plain"], token="tok-client-123")
    with BlockManagerClient(peers.bm["plain"], token="tok-client-123", allow_insecure=True) as c:
        assert c.get_config().num_gpu_blocks == NUM_BLOCKS
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "generate",
            "--token-ids",
            "1,2,3",
            "--max-tokens",
            "2",
            "--block-manager",
            peers.bm["plain"],
            "--workers",
            peers.cache_host["plain"],
        ],
        cwd=ROOT,
        env=ENV | {"PAGEDKV_TOKEN": "tok-generate-123"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        gen.returncode != 0 and "--allow-insecure" in gen.stderr and "tok-generate-123" not in gen.stderr
    ), gen.stderr[-2000:]
