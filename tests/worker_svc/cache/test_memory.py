"""The shared cache on the CPU backend: one segment, many processes, no leaks, no early unlink."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache import shm_backend
from pagedkv.worker_svc.cache.layout import CacheGeometry, GeometryMismatch, check_same

ROOT = pathlib.Path(__file__).resolve().parents[3]
GEOM = CacheGeometry(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_gpu_blocks=16, num_cpu_blocks=4
)


def _shm_exists(name: str) -> bool:
    return pathlib.Path("/dev/shm", name).exists()


def _attach_in_child(
    desc: cache_memory.CacheDescriptor, body: str, kill: bool = False, device: str = "cpu"
) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter that attached the cache as `cache` (then exits or SIGKILLs
    itself)."""
    code = (
        textwrap.dedent(f"""
        import os, signal, torch
        from pagedkv.worker_svc.cache import memory as cache_memory
        from pagedkv.worker_svc.cache.layout import CacheGeometry
        from pagedkv.worker_svc.cache.memory import CacheDescriptor, TensorDescriptor, TensorPair
        desc = {desc!r}
        cache = cache_memory.attach(desc, torch.device("{device}"))
    """)
        + textwrap.dedent(body)
        + ("\nos.kill(os.getpid(), signal.SIGKILL)\n" if kill else "\ncache.close()\n")
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture
def host() -> cache_memory.SharedCache:
    cache = cache_memory.create(GEOM, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-test")
    yield cache
    cache.close()


def test_create_gives_zeroed_tensors_of_the_geometry(host: cache_memory.SharedCache) -> None:
    assert tuple(host.gpu.shape) == (2, 2, 16, 4, 2, 8) and tuple(host.cpu.shape) == (2, 2, 4, 4, 2, 8)
    assert not host.gpu.any() and not host.cpu.any()
    assert host.descriptor.backend == "shm"
    assert _shm_exists(host.descriptor.gpu.shm_name) and _shm_exists(host.descriptor.cpu.shm_name)


def test_writes_are_visible_across_processes_both_ways(host: cache_memory.SharedCache) -> None:
    host.gpu[1, 0, 3] = 7.5
    res = _attach_in_child(
        host.descriptor,
        """
        assert float(cache.gpu[1, 0, 3].mean()) == 7.5
        cache.gpu[0, 1, 5] = -2.0
        cache.cpu[1, 1, 2] = 3.0
    """,
    )
    assert res.returncode == 0, res.stderr
    assert bool((host.gpu[0, 1, 5] == -2.0).all()) and bool((host.cpu[1, 1, 2] == 3.0).all())


@pytest.mark.parametrize("kill", [False, True], ids=["exit", "sigkill"])
def test_an_attached_process_dying_does_not_unlink_the_segments(
    host: cache_memory.SharedCache, kill: bool
) -> None:
    host.gpu[0, 0, 0] = 1.0
    res = _attach_in_child(host.descriptor, "cache.gpu[0, 0, 1] = 2.0", kill=kill)
    assert res.returncode == (-signal.SIGKILL if kill else 0), res.stderr
    import time

    time.sleep(0.3)  # the child's resource tracker (if it had registered the segment) acts on its exit
    assert _shm_exists(host.descriptor.gpu.shm_name) and _shm_exists(host.descriptor.cpu.shm_name)
    again = cache_memory.attach(host.descriptor, torch.device("cpu"))
    assert float(again.gpu[0, 0, 1].mean()) == 2.0
    again.close()


def test_owner_close_unlinks_and_is_idempotent() -> None:
    cache = cache_memory.create(GEOM, torch.float16, torch.device("cpu"), shm_prefix="pagedkv-test")
    names = [cache.descriptor.gpu.shm_name, cache.descriptor.cpu.shm_name]
    assert cache.gpu.dtype == torch.float16
    cache.close()
    cache.close()
    assert not any(_shm_exists(n) for n in names)


def test_attach_checks_size_and_device(host: cache_memory.SharedCache) -> None:
    with pytest.raises(ValueError, match="bytes"):
        shm_backend.attach(host.descriptor.gpu.shm_name, (2, 2, 999, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match="--device cpu"):
        cache_memory.attach(host.descriptor, torch.device("cuda"))


def test_zero_cpu_blocks_is_allowed() -> None:
    g = CacheGeometry(
        num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, num_gpu_blocks=2, num_cpu_blocks=0
    )
    cache = cache_memory.create(g, torch.float32, torch.device("cpu"), shm_prefix="pagedkv-test")
    try:
        att = cache_memory.attach(cache.descriptor, torch.device("cpu"))
        assert tuple(att.cpu.shape) == (1, 2, 0, 2, 1, 4)
        att.close()
    finally:
        cache.close()


def test_check_same_names_every_differing_value() -> None:
    other = CacheGeometry(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, num_gpu_blocks=16, num_cpu_blocks=5
    )
    with pytest.raises(
        GeometryMismatch, match=r"block_size: a has 4, b has 8; num_cpu_blocks: a has 4, b has 5"
    ):
        check_same(GEOM, other, "a", "b")


def test_cuda_backend_is_lazy_and_rounds_to_2mib() -> None:
    code = (
        "import sys, pagedkv.worker_svc.cache.memory, pagedkv.worker_svc.server;"
        "import pagedkv.worker_svc.cache.cuda_ipc_backend as c;"
        "assert 'cupy' not in sys.modules, 'cupy imported eagerly';"
        "assert c.round_up(1) == 2 << 20 and c.round_up((2 << 20) + 1) == 4 << 20 and c.round_up(4 << 20) == "
        "4 << 20"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (gpu_check.sh's ipc section runs it)")
def test_cuda_ipc_round_trip_across_processes() -> None:  # pragma: no cover - GPU only
    pytest.importorskip("cupy")
    cache = cache_memory.create(GEOM, torch.float16, torch.device("cuda"))
    try:
        cache.gpu[1, 1, 2] = 4.0
        torch.cuda.synchronize()
        res = _attach_in_child(
            cache.descriptor,
            """
            assert float(cache.gpu[1, 1, 2].float().mean()) == 4.0
            cache.gpu[0, 0, 7] = -1.0
            cache.cpu[0, 1, 1] = 2.0
            torch.cuda.synchronize()
        """,
            device="cuda",
        )
        assert res.returncode == 0, res.stderr
        assert bool((cache.gpu[0, 0, 7] == -1.0).all()) and bool((cache.cpu[0, 1, 1] == 2.0).all())
    finally:
        cache.close()
    assert not _shm_exists(cache.descriptor.cpu.shm_name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure mode")
def test_cudart_fallback_fails_cleanly_without_a_gpu() -> None:
    """Without CuPy the CUDA backend uses libcudart via ctypes; with no GPU it must raise, not crash."""
    from pagedkv.worker_svc.cache import cudart_fallback

    try:
        cp = cudart_fallback.load()
    except OSError:
        pytest.skip("no libcudart on this machine")
    with pytest.raises(RuntimeError, match="cudaMalloc failed"):
        cp.cuda.Memory(2 << 20)
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle failed"):
        cp.cuda.runtime.ipcOpenMemHandle(b"\0" * 64)


DRAFT_GEOM = CacheGeometry(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_gpu_blocks=16, num_cpu_blocks=4,
    draft_num_layers=1, draft_num_kv_heads=1, draft_head_dim=16,
)  # fmt: skip


def test_a_draft_models_cache_is_its_own_pair_of_segments_over_the_same_blocks() -> None:
    """Speculative decoding's draft: a second device cache and swap pool with the draft's layers
    and heads, as many blocks as the model's, served in the descriptor, attached by workers,
    written across processes and unlinked with the rest."""
    from pagedkv.worker_svc.cache.host import descriptor_from_proto, descriptor_to_proto

    cache = cache_memory.create(
        DRAFT_GEOM, torch.float32, torch.device("cpu"), "pagedkv-test", draft_model="d"
    )
    try:
        assert cache.draft_gpu is not None and cache.draft_cpu is not None
        assert tuple(cache.draft_gpu.shape) == (1, 2, 16, 4, 1, 16)
        assert tuple(cache.draft_cpu.shape) == (1, 2, 4, 4, 1, 16)
        assert (
            DRAFT_GEOM.block_bytes(torch.float32) == GEOM.block_bytes(torch.float32) + 1 * 2 * 4 * 1 * 16 * 4
        )
        desc = descriptor_from_proto(descriptor_to_proto(cache.descriptor))
        assert desc == cache.descriptor and desc.draft_model == "d"
        names = [n for n in desc.segments if n]
        assert len(names) == 4 and all(_shm_exists(n) for n in names)
        cache.draft_gpu[0, 1, 7] = 4.0
        res = _attach_in_child(
            desc,
            """
            assert float(cache.draft_gpu[0, 1, 7].mean()) == 4.0
            cache.draft_cpu[0, 0, 3] = -1.0
        """,
        )
        assert res.returncode == 0, res.stderr
        assert bool((cache.draft_cpu[0, 0, 3] == -1.0).all())
    finally:
        cache.close()
    assert not any(_shm_exists(n) for n in names)
