"""The in-process stack hands its workers the cache host's own cache object (frontend/launch/local_stack.py).

Why it matters on a GPU: the cache is exported over CUDA IPC, and CUDA forbids a process to open its
own IPC handle, so a worker in the exporter's process that attached the descriptor like a remote
worker would fail on every GPU host. On CPU the same rule is rehearsed by making ``attach`` refuse
in-process use: the stack must never call it, compute on the very tensors it created, and give
transformers' tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.frontend.engine import GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.memory import CacheDescriptor
from tests.frontend.engine.test_engine import prompts
from tests.worker_svc.conftest import HFModel, build_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("local-stack-llama"), seed=11)


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


@pytest.fixture
def no_self_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's rule on CPU: mapping a descriptor this process exported is refused."""
    real = cache_memory.attach

    def attach(desc: CacheDescriptor, device: torch.device) -> cache_memory.SharedCache:
        if desc.host_pid == os.getpid():
            raise ValueError("a process cannot open its own CUDA IPC handle (rehearsed on CPU)")
        return real(desc, device)

    monkeypatch.setattr(cache_memory, "attach", attach)


def test_in_process_workers_compute_on_the_exporters_cache(hf: HFModel, no_self_attach: None) -> None:
    ps = prompts(5, 3)
    with LocalStack(
        StackConfig(
            model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64, num_workers=2
        )
    ) as st:
        for w in st.workers:
            assert w.cache.gpu.data_ptr() == st.cache.gpu.data_ptr(), "the worker maps its own copy"
            assert w.cache.cpu.data_ptr() == st.cache.cpu.data_ptr()
            assert w.cache.descriptor.instance_id == st.cache.descriptor.instance_id
        outs = st.engine().generate([GenerationRequest(f"r{i}", p, max_tokens=6) for i, p in enumerate(ps)])
        written = bool(st.cache.gpu.abs().sum() > 0)
        # A worker going away drops its views only: the exporter's memory stays, for the others.
        st.workers[0].close()
        assert st.cache.gpu.numel() > 0 and bool(st.cache.gpu.abs().sum() > 0)
    assert written, "the steps wrote KV into the stack's own cache"
    for p, out in zip(ps, outs, strict=True):
        assert out.completions[0].token_ids == hf.greedy(p, 6), out.request_id


def test_borrow_refuses_a_descriptor_of_another_cache(hf: HFModel) -> None:
    with LocalStack(
        StackConfig(
            model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=16, num_workers=1
        )
    ) as st:
        desc = st.cache.descriptor
        other = CacheDescriptor(
            desc.backend, desc.gpu, desc.cpu, desc.geometry, desc.dtype, "0" * 16, desc.host_pid
        )
        with pytest.raises(ValueError, match="not the one the cache host serves"):
            cache_memory.borrow(st.cache, other, torch.device("cpu"))
        borrowed = cache_memory.borrow(st.cache, desc, torch.device("cpu"))
        borrowed.close()
        assert borrowed.gpu.numel() == 0 and st.cache.gpu.numel() > 0, (
            "closing a borrowed cache frees nothing"
        )


def test_steps_over_the_step_channel_give_the_grpc_tokens(hf: HFModel) -> None:
    """The same requests over gRPC and over the one-host step channel (shared memory): transformers'
    greedy tokens both times, and the channel really carried the second run's steps."""
    ps = prompts(4, 5)
    cfg = StackConfig(
        model=str(hf.path), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64, num_workers=2
    )
    with LocalStack(cfg) as st:
        for transport in ("grpc", "shm"):
            eng = st.engine(step_transport=transport)
            assert [w.transport for w in eng.workers] == [transport] * 2
            outs = eng.generate(
                [GenerationRequest(f"{transport}{i}", p, max_tokens=7) for i, p in enumerate(ps)]
            )
            for p, out in zip(ps, outs, strict=True):
                assert out.completions[0].token_ids == hf.greedy(p, 7), out.request_id
            used = [w.step_channel.connections for w in st.workers if w.step_channel is not None]
            assert (sum(used) > 0) == (transport == "shm"), used
            eng.close()
            for w in eng.workers:
                w.close()
