"""`pagedkv generate` against a stack that requires mutual TLS and a bearer token."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.security.conftest import TOKENS
from worker_svc import cache_memory
from worker_svc.cache_host import serve_cache
from worker_svc.cache_layout import CacheGeometry
from worker_svc.model.config import load_model_config
from worker_svc.server import start_worker
from worker_svc.settings import WorkerSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKS, BLOCK_SIZE = 64, 16


@pytest.fixture
def secure_stack(secure_factory, certs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    bm = secure_factory(num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE)
    cfg = load_model_config(None)
    geometry = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, BLOCKS, 0)
    cache = cache_memory.create(geometry, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-sec")
    host = serve_cache(cache, cfg.name)
    worker = start_worker(WorkerSettings(
        port=0, cache_host=f"127.0.0.1:{host.port}", device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks=BLOCKS,
        tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"],
    ))
    try:
        yield bm.port, worker.running.port
    finally:
        worker.close()
        host.stop(0)
        cache.close()


def generate(bm: int, worker: int, certs: dict[str, str], token: str | None,
             client_cert: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_TOKEN"}
    if token is not None:
        env["PAGEDKV_TOKEN"] = token
    args = [sys.executable, "-m", "pagedkv.cli", "generate", "--token-ids", "1,2,3", "--max-tokens", "4",
            "--block-manager", f"localhost:{bm}", "--workers", f"localhost:{worker}", "--timeout-s", "10",
            "--tls-ca", certs["ca"]]
    if client_cert:
        args += ["--tls-cert", certs["client"], "--tls-key", certs["client_key"]]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_generate_over_mtls_with_a_token(secure_stack, certs) -> None:  # type: ignore[no-untyped-def]
    bm, worker = secure_stack
    ok = generate(bm, worker, certs, TOKENS["alice"])
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["completions"][0]["token_ids"]) == 4
    assert TOKENS["alice"] not in ok.stderr


def test_generate_without_token_or_client_cert_is_refused(secure_stack, certs) -> None:  # type: ignore[no-untyped-def]
    bm, worker = secure_stack
    no_token = generate(bm, worker, certs, None)
    assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr
    no_cert = generate(bm, worker, certs, TOKENS["alice"], client_cert=False)
    assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr
