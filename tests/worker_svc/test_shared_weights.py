"""Shared weights (worker_svc/shared_weights.py): one copy in the cache host, mapped by every worker.

In process: a packed model and a meta skeleton bound to the same region compute the same logits as
a privately loaded model, tied embeddings stay one tensor, and weights that do not fit the model are
refused before anything is bound. As processes: workers report ``shared_weights`` and their role,
map (not load) the host's region, generate transformers' tokens, and a worker told to load other
weights than the host shares refuses to start.
"""

from __future__ import annotations

import signal

import grpc
import pytest
import torch

from pagedkv.v1 import worker_pb2, worker_pb2_grpc
from tests.worker_svc.conftest import HFModel, build_hf_model
from tests.worker_svc.generation import Scheduler, grpc_step
from tests.worker_svc.test_processes import BLOCK, GPU_BLOCKS, PROMPT, Proc, procs, start_cache_host, start_worker
from worker_svc import shared_weights
from worker_svc.cache_layout import CacheGeometry
from worker_svc.cache_memory import create
from worker_svc.model.config import load_model_config
from worker_svc.model.weights import load_model, model_skeleton
from worker_svc.model_runner import ModelRunner, SequenceRequest

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
def test_bound_skeleton_computes_what_a_private_model_computes(tmp_path, tied: bool) -> None:
    hf = build_hf_model(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    cfg = load_model_config(str(hf.path))
    private = load_model(str(hf.path), cfg, torch.float32, CPU)
    expected = _logits(private, cfg)

    host_model = load_model(str(hf.path), cfg, torch.float32, CPU)
    region = shared_weights.pack(host_model, CPU, "model:m", shm_prefix="pagedkv-sw-test")
    try:
        skeleton = model_skeleton(cfg, torch.float32)
        assert skeleton.embed.device.type == "meta"
        mapped = shared_weights.bind(skeleton, region.descriptor, CPU)
        try:
            assert skeleton.device == CPU
            assert all(t.device == CPU for _, t in shared_weights.model_tensors(skeleton))
            # Each distinct tensor once; a tied head is an alias, not a second copy.
            aliases = [e for e in region.descriptor.tensors if e.alias_of]
            assert [(e.name, e.alias_of) for e in aliases] == ([("lm_head", "embed")] if tied else [])
            assert (skeleton.lm_head.data_ptr() == skeleton.embed.data_ptr()) is tied
            got = _logits(skeleton, cfg)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            torch.testing.assert_close(_logits(host_model, cfg), expected, rtol=0, atol=0)
            # The host's model and the worker's really share memory: a write through one shows in the other.
            host_model.norm[0] += 1.0
            assert skeleton.norm[0] == host_model.norm[0]
        finally:
            mapped.close()
    finally:
        region.close()


def test_weights_that_do_not_fit_are_refused(tmp_path) -> None:
    hf = build_hf_model(tmp_path / "m", seed=1)
    cfg = load_model_config(str(hf.path))
    region = shared_weights.pack(load_model(str(hf.path), cfg, torch.float32, CPU), CPU, "x", "pagedkv-sw-test")
    try:
        with pytest.raises(ValueError, match="float16"):
            shared_weights.bind(model_skeleton(cfg, torch.float16), region.descriptor, CPU)
        other = build_hf_model(tmp_path / "o", seed=1, num_hidden_layers=3)
        skeleton = model_skeleton(load_model_config(str(other.path)), torch.float32)
        with pytest.raises(ValueError, match="tensors differ"):
            shared_weights.bind(skeleton, region.descriptor, CPU)
        assert skeleton.embed.device.type == "meta"  # nothing bound
    finally:
        region.close()


def _info(port: int) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)


def test_role_workers_map_the_hosts_weights_and_generate_exactly(hf_llama: HFModel, procs: list[Proc]) -> None:
    host, ready = start_cache_host(hf_llama.path)
    procs.append(host)
    assert ready["weights_bytes"] > 0 and ready["weights_source"] == f"model:{hf_llama.path.name}"
    p = start_worker(hf_llama.path, ready["port"], "--role", "prefill", "--cpu-affinity", "0", "--num-threads", "1")
    d = start_worker(hf_llama.path, ready["port"], "--role", "decode")
    procs += [p, d]
    p_ready, d_ready = p.wait_event("worker_ready"), d.wait_event("worker_ready")
    assert p_ready["shared_weights"] and d_ready["shared_weights"]
    assert p_ready["cpus"] == [0] and p_ready["threads"] == 1
    pi, di = _info(p_ready["port"]), _info(d_ready["port"])
    assert (pi.role, di.role) == (worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE)
    assert pi.shared_weights and di.shared_weights
    # Prompt on the prefill worker, decode on the decode worker: one cache, one copy of the weights.
    with grpc.insecure_channel(f"127.0.0.1:{p_ready['port']}") as cp, \
            grpc.insecure_channel(f"127.0.0.1:{d_ready['port']}") as cd:
        sched = Scheduler(grpc_step(worker_pb2_grpc.WorkerStub(cp)), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK)
        sched.add("s", PROMPT)
        sched.run(["s"])
        sched.step_fn = grpc_step(worker_pb2_grpc.WorkerStub(cd))
        sched.generate(["s"], 7)
    assert sched.seqs["s"].generated == hf_llama.greedy(PROMPT, 8)
    # A local-weights worker still works beside them (and says so).
    loc = start_worker(hf_llama.path, ready["port"], "--weights", "local")
    procs.append(loc)
    assert loc.wait_event("worker_ready")["shared_weights"] is False
    for w in (p, d, loc):
        assert w.stop() == 0
    assert host.stop(signal.SIGTERM) == 0


def test_a_worker_with_other_weights_refuses_to_start(hf_llama: HFModel, tmp_path, procs: list[Proc]) -> None:
    host, ready = start_cache_host(hf_llama.path)
    procs.append(host)
    other = build_hf_model(tmp_path / "other-model", seed=5)
    w = start_worker(other.path, ready["port"])
    procs.append(w)
    assert w.p.wait(60) == 2
    err = w.wait_event("config_error")["error"]
    assert "weights mismatch" in err and "other-model" in err
    bad = start_worker(hf_llama.path, ready["port"], "--cpu-affinity", "0,4096")
    procs.append(bad)
    assert bad.p.wait(60) == 2
    assert "CPU 4096 is not available" in bad.wait_event("config_error")["error"]
    assert host.stop() == 0
