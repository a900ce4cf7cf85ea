"""Turning the ``--device`` / ``--dtype`` settings into torch values.

"auto" means CUDA when torch sees a GPU, else CPU; and float32 on CPU (exact, and what the CPU
kernels and the tests compare against), bfloat16 on CUDA (Llama checkpoints' native precision).
"""

from __future__ import annotations

import contextlib

import torch

from pagedkv.worker_svc.cache.layout import dtype_from_name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for CUDA but torch sees no GPU")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_from_name(name)


def device_scope(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Make ``device`` the current CUDA device for the calls inside (a no-op off CUDA).

    Why: a worker's steps run on gRPC pool threads, and CUDA's current device is per thread and
    starts at 0. Triton launches on the current device's context, so with ``--device cuda:1`` a step
    without this would launch its kernels in device 0's context on device 1's memory."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
