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
class CacheDescriptor:
    backend: str
    gpu: TensorDescriptor
    cpu: TensorDescriptor
    geometry: CacheGeometry
    dtype: str
    instance_id: str
    host_pid: int


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(slots=True)
class SharedCache:
    """The device cache ``[L, 2, num_gpu_blocks, ...]`` and the host swap pool
    ``[L, 2, num_cpu_blocks, ...]``."""

    descriptor: CacheDescriptor
    gpu: torch.Tensor
    cpu: torch.Tensor
    _resources: list[_Closable] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Release views, then handles/mappings in reverse order of acquisition. Idempotent."""
        self.gpu = torch.empty(0)
        self.cpu = torch.empty(0)
        while self._resources:
            self._resources.pop().close()


def resolve_backend(device: torch.device) -> str:
    return BACKEND_CUDA_IPC if device.type == "cuda" else BACKEND_SHM


def create(
    geometry: CacheGeometry, dtype: torch.dtype, device: torch.device, shm_prefix: str = "pagedkv"
) -> SharedCache:
    """Allocate the cache once (the cache host's job). Zero-filled. ``dtype`` is the model's; the
    tensors hold it, or the 8-bit KV rows ``geometry.kv_cache_dtype`` asks for (kernels/quant.py)."""
    model_dtype, dtype = dtype, geometry.storage_dtype(dtype)
    instance_id = secrets.token_hex(8)
    resources: list[Any] = []
    try:
        cpu_shm = shm_backend.create(
            shm_backend.new_segment_name(shm_prefix, "swap"), geometry.cpu_shape, dtype
        )
        resources.append(cpu_shm)
        cpu_desc = TensorDescriptor(
            backend=BACKEND_SHM,
            shape=geometry.cpu_shape,
            dtype=dtype_name(dtype),
            shm_name=cpu_shm.name,
            size=cpu_shm.nbytes,
        )
        if device.type == "cuda":
            from pagedkv.worker_svc.cache import cuda_ipc_backend

            exp = cuda_ipc_backend.export(geometry.gpu_shape, dtype, device)
            resources.append(exp)
            pin = cuda_ipc_backend.pin_host_tensor(cpu_shm.tensor, device)  # type: ignore[arg-type]
            if pin is not None:
                resources.append(pin)
            gpu_tensor = exp.tensor
            gpu_desc = TensorDescriptor(
                backend=BACKEND_CUDA_IPC,
                shape=geometry.gpu_shape,
                dtype=dtype_name(dtype),
                ipc_handle=exp.handle,
                offset=exp.offset,
                size=exp.size,
                device_index=exp.device_index,
            )
        else:
            gpu_shm = shm_backend.create(
                shm_backend.new_segment_name(shm_prefix, "kv"), geometry.gpu_shape, dtype
            )
            resources.append(gpu_shm)
            gpu_tensor = gpu_shm.tensor
            gpu_desc = TensorDescriptor(
                backend=BACKEND_SHM,
                shape=geometry.gpu_shape,
                dtype=dtype_name(dtype),
                shm_name=gpu_shm.name,
                size=gpu_shm.nbytes,
            )
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    desc = CacheDescriptor(
        backend=gpu_desc.backend,
        gpu=gpu_desc,
        cpu=cpu_desc,
        geometry=geometry,
        dtype=dtype_name(model_dtype),
        instance_id=instance_id,
        host_pid=os.getpid(),
    )
    assert gpu_tensor is not None and cpu_shm.tensor is not None
    return SharedCache(descriptor=desc, gpu=gpu_tensor, cpu=cpu_shm.tensor, _resources=resources)


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
    return SharedCache(descriptor=cache.descriptor, gpu=cache.gpu, cpu=cache.cpu)


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
        cpu_shm = shm_backend.attach(desc.cpu.shm_name, desc.cpu.shape, dtype)
        resources.append(cpu_shm)
        if desc.backend == BACKEND_CUDA_IPC:
            from pagedkv.worker_svc.cache import cuda_ipc_backend

            imp = cuda_ipc_backend.attach(
                desc.gpu.ipc_handle, desc.gpu.offset, desc.gpu.size, desc.gpu.shape, dtype, device
            )
            resources.append(imp)
            pin = cuda_ipc_backend.pin_host_tensor(cpu_shm.tensor, device)  # type: ignore[arg-type]
            if pin is not None:
                resources.append(pin)
            gpu_tensor = imp.tensor
        else:
            gpu_shm = shm_backend.attach(desc.gpu.shm_name, desc.gpu.shape, dtype)
            resources.append(gpu_shm)
            gpu_tensor = gpu_shm.tensor
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    assert gpu_tensor is not None and cpu_shm.tensor is not None
    return SharedCache(descriptor=desc, gpu=gpu_tensor, cpu=cpu_shm.tensor, _resources=resources)
