"""Backend selection: which registered backend (``kernels/backend.py``) runs a kernel call.

Three backends exist: Triton kernels (fast on a GPU, and runnable on CPU in Triton's interpreter,
which is how CI checks them), a plain-torch reference (the oracle), and the CPU backend
(``kernels/cpu/attention.py``, the fast path on CPU: the native C kernels of ``kernels/cpu/native.py``, built
at install, where they are available, else length-bucketed gathers and torch's fused SDPA; that
second choice is made per call inside ``kernels/cpu/attention.py``). This module decides between the
backends, from these inputs:

0. a name passed explicitly (``resolve(..., requested=name)``, ``pagedkv.kernels.backend_for(t, name)``);
1. otherwise an override set with the ``use_backend(name)`` context manager (innermost wins; it is
   a ``contextvars`` variable, so threads and asyncio tasks each see their own): how a worker's
   model runner applies its ``--kernel-backend`` to its steps without touching the process
   environment;
2. otherwise the environment variable ``PAGEDKV_KERNEL_BACKEND`` (read on every call, so tests can
   monkeypatch it);
3. ``"auto"`` (the default): CUDA tensors -> Triton; CPU tensors -> Triton in the interpreter when
   ``TRITON_INTERPRET=1`` was set before the kernels were imported, else the CPU backend. bf16 on
   CPU always goes to the CPU backend under "auto" because the interpreter cannot do bf16 math, and
   so do 8-bit caches (``kernels/quant.py``): on CPU their fast path is the native kernels, and the
   interpreter (how CI checks the Triton 8-bit path) is asked for by name, ``"triton"``. An
   fp8_e4m3 cache on a GPU older than sm_89 (no e4m3 in Triton there) takes the reference.

Triton is imported lazily, only when the Triton backend is chosen, so ``from pagedkv import kernels``
works on a machine without Triton (everything then runs on the reference).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Iterator
from typing import Literal

import torch

from pagedkv import envs

BackendName = Literal["auto", "reference", "triton", "cpu"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton", "cpu")
ENV_VAR = "PAGEDKV_KERNEL_BACKEND"

# 8-bit cache dtypes (kernels/quant.py): "auto" keeps them off the interpreter on CPU.
EIGHT_BIT: frozenset[torch.dtype] = frozenset({torch.int8, torch.float8_e4m3fn})

# Dtypes "auto" never sends to the interpreter: bf16 (no bf16 math there) and the 8-bit caches.
CPU_ONLY_UNDER_AUTO: frozenset[torch.dtype] = EIGHT_BIT | {torch.bfloat16}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagedkv_kernel_backend", default=None)


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: BackendName) -> Iterator[None]:
    """Force a backend for the calls made inside the ``with`` block.

    Why: the worker's tests run with TRITON_INTERPRET=1 suite-wide, where "auto" would send every
    CPU call through the (slow) interpreter; ``with use_backend("reference"):`` keeps them fast.
    """
    token = _override.set(_check_name(name, "use_backend"))
    try:
        yield
    finally:
        _override.reset(token)


def requested_backend() -> str:
    """The backend asked for right now: the innermost override, else the env var, else "auto"."""
    name = _override.get()
    if name is not None:
        return name
    return _check_name(envs.get_str(ENV_VAR).lower() or "auto", ENV_VAR)


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (as Triton itself parses it)."""
    return envs.get_bool("TRITON_INTERPRET")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton can be imported (it is an optional dependency)."""
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def triton_interpreted() -> bool:
    """Whether the Triton kernels were built for the interpreter (decided at their import)."""
    return bool(importlib.import_module("pagedkv.kernels.triton_backend").INTERPRETED)


# Triton's e4m3 type (tl.float8e4nv) compiles for compute capability 8.9 (Ada) and newer only.
FP8_E4M3_MIN_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=16)
def _capability_of(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return int(major), int(minor)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (read once per device)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def triton_lacks_fp8(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` is the e4m3 cache on a CUDA device older than sm_89, where Triton has no e4m3."""
    if dtype is not torch.float8_e4m3fn or device.type != "cuda":
        return False
    return capability(device) < FP8_E4M3_MIN_CAPABILITY


def resolve(device: torch.device, dtype: torch.dtype | None = None, requested: str | None = None) -> str:
    """Return "triton", "cpu" or "reference" for a call on tensors living on ``device``.

    ``requested``: a backend name chosen by the caller ("auto" included); None = the override or
    environment variable (``requested_backend``)."""
    name = requested_backend() if requested is None else _check_name(requested, "requested backend")
    if name == "reference":
        return "reference"
    if name == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"kernel backend 'cpu' requested for tensors on {device}")
        return "cpu"
    if name == "triton":
        if not triton_available():
            raise RuntimeError("kernel backend 'triton' requested but triton is not importable")
        if device.type == "cpu" and not triton_interpreted():
            raise RuntimeError(
                "kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kernels "
                "are imported (the compiled kernels only run on CUDA tensors)"
            )
        if triton_lacks_fp8(device, dtype):
            raise RuntimeError(
                f"kernel backend 'triton' requested for an fp8_e4m3 KV cache on {device} (compute capability "
                f"{'.'.join(map(str, capability(device)))}): Triton's e4m3 needs 8.9 or newer; use int8, "
                "or the 'reference' backend"
            )
        return "triton"
    # auto
    if device.type == "cuda":
        if triton_lacks_fp8(device, dtype):  # correct but slow: the reference dequantizes in torch
            return "reference"
        return "triton" if triton_available() else "reference"
    if (
        device.type == "cpu"
        and dtype not in CPU_ONLY_UNDER_AUTO
        and interpret_requested()
        and triton_available()
    ):
        return "triton" if triton_interpreted() else "cpu"
    return "cpu" if device.type == "cpu" else "reference"
