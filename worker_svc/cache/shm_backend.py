"""POSIX shared memory: the CPU stand-in for CUDA IPC, and the home of the host swap pool.

The creator (the cache host) owns the segment: it unlinks it on shutdown. Attachers map it by name
and must NOT let Python's resource tracker unlink it when they exit: on Python < 3.13 attaching
registers the segment with the tracker, which unlinks it when the attaching process dies (even by
SIGKILL, since the tracker is a separate process). So every attach is followed by
``resource_tracker.unregister``; that is what lets a worker crash without losing the cache.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import torch

from pagedkv.worker_svc.cache.layout import dtype_name, numel, storage_dtype_from_name


@dataclass(slots=True)
class ShmTensor:
    """A tensor living in a named shared-memory segment (owned or attached)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: bool
    _shm: shared_memory.SharedMemory | None = field(repr=False)
    tensor: torch.Tensor | None = field(repr=False)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the name. Idempotent."""
        shm, self._shm = self._shm, None
        self.tensor = None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:
            # Some view of the buffer is still alive (e.g. a tensor held elsewhere); the mapping
            # goes away with the process. Unlinking the name is what matters for leaks.
            pass
        if self.owner:
            _CREATED_HERE.discard(self.name)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


# Segments this process created: attaching to one of them again (tests run host and worker in one
# process) must not unregister it, or the owner's unlink would find the tracker entry gone.
_CREATED_HERE: set[str] = set()


def _tensor_on(shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(shm.buf, dtype=dtype, count=n).view(shape)


def new_segment_name(prefix: str, role: str) -> str:
    """A fresh, unguessable segment name (``/dev/shm/<prefix>-<pid>-<random>-<role>``)."""
    import os

    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}-{role}"


def create(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> ShmTensor:
    """Create a zero-filled segment holding ``shape`` x ``dtype`` (at least one byte)."""
    nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    _CREATED_HERE.add(name)
    return ShmTensor(
        name=name, shape=shape, dtype=dtype, owner=True, _shm=shm, tensor=_tensor_on(shm, shape, dtype)
    )


def attach(name: str, shape: tuple[int, ...], dtype: torch.dtype | str) -> ShmTensor:
    """Map an existing segment without taking ownership (the creator unlinks it)."""
    dt = storage_dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    shm = shared_memory.SharedMemory(name=name, create=False)
    if sys.version_info < (3, 13) and name not in _CREATED_HERE:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    need = numel(shape) * torch.empty((), dtype=dt).element_size()
    if shm.size < need:
        shm.close()
        raise ValueError(
            f"shared memory {name!r} has {shm.size} bytes, the {dtype_name(dt)} {shape} cache needs {need}"
        )
    return ShmTensor(
        name=name,
        shape=tuple(shape),
        dtype=dt,
        owner=False,
        _shm=shm,
        tensor=_tensor_on(shm, tuple(shape), dt),
    )
