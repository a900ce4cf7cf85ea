"""Shared weights (worker_svc/cache/shared_weights.py): one copy in the cache host, mapped by every worker.

In process: a model built on views of the shared region (the fused tensors, no copy) computes the
same logits as a privately loaded model, tied embeddings stay one tensor, and weights that do not
fit the model are refused before anything is mapped. As processes: workers report
``shared_weights`` and their role, map (not load) the host's region, generate transformers' tokens,
and a worker told to load other weights than the host shares refuses to start.
"""

from __future__ import annotations

import signal

import grpc
import pytest
import torch

from pagedkv.v1 import worker_pb2, worker_pb2_grpc
from pagedkv.worker_svc.cache import shared_weights
from pagedkv.worker_svc.cache.layout import CacheGeometry
from pagedkv.worker_svc.cache.memory import create
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.llama import LlamaModel
from pagedkv.worker_svc.model.weights import fuse, fused_shapes, fused_spec, load_checkpoint, load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest
from tests.worker_svc.conftest import HFModel, build_hf_model
from tests.worker_svc.generation import Scheduler, grpc_step
from tests.worker_svc.test_processes import (
    BLOCK,
    GPU_BLOCKS,
    PROMPT,
    Proc,
    procs,
    start_cache_host,
    start_worker,
)

__all__ = ["procs"]  # the fixture, re-exported for pytest

CPU = torch.device("cpu")


def _logits(model: object, cfg: object) -> torch.Tensor:
    geometry = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, 16, 0)  # type: ignore[attr-defined]
    cache = create(geometry, torch.float32, CPU, shm_prefix="pagedkv-sw-test")
    try:
        runner = ModelRunner(model, cache.gpu, cache.cpu)  # type: ignore[arg-type]
        seq = SequenceRequest("s", PROMPT, [0, 1, 2], 0, return_logits=True)
        out = runner.step([seq]).outputs[0]
        assert out.logits is not None
        return out.logits.clone()
    finally:
        cache.close()


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_on_the_shared_region_computes_what_a_private_model_computes(tmp_path, tied: bool) -> None:
    hf = build_hf_model(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    cfg = load_model_config(str(hf.path))
    expected = _logits(load_model(str(hf.path), cfg, torch.float32, CPU), cfg)

    state = fuse(load_checkpoint(str(hf.path), cfg, torch.float32, CPU), cfg)
    assert {n: tuple(t.shape) for n, t in state.items()} == fused_shapes(cfg)
    host = shared_weights.pack(state, CPU, "model:m", shm_prefix="pagedkv-sw-test")
    try:
        mapped = shared_weights.bind(host.descriptor, CPU, fused_spec(None, cfg, torch.float32))
        try:
            model = LlamaModel(cfg, mapped.tensors)
            # Built on the views: every tensor the model computes with lives in the region.
            region = mapped.tensors["model.embed_tokens.weight"].untyped_storage().data_ptr()
            layer = model.layers[0]
            # (A linear prepacked for oneDNN on CPU keeps its packed copy privately, beside the view.)
            for t in (
                model.embed,
                model.lm_head.weight,
                model.norm,
                layer.qkv.weight,
                layer.gate_up.weight,
                layer.down.weight,
            ):
                assert t.untyped_storage().data_ptr() == region
            assert (
                model.lm_head.weight.data_ptr() == model.embed.data_ptr()
            ) is tied  # one copy of a tied head
            torch.testing.assert_close(_logits(model, cfg), expected, rtol=0, atol=0)
            # Host and worker share memory: a write through one shows in the other.
            host.tensors["model.norm.weight"][0] += 1.0
            assert model.norm[0] == host.tensors["model.norm.weight"][0]
        finally:
            mapped.close()
    finally:
        host.close()


def test_weights_that_do_not_fit_are_refused(tmp_path) -> None:
    hf = build_hf_model(tmp_path / "m", seed=1)
    cfg = load_model_config(str(hf.path))
    state = fuse(load_checkpoint(str(hf.path), cfg, torch.float32, CPU), cfg)
    host = shared_weights.pack(state, CPU, "x", "pagedkv-sw-test")
    try:
        with pytest.raises(ValueError, match="float16"):
            shared_weights.bind(host.descriptor, CPU, fused_spec(None, cfg, torch.float16))
        other = build_hf_model(tmp_path / "o", seed=1, num_hidden_layers=3)
        with pytest.raises(ValueError, match="tensors differ"):
            shared_weights.bind(
                host.descriptor, CPU, fused_spec(None, load_model_config(str(other.path)), torch.float32)
            )
    finally:
        host.close()


def _info(port: int) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)


def test_role_workers_map_the_hosts_weights_and_generate_exactly(
    hf_llama: HFModel, tmp_path, procs: list[Proc]
) -> None:
    host, ready = start_cache_host(hf_llama.path)
    procs.append(host)
    assert ready["weights_bytes"] > 0 and ready["weights_source"] == f"model:{hf_llama.path.name}"
    p = start_worker(
        hf_llama.path, ready["port"], "--role", "prefill", "--cpu-affinity", "0", "--num-threads", "1"
    )
    d = start_worker(hf_llama.path, ready["port"], "--role", "decode")
    procs += [p, d]
    p_ready, d_ready = p.wait_event("worker_ready"), d.wait_event("worker_ready")
    assert p_ready["shared_weights"] and d_ready["shared_weights"]
    assert p_ready["cpus"] == [0] and p_ready["threads"] == 1
    pi, di = _info(p_ready["port"]), _info(d_ready["port"])
    assert (pi.role, di.role) == (worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE)
    assert pi.shared_weights and di.shared_weights
    # Prompt on the prefill worker, decode on the decode worker: one cache, one copy of the weights.
    with (
        grpc.insecure_channel(f"127.0.0.1:{p_ready['port']}") as cp,
        grpc.insecure_channel(f"127.0.0.1:{d_ready['port']}") as cd,
    ):
        sched = Scheduler(
            grpc_step(worker_pb2_grpc.WorkerStub(cp)), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK
        )
        sched.add("s", PROMPT)
        sched.run(["s"])
        sched.step_fn = grpc_step(worker_pb2_grpc.WorkerStub(cd))
        sched.generate(["s"], 7)
    assert sched.seqs["s"].generated == hf_llama.greedy(PROMPT, 8)
    # A local-weights worker still works beside them (and says so); one configured for other
    # weights, or for a CPU this machine lacks, refuses to start (exit code 2, the reason logged).
    loc = start_worker(hf_llama.path, ready["port"], "--weights", "local")
    other = start_worker(build_hf_model(tmp_path / "other-model", seed=5).path, ready["port"])
    bad_cpu = start_worker(hf_llama.path, ready["port"], "--cpu-affinity", "0,4096")
    procs += [loc, other, bad_cpu]
    assert loc.wait_event("worker_ready")["shared_weights"] is False
    assert other.p.wait(60) == 2 and bad_cpu.p.wait(60) == 2
    err = other.wait_event("config_error")["error"]
    assert "weights mismatch" in err and "other-model" in err
    assert "CPU 4096 is not available" in bad_cpu.wait_event("config_error")["error"]
    for w in (p, d, loc):
        assert w.stop() == 0
    assert host.stop(signal.SIGTERM) == 0
