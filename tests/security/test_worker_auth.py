"""Bearer tokens on the Worker API: no token, no steps (whoever may call a worker can read any KV)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.dial import InsecureTokenError
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import serve_cache
from pagedkv.worker_svc.cache.layout import CacheGeometry
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.server import start_worker
from pagedkv.worker_svc.settings import WorkerSettings
from tests.security.conftest import TOKENS, write_tokens


@pytest.fixture
def worker_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    cfg = load_model_config(None)
    geometry = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 32, 0)
    cache = cache_memory.create(geometry, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-wauth")
    host = serve_cache(cache, cfg.name)
    worker = start_worker(
        WorkerSettings(
            port=0,
            cache_host=f"127.0.0.1:{host.port}",
            device="cpu",
            block_size=16,
            num_gpu_blocks=32,
            auth_tokens_file=write_tokens(tmp_path / "tokens.json"),
            cache_host_check_interval_s=0,
        )
    )
    try:
        yield f"127.0.0.1:{worker.running.port}"
    finally:
        worker.close()
        host.stop(0)
        cache.close()


def step_request() -> wpb.WorkerStepRequest:
    return wpb.WorkerStepRequest(
        sequences=[wpb.SequenceInput(seq_id="s", token_ids=[1, 2, 3], block_ids=[0])]
    )


def test_worker_steps_need_a_valid_token(worker_target: str) -> None:
    with WorkerClient(worker_target) as anonymous:
        with pytest.raises(grpc.RpcError) as info:
            anonymous.step(step_request(), timeout_s=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A token over plaintext only with allow_insecure=True (pagedkv/dial.py; this worker serves plaintext).
    with pytest.raises(InsecureTokenError, match="--allow-insecure"):
        WorkerClient(worker_target, token=TOKENS["root"])
    with WorkerClient(worker_target, token="not-a-token", allow_insecure=True) as forged:
        with pytest.raises(grpc.RpcError) as info:
            forged.get_info(timeout_s=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with WorkerClient(
        worker_target, token=TOKENS["reader"], allow_insecure=True
    ) as reader:  # allowed GetStats/GetConfig only
        with pytest.raises(grpc.RpcError) as info:
            reader.step(step_request(), timeout_s=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with WorkerClient(worker_target, token=TOKENS["root"], allow_insecure=True) as frontend:
        out = frontend.step(step_request(), timeout_s=30).outputs
        assert len(out) == 1 and out[0].seq_id == "s"
    with grpc.insecure_channel(worker_target) as ch:  # orchestrators' health checks stay open
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
