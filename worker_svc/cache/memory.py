"""The shared KV cache as memory: created once by the cache host, attached by every worker.

Two backends behind one interface:
- "shm" (CPU): the device cache and the swap pool are two POSIX shared-memory segments.
- "cuda_ipc" (GPU): the device cache is one CUDA allocation exported by IPC handle; the swap pool
  is POSIX shared memory that each process page-locks.

``SharedCache`` is what both sides hold: the two tensors plus ``close()``. ``TensorDescriptor`` is
what travels (as ``CacheInfo`` over gRPC) from the host to the workers.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedkv.worker_svc.cache import shm_backend
from pagedkv.worker_svc.cache.layout import CacheGeometry, dtype_name, storage_dtype_from_name

BACKEND_SHM = "shm"
BACKEND_CUDA_IPC = "cuda_ipc"


@dataclass(slots=True, frozen=True)
class TensorDescriptor:
    """Everything an attaching process needs to map one exported tensor."""

    backend: str
    shape: tuple[int, ...]
    dtype: str
    shm_name: str = ""
    ipc_handle: bytes = b""
    offset: int = 0
    size: int = 0
    device_index: int = 0


@dataclass(slots=True, frozen=True)
class TensorPair:
    """One cache's two exported tensors: the device cache and its host swap pool."""

    gpu: TensorDescriptor
    cpu: TensorDescriptor


@dataclass(slots=True, frozen=True)
class CacheDescriptor:
    backend: str
    gpu: TensorDescriptor
    cpu: TensorDescriptor
    geometry: CacheGeometry
    dtype: str
    instance_id: str
    host_pid: int
    # The draft model's cache (speculative decoding, geometry.has_draft), and its model's name.
    draft: TensorPair | None = None
    draft_model: str = ""

    @property
    def segments(self) -> list[str]:
        """The shared-memory segments' names ("" for a CUDA allocation)."""
        pairs = [TensorPair(self.gpu, self.cpu)] + ([self.draft] if self.draft is not None else [])
        return [t.shm_name for pair in pairs for t in (pair.gpu, pair.cpu)]


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(slots=True)
class SharedCache:
    """The device cache ``[L, 2, num_gpu_blocks, ...]`` and the host swap pool
    ``[L, 2, num_cpu_blocks, ...]``; with a draft model, its two of the same kind (else None)."""

    descriptor: CacheDescriptor
    gpu: torch.Tensor
    cpu: torch.Tensor
    _resources: list[_Closable] = field(default_factory=list, repr=False)
    draft_gpu: torch.Tensor | None = None
    draft_cpu: torch.Tensor | None = None

    def close(self) -> None:
        """Release views, then handles/mappings in reverse order of acquisition. Idempotent."""
        self.gpu = torch.empty(0)
        self.cpu = torch.empty(0)
        self.draft_gpu = self.draft_cpu = None
        while self._resources:
            self._resources.pop().close()


def resolve_backend(device: torch.device) -> str:
    return BACKEND_CUDA_IPC if device.type == "cuda" else BACKEND_SHM


def _export_pair(
    gpu_shape: tuple[int, ...],
    cpu_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    shm_prefix: str,
    kind: str,
    resources: list[Any],
) -> tuple[torch.Tensor, torch.Tensor, TensorPair]:
    """Allocate one cache (device tensor, host swap pool), zero-filled; what it holds goes to
    ``resources`` as it is acquired."""
    cpu_tensor, cpu_desc = _shm_tensor(shm_prefix, f"{kind}swap", cpu_shape, dtype, resources)
    if device.type == "cuda":
        from pagedkv.worker_svc.cache import cuda_ipc_backend

        exp = cuda_ipc_backend.export(gpu_shape, dtype, device)
        resources.append(exp)
        pin = cuda_ipc_backend.pin_host_tensor(cpu_tensor, device)
        if pin is not None:
            resources.append(pin)
        gpu_tensor = exp.tensor
        gpu_desc = TensorDescriptor(
            backend=BACKEND_CUDA_IPC,
            shape=gpu_shape,
            dtype=dtype_name(dtype),
            ipc_handle=exp.handle,
            offset=exp.offset,
            size=exp.size,
            device_index=exp.device_index,
        )
    else:
        gpu_tensor, gpu_desc = _shm_tensor(shm_prefix, f"{kind}kv", gpu_shape, dtype, resources)
    assert gpu_tensor is not None
    return gpu_tensor, cpu_tensor, TensorPair(gpu_desc, cpu_desc)


def _shm_tensor(
    shm_prefix: str, role: str, shape: tuple[int, ...], dtype: torch.dtype, resources: list[Any]
) -> tuple[torch.Tensor, TensorDescriptor]:
    """A zero-filled tensor in a new shared-memory segment (kept in ``resources``) and its descriptor."""
    shm = shm_backend.create(shm_backend.new_segment_name(shm_prefix, role), shape, dtype)
    resources.append(shm)
    assert shm.tensor is not None
    desc = TensorDescriptor(
        backend=BACKEND_SHM, shape=shape, dtype=dtype_name(dtype), shm_name=shm.name, size=shm.nbytes
    )
    return shm.tensor, desc


def create(
    geometry: CacheGeometry,
    dtype: torch.dtype,
    device: torch.device,
    shm_prefix: str = "pagedkv",
    draft_model: str = "",
) -> SharedCache:
    """Allocate the cache once (the cache host's job). Zero-filled. ``dtype`` is the model's; the
    tensors hold it, or the 8-bit KV rows ``geometry.kv_cache_dtype`` asks for (kernels/quant.py).
    With a draft model (``geometry.has_draft``; ``draft_model`` its name) its cache too."""
    model_dtype, dtype = dtype, geometry.storage_dtype(dtype)
    instance_id = secrets.token_hex(8)
    resources: list[Any] = []
    draft_gpu = draft_cpu = None
    draft_pair = None
    try:
        gpu, cpu, pair = _export_pair(
            geometry.gpu_shape, geometry.cpu_shape, dtype, device, shm_prefix, "", resources
        )
        if geometry.has_draft:
            draft_gpu, draft_cpu, draft_pair = _export_pair(
                geometry.draft_shape(geometry.num_gpu_blocks),
                geometry.draft_shape(geometry.num_cpu_blocks),
                dtype,
                device,
                shm_prefix,
                "draft",
                resources,
            )
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    desc = CacheDescriptor(
        backend=pair.gpu.backend,
        gpu=pair.gpu,
        cpu=pair.cpu,
        geometry=geometry,
        dtype=dtype_name(model_dtype),
        instance_id=instance_id,
        host_pid=os.getpid(),
        draft=draft_pair,
        draft_model=draft_model if geometry.has_draft else "",
    )
    return SharedCache(
        descriptor=desc, gpu=gpu, cpu=cpu, _resources=resources, draft_gpu=draft_gpu, draft_cpu=draft_cpu
    )


def borrow(cache: SharedCache, desc: CacheDescriptor, device: torch.device) -> SharedCache:
    """The exporter's own cache, handed to a worker in the same process (``LocalStack``).

    Why not ``attach``: CUDA forbids a process to open its own IPC handle, and on CPU a second mapping
    of the same segment buys nothing. The result shares the exporter's tensors and owns nothing: its
    ``close()`` only drops its views; the exporter keeps freeing the memory. ``desc`` is what the cache
    host served: it must name this very cache (same instance), or the worker would compute on memory
    other than the one the block manager's ids refer to."""
    if desc.instance_id != cache.descriptor.instance_id or desc.host_pid != os.getpid():
        raise ValueError(
            f"the in-process cache (instance {cache.descriptor.instance_id}) is not the one the cache host "
            f"serves (instance {desc.instance_id}, pid {desc.host_pid})"
        )
    if cache.gpu.device.type != device.type or (device.index is not None and cache.gpu.device != device):
        raise ValueError(f"the in-process cache lives on {cache.gpu.device} but this worker runs on {device}")
    return SharedCache(
        descriptor=cache.descriptor,
        gpu=cache.gpu,
        cpu=cache.cpu,
        draft_gpu=cache.draft_gpu,
        draft_cpu=cache.draft_cpu,
    )


def attach(desc: CacheDescriptor, device: torch.device) -> SharedCache:
    """Map the cache host's memory into this process without copying (a worker's job)."""
    dtype = storage_dtype_from_name(desc.gpu.dtype)  # the tensors' own dtype (8-bit KV: not the model's)
    if desc.backend != resolve_backend(device):
        raise ValueError(
            f"cache host exports a {desc.backend!r} cache but this worker runs on {device}: "
            f"use --device {'cuda' if desc.backend == BACKEND_CUDA_IPC else 'cpu'}"
        )
    if desc.host_pid == os.getpid() and desc.backend == BACKEND_CUDA_IPC:
        raise ValueError("a process cannot open its own CUDA IPC handle; use the exporter's tensor")
    resources: list[Any] = []
    try:
        gpu, cpu = _attach_pair(desc.backend, desc.gpu, desc.cpu, dtype, device, resources)
        draft = (
            _attach_pair(desc.backend, desc.draft.gpu, desc.draft.cpu, dtype, device, resources)
            if desc.draft is not None
            else (None, None)
        )
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    return SharedCache(
        descriptor=desc, gpu=gpu, cpu=cpu, _resources=resources, draft_gpu=draft[0], draft_cpu=draft[1]
    )


def _attach_pair(
    backend: str,
    gpu: TensorDescriptor,
    cpu: TensorDescriptor,
    dtype: torch.dtype,
    device: torch.device,
    resources: list[Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map one exported cache (device tensor, host swap pool); what it holds goes to ``resources``."""
    cpu_shm = shm_backend.attach(cpu.shm_name, cpu.shape, dtype)
    resources.append(cpu_shm)
    if backend == BACKEND_CUDA_IPC:
        from pagedkv.worker_svc.cache import cuda_ipc_backend

        imp = cuda_ipc_backend.attach(gpu.ipc_handle, gpu.offset, gpu.size, gpu.shape, dtype, device)
        resources.append(imp)
        pin = cuda_ipc_backend.pin_host_tensor(cpu_shm.tensor, device)  # type: ignore[arg-type]
        if pin is not None:
            resources.append(pin)
        gpu_tensor = imp.tensor
    else:
        gpu_shm = shm_backend.attach(gpu.shm_name, gpu.shape, dtype)
        resources.append(gpu_shm)
        gpu_tensor = gpu_shm.tensor
    assert gpu_tensor is not None and cpu_shm.tensor is not None
    return gpu_tensor, cpu_shm.tensor
