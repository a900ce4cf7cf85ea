"""The cache host and worker gRPC services in one process: API, errors, health, geometry checks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.grpc_server import GrpcServer
from pagedkv.v1 import cache_host_pb2, cache_host_pb2_grpc, worker_pb2, worker_pb2_grpc
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import serve_cache
from pagedkv.worker_svc.cache.layout import CacheGeometry, GeometryMismatch
from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.server import start_worker, wait_for_cache_host
from pagedkv.worker_svc.settings import WorkerSettings
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.generation import Scheduler, grpc_step

BLOCK, GPU_BLOCKS, CPU_BLOCKS = 4, 48, 8


@dataclass(slots=True)
class Host:
    cache: cache_memory.SharedCache
    running: GrpcServer

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.running.port}"


@pytest.fixture(scope="module")
def host(hf_llama: HFModel) -> Iterator[Host]:
    cfg = ModelConfig.from_dir(hf_llama.path)
    geom = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, GPU_BLOCKS, CPU_BLOCKS)
    cache = cache_memory.create(geom, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-test")
    running = serve_cache(cache, cfg.name)
    yield Host(cache, running)
    running.stop(0)
    cache.close()


def worker_settings(host: Host, hf: HFModel, **kw: object) -> WorkerSettings:
    return WorkerSettings(port=0, cache_host=host.target, model=str(hf.path), device="cpu", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def worker(host: Host, hf_llama: HFModel) -> Iterator[worker_pb2_grpc.WorkerStub]:
    proc = start_worker(worker_settings(host, hf_llama, kernel_backend="reference"))
    with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as channel:
        yield worker_pb2_grpc.WorkerStub(channel)
    proc.close()


def test_cache_info_describes_the_shared_memory(host: Host) -> None:
    with grpc.insecure_channel(host.target) as ch:
        info = cache_host_pb2_grpc.CacheHostStub(ch).GetCacheInfo(cache_host_pb2.GetCacheInfoRequest())
    assert info.backend == "shm" and info.dtype == "float32"
    assert list(info.gpu_cache.shape) == [2, 2, GPU_BLOCKS, BLOCK, 2, 16]
    assert info.gpu_cache.shm_name == host.cache.descriptor.gpu.shm_name
    assert info.geometry.num_cpu_blocks == CPU_BLOCKS and info.instance_id


def test_generation_through_grpc_matches_transformers(
    worker: worker_pb2_grpc.WorkerStub, hf_llama: HFModel
) -> None:
    sched = Scheduler(grpc_step(worker), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK)
    sched.add("a", [3, 1, 4, 1, 5, 9, 2, 6])
    sched.add("b", [2, 7, 1, 8, 2, 8])
    sched.generate(["a", "b"], 12)
    assert sched.seqs["a"].generated == hf_llama.greedy([3, 1, 4, 1, 5, 9, 2, 6], 12)
    assert sched.seqs["b"].generated == hf_llama.greedy([2, 7, 1, 8, 2, 8], 12)


def test_step_returns_logits_and_logprob_on_request(
    worker: worker_pb2_grpc.WorkerStub, hf_llama: HFModel
) -> None:
    prompt = [10, 20, 30, 40, 50]
    resp = worker.Step(
        worker_pb2.WorkerStepRequest(
            sequences=[
                worker_pb2.SequenceInput(seq_id="x", token_ids=prompt, block_ids=[40, 41], return_logits=True)
            ]
        )
    )
    ref = hf_llama.last_logits(prompt)
    out = resp.outputs[0]
    torch.testing.assert_close(torch.tensor(list(out.logits)), ref, atol=1e-4, rtol=1e-4)
    assert out.token_id == int(ref.argmax())
    assert out.logprob == pytest.approx(float(torch.log_softmax(ref, -1).max()), abs=1e-4)
    assert resp.num_tokens == 5


def test_seeded_sampling_is_reproducible(worker: worker_pb2_grpc.WorkerStub) -> None:
    def draw(seed: int) -> list[int]:
        req = worker_pb2.WorkerStepRequest(
            sequences=[
                worker_pb2.SequenceInput(
                    seq_id=f"s{i}",
                    token_ids=[1, 2, 3],
                    block_ids=[42 + i],
                    sampling=worker_pb2.SamplingParams(temperature=1.5, top_k=50, seed=seed),
                )
                for i in range(4)
            ]
        )
        return [o.token_id for o in worker.Step(req).outputs]

    assert draw(11) == draw(11)
    assert len({tuple(draw(s)) for s in range(6)}) > 1


def test_invalid_step_is_invalid_argument(worker: worker_pb2_grpc.WorkerStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        worker.Step(
            worker_pb2.WorkerStepRequest(
                sequences=[worker_pb2.SequenceInput(seq_id="x", token_ids=[1, 2, 3, 4, 5], block_ids=[1])]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "need 2 blocks" in err.value.details()


def test_worker_info(worker: worker_pb2_grpc.WorkerStub, host: Host) -> None:
    info = worker.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
    assert info.vocab_size == 128 and info.num_kv_heads == 2 and info.geometry.block_size == BLOCK
    assert info.cache_instance_id == host.cache.descriptor.instance_id and info.kernel_backend == "reference"
    # The CPU kernel path of the worker's process (here the test process): native-<variant> or torch.
    from pagedkv.kernels.cpu import native as cpu_native

    assert info.cpu_kernel_path == cpu_native.kernel_path() and info.cpu_kernel_path.startswith(
        ("native-", "torch")
    )
    assert list(info.cuda_graph_sizes) == []  # CUDA graphs are for CUDA workers: every step eager


def test_health_and_reflection_on_both_services(host: Host, hf_llama: HFModel) -> None:
    proc = start_worker(worker_settings(host, hf_llama))
    try:
        for port, service in (
            (proc.running.port, "pagedkv.v1.Worker"),
            (host.running.port, "pagedkv.v1.CacheHost"),
        ):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
                assert status.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                resp = next(
                    refl.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                )
                names = {s.name for s in resp.list_services_response.service}
                assert service in names and "grpc.health.v1.Health" in names
    finally:
        proc.close()


def test_a_worker_that_requires_tokens_offers_no_step_channel(
    host: Host, hf_llama: HFModel, tmp_path: Path
) -> None:
    """The step channel checks the peer's uid, not a bearer token: with --auth-tokens-file every
    step goes over gRPC, where the token is checked. Without it the worker offers the channel."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps({"tenants": [{"name": "f", "token_sha256": hashlib.sha256(b"t").hexdigest()}]})
    )
    for kw, offered in (({}, True), ({"auth_tokens_file": str(tokens)}, False)):
        proc = start_worker(worker_settings(host, hf_llama, kernel_backend="reference", **kw))
        try:
            assert (proc.step_channel is not None) == offered, kw
            assert bool(proc.servicer._info.step_channel) == offered, kw  # noqa: SLF001 - what GetWorkerInfo says
        finally:
            proc.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_size": 8}, r"block_size: settings has 8, the cache host at .* has 4"),
        ({"num_gpu_blocks": 12}, r"num_gpu_blocks: settings has 12"),
        ({"num_layers": 3}, r"num_layers: settings \(--num-layers\) have 3"),
        ({"dtype": "float16"}, r"dtype mismatch: settings have float16, the cache host has float32"),
    ],
)
def test_worker_refuses_a_geometry_mismatch_naming_the_value(
    host: Host, hf_llama: HFModel, kw: dict, match: str
) -> None:
    with pytest.raises(GeometryMismatch, match=match):
        start_worker(worker_settings(host, hf_llama, **kw))


def test_worker_model_must_match_the_cache(host: Host) -> None:
    import pathlib
    import tempfile

    from tests.worker_svc.conftest import build_hf_model

    with tempfile.TemporaryDirectory() as d:
        other = build_hf_model(pathlib.Path(d), num_hidden_layers=3)
        with pytest.raises(GeometryMismatch, match=r"num_layers: model .* has 3, the cache host .* has 2"):
            start_worker(worker_settings(host, other))


def test_block_manager_geometry_is_read_and_checked(host: Host, hf_llama: HFModel) -> None:
    from pagedkv.block_manager_svc.server import start_server as start_bm
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    bm = start_bm(
        BlockManagerSettings(port=0, block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=CPU_BLOCKS)
    )
    bad_bm = start_bm(
        BlockManagerSettings(port=0, block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=CPU_BLOCKS)
    )
    try:
        proc = start_worker(worker_settings(host, hf_llama, block_manager=f"127.0.0.1:{bm.port}"))
        proc.close()
        with pytest.raises(
            GeometryMismatch, match=r"num_gpu_blocks: the block manager has 64, the cache host .* has 48"
        ):
            start_worker(worker_settings(host, hf_llama, block_manager=f"127.0.0.1:{bad_bm.port}"))
        with pytest.raises(
            GeometryMismatch, match=r"block_size: settings .* have 16, the block manager has 4"
        ):
            start_worker(worker_settings(host, hf_llama, block_size=16, block_manager=f"127.0.0.1:{bm.port}"))
    finally:
        bm.stop(0)
        bad_bm.stop(0)


def test_wait_for_cache_host_times_out_with_a_clear_error() -> None:
    with pytest.raises(TimeoutError, match="did not answer within"):
        wait_for_cache_host("127.0.0.1:1", timeout_s=0.5)


def test_a_workers_kernel_backend_is_its_own_not_the_process_environment(
    host: Host, hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kernel-backend of an in-process worker applies to its steps only: os.environ is unchanged
    and another runner in the process keeps the default backend."""
    import os

    from pagedkv import kernels
    from pagedkv.kernels import backend
    from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    default = kernels.backend_for(host.cache.gpu)
    assert default != "reference"
    calls = {"reference": 0, default: 0}
    for name in calls:
        ops = backend.get(name)
        real = ops.paged_prefill_attention

        def spy(*a: object, _real: object = real, _name: str = name, **kw: object) -> torch.Tensor:
            calls[_name] += 1
            return _real(*a, **kw)  # type: ignore[operator]

        monkeypatch.setattr(ops, "paged_prefill_attention", spy)
    env_before = dict(os.environ)
    proc = start_worker(worker_settings(host, hf_llama, kernel_backend="reference"))
    try:
        assert dict(os.environ) == env_before
        with grpc.insecure_channel(f"127.0.0.1:{proc.running.port}") as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
            assert info.kernel_backend == "reference"
            worker_pb2_grpc.WorkerStub(ch).Step(
                worker_pb2.WorkerStepRequest(
                    sequences=[worker_pb2.SequenceInput(seq_id="k", token_ids=[3, 1, 4], block_ids=[44])]
                )
            )
        layers = proc.servicer._runner.model.cfg.num_layers
        assert calls == {"reference": layers, default: 0}
        other = ModelRunner(proc.servicer._runner.model, host.cache.gpu, host.cache.cpu)
        assert other.kernel_backend is None and kernels.backend_for(host.cache.gpu) == default
        other.step([SequenceRequest("k2", [3, 1, 4], [45], 0)])
        assert calls == {"reference": layers, default: layers}
    finally:
        proc.close()
    assert dict(os.environ) == env_before
