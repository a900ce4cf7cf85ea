"""Paged-attention kernels: pure functions on tensors (Triton on GPU, fast torch on CPU, plain torch
as reference).

Public API (argument names, order and shapes are a contract; see docs/kernels.md). The five
operations are declared once, with their full signatures and meaning, on
``pagedkv.kernels.backend.KernelBackend``; the entry points below are generated from it (same signature
and docstring): validate the arguments (``kernels/checks.py``), pick the backend
(``kernels/dispatch.py``), call it.

- ``write_kv_cache(key, value, key_cache, value_cache, slot_mapping)``
- ``paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, *,
  max_seq_len, num_splits, out) -> out``
- ``paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
  scale, *, max_query_len, out) -> out``
- ``copy_blocks(key_caches, value_caches, pairs)``
- ``swap_blocks(src, dst, pairs)``
- ``prepare_step(...) -> PagedStep``: a model step's attention metadata validated once, with the
  backend's per-step plans; every layer then calls ``step.write_kv_cache`` / ``step.attention``
  without re-validating (``kernels/step.py``).
- ``pagedkv.kernels.reference``: the same five in plain torch (the oracle).

One layer's cache is ``key_cache``/``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views, e.g. a layer of a
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor, are fine; head_dim must
be contiguous). A token's slot is ``block_id * block_size + offset``.

Backends and dispatch
---------------------
Backends are registered by name in ``kernels/backend.py`` ("reference", "cpu", "triton"). Each call
picks one from its tensors' device:

- CUDA tensors run the Triton kernels.
- CPU tensors run the CPU backend (``kernels/cpu/attention.py``: the native C kernels of
  ``kernels/cpu/native.py`` where they were built at install, else length-bucketed gathers + torch's
  fused SDPA, GQA folded per KV head; the reference's block copies, the batched swap), unless
  ``TRITON_INTERPRET=1`` was set before ``pagedkv.kernels`` was imported, in which case the Triton kernels
  run in Triton's interpreter (how CI tests them). bf16 on CPU always uses the CPU backend (the
  interpreter cannot do bf16 math).

Override (innermost wins): the context manager ``pagedkv.kernels.use_backend(name)`` (a worker's model
runner wraps each step in it with its ``--kernel-backend``), or the environment variable
``PAGEDKV_KERNEL_BACKEND``, with ``name`` in {"auto", "reference", "triton", "cpu"} (default
"auto", the rule above). E.g. a model runner whose tests run with TRITON_INTERPRET=1 keeps the fast
path with ``with pagedkv.kernels.use_backend("reference"): ...``. "triton" on CPU tensors requires the
interpreter. ``pagedkv.kernels.backend_for(tensor)`` says what a call on that tensor would use.

Triton is imported lazily (only when its backend is chosen), so ``from pagedkv import kernels`` works
without it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.kernels import backend, checks, reference
from pagedkv.kernels.backend import KernelBackend
from pagedkv.kernels.dispatch import BACKENDS, ENV_VAR, requested_backend, resolve, use_backend
from pagedkv.kernels.step import PagedStep, prepare_step

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "prepare_step",
    "PagedStep",
    "KernelBackend",
    "reference",
    "use_backend",
    "backend_for",
    "requested_backend",
    "BACKENDS",
    "ENV_VAR",
]


def backend_for(t: torch.Tensor, requested: str | None = None) -> str:
    """The backend ("triton", "cpu" or "reference") a call on tensors like ``t`` would use right now
    (``requested``: a name chosen by the caller, else the override / environment variable)."""
    return resolve(t.device, t.dtype, requested)


def _entry_point(op: str) -> Callable[..., Any]:
    """The public ``op``: ``KernelBackend.op``'s signature and docstring, less the backend's plan."""
    declared = getattr(KernelBackend, op)
    sig = inspect.signature(declared)
    sig = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in ("self", "plan")])
    validate: Callable[[checks.Args], checks.Where] = getattr(checks, op)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        where = validate(bound.arguments)
        if where is None:  # nothing to do (e.g. no block pairs)
            return None
        return getattr(backend.get(resolve(*where)), op)(**bound.arguments)

    call.__name__ = call.__qualname__ = op
    call.__doc__ = declared.__doc__
    call.__signature__ = sig  # type: ignore[attr-defined]
    return call


write_kv_cache = _entry_point("write_kv_cache")
paged_decode_attention = _entry_point("paged_decode_attention")
paged_prefill_attention = _entry_point("paged_prefill_attention")
copy_blocks = _entry_point("copy_blocks")
swap_blocks = _entry_point("swap_blocks")
