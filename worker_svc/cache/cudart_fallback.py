"""A CuPy-shaped stand-in over libcudart (ctypes), used only when CuPy is not installed.

Why: GPU images often ship torch and Triton but not CuPy, and the CUDA IPC calls the cache needs
are five runtime functions. This module mimics exactly the slice of CuPy's API that
``cuda_ipc_backend`` uses (``cuda.Memory``, ``cuda.MemoryPointer``, ``cuda.UnownedMemory``,
``cuda.Device``, ``cuda.runtime.*`` and ``ndarray`` as a ``__cuda_array_interface__`` holder), so that
module has one code path. CuPy stays the documented, preferred dependency (``pagedkv[gpu]``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import types
from typing import Any

_IPC_HANDLE_BYTES = 64


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def candidates(maps: str, torch_cuda: str | None) -> list[str]:
    """The libcudart names/paths to try, best first.

    Why this order: two CUDA runtimes in one process each keep their own context state, and an IPC
    handle or a page-locking made through one is not the other's. So first the runtime torch itself
    already loaded (read from ``maps``, the text of /proc/self/maps), then the soname of torch's CUDA
    major (``torch_cuda``: ``torch.version.cuda``), then the newer major before the older one."""
    loaded: list[str] = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split(maxsplit=5)) == 6 else ""
        if os.path.basename(path).startswith("libcudart.so") and path not in loaded:
            loaded.append(path)
    names = ["libcudart.so.13", "libcudart.so.12"]
    if torch_cuda:
        mine = f"libcudart.so.{torch_cuda.split('.')[0]}"
        names = [mine] + [n for n in names if n != mine]
    return loaded + names + ["libcudart.so"]


def _find_libcudart() -> ctypes.CDLL:
    import torch

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for name in candidates(maps, torch.version.cuda):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    roots = [os.path.dirname(torch.__file__), os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")]
    for root in roots:
        for path in sorted(
            glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True), reverse=True
        ):
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    raise OSError(
        "libcudart not found (tried the runtime torch loaded, the loader path and torch's bundled NVIDIA "
        "libraries)"
    )


def load() -> Any:
    lib = _find_libcudart()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with cudaError {rc}")

    class Runtime:
        cudaIpcMemLazyEnablePeerAccess = 1

        @staticmethod
        def memset(ptr: int, value: int, size: int) -> None:
            check(lib.cudaMemset(vp(ptr), ctypes.c_int(value), sz(size)), "cudaMemset")

        @staticmethod
        def deviceSynchronize() -> None:  # noqa: N802 - CuPy's spelling
            check(lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

        @staticmethod
        def ipcGetMemHandle(ptr: int) -> bytes:  # noqa: N802
            h = _IpcHandle()
            check(lib.cudaIpcGetMemHandle(ctypes.byref(h), vp(ptr)), "cudaIpcGetMemHandle")
            return ctypes.string_at(ctypes.addressof(h), _IPC_HANDLE_BYTES)

        @staticmethod
        def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:  # noqa: N802
            h = _IpcHandle()
            ctypes.memmove(ctypes.addressof(h), handle, _IPC_HANDLE_BYTES)
            out = vp()
            lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), _IpcHandle, ctypes.c_uint]
            check(
                lib.cudaIpcOpenMemHandle(ctypes.byref(out), h, ctypes.c_uint(flags)), "cudaIpcOpenMemHandle"
            )
            return int(out.value or 0)

        @staticmethod
        def ipcCloseMemHandle(ptr: int) -> None:  # noqa: N802
            check(lib.cudaIpcCloseMemHandle(vp(ptr)), "cudaIpcCloseMemHandle")

        @staticmethod
        def hostRegister(ptr: int, size: int, flags: int) -> None:  # noqa: N802
            check(lib.cudaHostRegister(vp(ptr), sz(size), ctypes.c_uint(flags)), "cudaHostRegister")

        @staticmethod
        def hostUnregister(ptr: int) -> None:  # noqa: N802
            check(lib.cudaHostUnregister(vp(ptr)), "cudaHostUnregister")

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index
            self._prev = ctypes.c_int(0)

        def __enter__(self) -> Device:
            check(lib.cudaGetDevice(ctypes.byref(self._prev)), "cudaGetDevice")
            check(lib.cudaSetDevice(ctypes.c_int(self.index)), "cudaSetDevice")
            return self

        def __exit__(self, *exc: object) -> None:
            lib.cudaSetDevice(self._prev)

    class Memory:
        """A plain cudaMalloc allocation, freed when collected (like cupy.cuda.Memory)."""

        def __init__(self, size: int) -> None:
            out = vp()
            check(lib.cudaMalloc(ctypes.byref(out), sz(size)), "cudaMalloc")
            self.ptr = int(out.value or 0)
            self.size = size

        def __del__(self) -> None:
            if getattr(self, "ptr", 0):
                lib.cudaFree(vp(self.ptr))
                self.ptr = 0

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int | None = None) -> None:
            self.ptr, self.size, self.owner = ptr, size, owner

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    class NDArray:
        """Only a __cuda_array_interface__ for torch.as_tensor; keeps its memory alive."""

        def __init__(
            self, shape: tuple[int, ...], dtype: object = None, memptr: MemoryPointer | None = None
        ) -> None:
            assert memptr is not None
            self._memptr = memptr
            self.__cuda_array_interface__ = {
                "shape": tuple(shape),
                "typestr": "|u1",
                "data": (memptr.ptr, False),
                "version": 3,
                "strides": None,
                "stream": None,
            }

    cuda = types.SimpleNamespace(
        runtime=Runtime,
        Device=Device,
        Memory=Memory,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
    )
    return types.SimpleNamespace(cuda=cuda, ndarray=NDArray, uint8="uint8", FALLBACK=True)
