"""A worker killed (SIGKILL) or paused (SIGSTOP, then SIGCONT) during generation, over either step
transport (gRPC, or the one-host step channel): the engine moves to the other worker, the cache host
keeps the KV, the outputs still equal transformers' greedy generate() and nothing stays allocated.
The kill over the step channel runs with a draft model (speculative decoding): its proposals and
their KV are redone by the other worker, which shares the draft's cache too."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.engine.speculate import SpeculativeConfig
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.processes import Stack
from pagedkv.ports import free_port_block
from tests.worker_svc.conftest import HFModel, build_hf_model, noisy_copy


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("fault-llama"), seed=5)


@pytest.mark.parametrize(("transport", "draft"), [("grpc", False), ("shm", True)], ids=["grpc", "shm-draft"])
def test_sigkill_one_worker_mid_generation_keeps_outputs_exact(
    hf: HFModel, tmp_path, monkeypatch, transport, draft
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    base = free_port_block(4)
    opts = StackConfig(
        block_manager_port=base,
        cache_host_port=base + 1,
        worker_port=base + 2,
        num_workers=2,
        num_gpu_blocks=64,
        block_size=4,
        model=str(hf.path),
        device="cpu",
        dtype="float32",
        log_dir=str(tmp_path / "logs"),
        shm_prefix=f"pagedkv-fault-{os.getpid()}",
        speculative_model=str(noisy_copy(hf, tmp_path / "draft")) if draft else None,
    )
    spec = (
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3, max_num_seqs=4) if draft else None
    )
    stack = Stack(opts, out=io.StringIO())
    stack.start()
    try:
        prompts = [[7, 3, 9, 1, 4, 4, 8, 2, 6][: 5 + i] for i in range(4)]
        with BlockManagerClient(stack.services[0].address) as bm:
            workers = [
                WorkerClient(s.address, default_timeout_s=30, step_transport=transport)
                for s in stack.services[2:]
            ]
            engine = Engine(bm, workers, EngineConfig(timeout_s=10, speculative=spec))
            assert [w.transport for w in workers] == [transport] * 2
            channels = [Path(w.get_info().step_channel) for w in workers]
            assert all(c.exists() for c in channels)
            outs = [
                engine.add_request(GenerationRequest(f"r{i}", p, max_tokens=12))
                for i, p in enumerate(prompts)
            ]
            for _ in range(5):  # prefill and a few decode steps on worker-0
                engine.step()
            assert engine.stats.worker_retries == 0
            victim = stack.services[2].process
            assert victim is not None
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            for _ in engine.stream():
                pass
            engine.close()
            # Nothing of the interrupted work stays allocated, and a new request succeeds on the survivor.
            stats = bm.get_stats()
            assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
            after = Engine(bm, workers, EngineConfig(timeout_s=10))
            again = after.add_request(GenerationRequest("after", prompts[0], max_tokens=6))
            for _ in after.stream():
                pass
            after.close()
            assert again.completions[0].token_ids == hf.greedy(prompts[0], 6)
            stats = bm.get_stats()
            assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
            for w in workers:
                w.close()
        assert engine.stats.worker_retries >= 1, "the engine should have moved to worker-1"
        assert (engine.stats.spec_passes > 0) == draft
        for p, out in zip(prompts, outs, strict=True):
            assert out.completions[0].token_ids == hf.greedy(p, 12), out.request_id
    finally:
        leaked = stack.stop()
    assert not leaked
    # The worker that exited removed its step channel; the killed one's directory (its segments died
    # with it) was swept when the stack stopped (as at the next worker start on this host).
    assert not channels[1].parent.exists()
    assert not channels[0].parent.exists()


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_sigstop_one_worker_past_keepalive_fences_its_step_then_sigcont(
    hf: HFModel, tmp_path, monkeypatch, transport
) -> None:  # type: ignore[no-untyped-def]
    """Paused, not dead: its step is given up on (keepalive: UNAVAILABLE), fenced, run on the other
    worker; its sequences' blocks wait until the resumed worker answers Fence; the same process is
    taken back."""
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    base = free_port_block(4)
    opts = StackConfig(
        block_manager_port=base, cache_host_port=base + 1, worker_port=base + 2, num_workers=2,
        num_gpu_blocks=64, block_size=4, model=str(hf.path), device="cpu", dtype="float32",
        log_dir=str(tmp_path / "logs"), shm_prefix=f"pagedkv-pause-{os.getpid()}",
    )  # fmt: skip
    stack = Stack(opts, out=io.StringIO())
    stack.start()
    victim = stack.services[2].process
    assert victim is not None
    try:
        prompts = [[7, 3, 9, 1, 4, 4, 8, 2, 6][: 5 + i] for i in range(4)]
        with BlockManagerClient(stack.services[0].address) as bm:
            workers = [
                WorkerClient(s.address, default_timeout_s=30, step_transport=transport)
                for s in stack.services[2:]
            ]
            engine = Engine(bm, workers, EngineConfig(timeout_s=10))
            assert [w.transport for w in workers] == [transport] * 2
            outs = [
                engine.add_request(GenerationRequest(f"r{i}", p, max_tokens=16))
                for i, p in enumerate(prompts)
            ]
            for _ in range(4):
                engine.step()
            assert engine.pool.slots[0].steps > 0
            victim.send_signal(signal.SIGSTOP)
            resume = threading.Timer(12.0, victim.send_signal, (signal.SIGCONT,))
            resume.start()
            t0 = time.monotonic()
            held_while_paused = False
            while not all(o.finished for o in outs):
                engine.step()
                held_while_paused = held_while_paused or bool(engine.pool.fences.held())
            assert time.monotonic() - t0 < 12.0, "the others went on while the worker was paused"
            assert held_while_paused and engine.pool.fences.fenced >= 1
            resume.join()
            deadline = time.monotonic() + 20
            while (engine.pool.fences.held() or engine.pool.slots[0].benched) and time.monotonic() < deadline:
                engine.step()
                time.sleep(0.1)
            assert not engine.pool.fences.held() and not engine.pool.slots[0].benched
            engine.flush()
            engine.close()
            stats = bm.get_stats()
            assert (stats.num_sequences, stats.num_used_blocks) == (0, 0)
            for w in workers:
                w.close()
        for p, out in zip(prompts, outs, strict=True):
            assert out.completions[0].token_ids == hf.greedy(p, 16), out.request_id
    finally:
        victim.send_signal(signal.SIGCONT)
        leaked = stack.stop()
    assert not leaked
