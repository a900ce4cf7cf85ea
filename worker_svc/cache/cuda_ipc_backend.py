"""CUDA IPC through CuPy: one device allocation shared by every process on the GPU.

CuPy is imported lazily, only here, and only when the CUDA backend is chosen: the rest of the
service runs (and is tested) on machines without a GPU or without CuPy.

Rules this module follows (docs/worker.md, "Backends"):
- The exporter allocates with ``cupy.cuda.Memory`` (a plain ``cudaMalloc``), not from CuPy's memory
  pool: an IPC handle names a whole allocation, so the tensor must start at the allocation's base
  (we still send the offset, 0, so importers never guess). The size is rounded up to 2 MiB.
- The exporter must outlive every importer; importers ``cudaIpcCloseMemHandle`` on shutdown.
- A process cannot open its own handle, so the cache host never attaches to itself.
- Tensors are wrapped without copying: CuPy array -> ``__cuda_array_interface__`` -> torch. The
  CuPy array is uint8 (CuPy has no bfloat16); torch reinterprets the bytes with ``.view(dtype)``.
- The host swap pool is POSIX shared memory (pinned host memory cannot be exported); each process
  page-locks its own mapping with ``cudaHostRegister`` so swaps run at DMA speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.arith import ceil_div
from pagedkv.worker_svc.cache.layout import numel

ALIGNMENT = 2 << 20  # 2 MiB
# cudaHostRegisterPortable: the page-locking is visible to every CUDA context of the process.
_HOST_REGISTER_PORTABLE = 1


def _cupy() -> Any:
    """CuPy, or the ctypes stand-in below when CuPy is not installed (e.g. a bare GPU image)."""
    try:
        import cupy  # noqa: PLC0415 - lazy on purpose
    except ImportError as e:  # pragma: no cover - depends on the machine
        from pagedkv.worker_svc.cache import cudart_fallback

        try:
            return cudart_fallback.load()
        except OSError as e2:
            raise RuntimeError(
                "the CUDA backend needs CuPy: pip install 'pagedkv[gpu-cuda12]' or 'pagedkv[gpu-cuda13]' "
                "(CUDA 12 / 13)"
                f" (and no libcudart for the fallback: {e2})"
            ) from e
    return cupy


def round_up(n: int, align: int = ALIGNMENT) -> int:
    return max(align, ceil_div(n, align) * align)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _wrap(
    cupy: Any, memptr: Any, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, dev: int
) -> torch.Tensor:
    """A torch view of ``nbytes`` device bytes at ``memptr`` with the given shape/dtype, no copy."""
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=memptr)
    flat = torch.as_tensor(raw, device=f"cuda:{dev}")
    return flat.view(dtype).view(shape)


@dataclass(slots=True)
class CudaExport:
    """The cache host's device allocation and its IPC handle."""

    handle: bytes
    size: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_index: int
    tensor: torch.Tensor | None = field(repr=False)
    _memory: Any = field(repr=False)

    def close(self) -> None:
        """Free the allocation. Importers must have closed their handles first (or be gone)."""
        self.tensor = None
        mem, self._memory = self._memory, None
        if mem is not None:
            torch.cuda.synchronize(self.device_index)
            del mem  # cupy.cuda.Memory frees on deallocation


def export(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> CudaExport:
    """Allocate a zeroed device buffer for ``shape`` x ``dtype`` and get its IPC handle."""
    cupy = _cupy()
    dev = device_index(device)
    nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
    size = round_up(nbytes)
    with cupy.cuda.Device(dev):
        mem = cupy.cuda.Memory(size)  # direct cudaMalloc: the handle's base is the tensor's base
        cupy.cuda.runtime.memset(mem.ptr, 0, size)
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
        tensor = _wrap(cupy, cupy.cuda.MemoryPointer(mem, 0), nbytes, shape, dtype, dev)
        cupy.cuda.runtime.deviceSynchronize()
    return CudaExport(
        handle=handle,
        size=size,
        offset=0,
        shape=shape,
        dtype=dtype,
        device_index=dev,
        tensor=tensor,
        _memory=mem,
    )


@dataclass(slots=True)
class CudaImport:
    """A worker's mapping of the cache host's allocation."""

    ptr: int
    device_index: int
    tensor: torch.Tensor | None = field(repr=False)
    _keepalive: Any = field(repr=False)

    def close(self) -> None:
        """Drop our views and close the IPC mapping. Idempotent."""
        self.tensor = None
        self._keepalive = None
        ptr, self.ptr = self.ptr, 0
        if ptr:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_index):
                torch.cuda.synchronize(self.device_index)
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def attach(
    handle: bytes, offset: int, size: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> CudaImport:
    """Open another process's IPC handle and view it as a torch tensor (no copy)."""
    cupy = _cupy()
    dev = device_index(device)
    nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
    if offset + nbytes > size:
        raise ValueError(f"IPC allocation of {size} bytes cannot hold {nbytes} bytes at offset {offset}")
    with cupy.cuda.Device(dev):
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        try:
            mem = cupy.cuda.UnownedMemory(ptr, size, None, dev)
            tensor = _wrap(cupy, cupy.cuda.MemoryPointer(mem, offset), nbytes, shape, dtype, dev)
        except Exception:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            raise
    return CudaImport(ptr=ptr, device_index=dev, tensor=tensor, _keepalive=mem)


@dataclass(slots=True)
class HostRegistration:
    """Page-locking of a host buffer (the shm swap pool) for fast device<->host copies."""

    ptr: int
    device_index: int

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.hostUnregister(ptr)


def pin_host_tensor(t: torch.Tensor, device: torch.device) -> HostRegistration | None:
    """``cudaHostRegister`` a CPU tensor's memory in this process; None when empty."""
    if t.numel() == 0:
        return None
    cupy = _cupy()
    dev = device_index(device)
    nbytes = t.numel() * t.element_size()
    with cupy.cuda.Device(dev):
        cupy.cuda.runtime.hostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE)
    return HostRegistration(ptr=t.data_ptr(), device_index=dev)
