"""The model's weights in one shared region: loaded once by the cache host, mapped by every worker.

Why the cache host owns them (not each worker, not a separate weights host): KV is a function of
the weights, so the two share a lifetime: new weights invalidate every cached block, and a cache
host restart loses the KV anyway. One long-lived exporter per device also keeps the CUDA IPC rule
simple (the exporter outlives every importer) with one process to order, not two. Workers stay
cheap to start, crash and restart: they map the region and own nothing but activations.

What is shared is the model's tensors *as the model uses them* (fused QKV and gate/up included),
not the checkpoint's tensors: the host builds the model once, then ``pack`` copies every tensor the
model holds into one region and rebinds the model to views of it. A worker builds an empty model on
the meta device (no memory, no compute) and ``bind``s the same names to views of its mapping. So the
model code (``model/llama.py``) needs no knowledge of sharing: whatever tensors it keeps in
attributes, dataclass fields and lists are found by ``model_tensors``.

On CPU the region is POSIX shared memory (``shm_backend``); on CUDA one ``cudaMalloc`` exported by
IPC handle (``cuda_ipc_backend``), exactly like the KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_svc import shm_backend
from worker_svc.cache_layout import dtype_from_name, dtype_name, numel
from worker_svc.cache_memory import BACKEND_CUDA_IPC, BACKEND_SHM, TensorDescriptor

ALIGN = 64  # bytes: every tensor starts on a cache line (and on its element size)


@dataclass(slots=True, frozen=True)
class WeightEntry:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    alias_of: str = ""


@dataclass(slots=True, frozen=True)
class WeightsDescriptor:
    """What travels in ``CacheInfo.weights``: the region and where each tensor sits in it."""

    region: TensorDescriptor  # flat uint8
    tensors: tuple[WeightEntry, ...]
    source: str


@dataclass(slots=True)
class SharedWeights:
    """A region (owned by the host, or mapped by a worker) and its descriptor. ``close()`` releases it."""

    descriptor: WeightsDescriptor
    _resources: list[Any] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.descriptor.region.size

    def close(self) -> None:
        while self._resources:
            self._resources.pop().close()


# ------------------------------------------------------------------------------ finding tensors
def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield f.name, getattr(obj, f.name)
    elif isinstance(obj, (list, tuple)):
        yield from ((str(i), v) for i, v in enumerate(obj))
    elif hasattr(obj, "__dict__"):
        yield from vars(obj).items()


def model_tensors(model: Any, _prefix: str = "", _depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the model holds, by dotted path (``embed``, ``layers.0.w_qkv``...), in a fixed order."""
    for name, value in _children(model):
        path = f"{_prefix}{name}"
        if isinstance(value, torch.Tensor):
            yield path, value
        elif _depth < 3 and (
            isinstance(value, (list, tuple)) or dataclasses.is_dataclass(value)
        ):
            yield from model_tensors(value, path + ".", _depth + 1)


def _set(model: Any, path: str, value: torch.Tensor) -> None:
    *parents, last = path.split(".")
    obj = model
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, (list, tuple)) else getattr(obj, p)
    if isinstance(obj, list):
        obj[int(last)] = value
    else:
        setattr(obj, last, value)


def _layout(model: Any) -> tuple[list[WeightEntry], int]:
    """Offsets for each distinct tensor (by storage identity); aliases point at the first name."""
    entries: list[WeightEntry] = []
    seen: dict[tuple[int, int], str] = {}
    offset = 0
    for name, t in model_tensors(model):
        key = (t.data_ptr(), t.numel()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            entries.append(WeightEntry(name, 0, tuple(t.shape), dtype_name(t.dtype), alias_of=seen[key]))
            continue
        seen[key] = name
        entries.append(WeightEntry(name, offset, tuple(t.shape), dtype_name(t.dtype)))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return entries, max(offset, 1)


def _views(flat: torch.Tensor, entries: tuple[WeightEntry, ...] | list[WeightEntry]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.alias_of:
            out[e.name] = out[e.alias_of]
            continue
        dt = dtype_from_name(e.dtype)
        nbytes = numel(e.shape) * torch.empty((), dtype=dt).element_size()
        out[e.name] = flat[e.offset : e.offset + nbytes].view(dt).view(e.shape)
    return out


# ------------------------------------------------------------------------------ the host side
def pack(model: Any, device: torch.device, source: str, shm_prefix: str = "pagedkv") -> SharedWeights:
    """Copy every tensor of ``model`` into one exported region and rebind the model to its views.

    The model's private copies are dropped by the rebinding, so the host holds one copy too."""
    entries, nbytes = _layout(model)
    resources: list[Any] = []
    try:
        if device.type == "cuda":
            from worker_svc import cuda_ipc_backend

            exp = cuda_ipc_backend.export((nbytes,), torch.uint8, device)
            resources.append(exp)
            flat = exp.tensor
            region = TensorDescriptor(
                backend=BACKEND_CUDA_IPC, shape=(nbytes,), dtype="uint8", ipc_handle=exp.handle,
                offset=exp.offset, size=exp.size, device_index=exp.device_index,
            )
        else:
            seg = shm_backend.create(shm_backend.new_segment_name(shm_prefix, "weights"), (nbytes,), torch.uint8)
            resources.append(seg)
            flat = seg.tensor
            region = TensorDescriptor(backend=BACKEND_SHM, shape=(nbytes,), dtype="uint8", shm_name=seg.name, size=nbytes)
        assert flat is not None
        views = _views(flat, entries)
        current = dict(model_tensors(model))
        for e in entries:
            if not e.alias_of:
                views[e.name].copy_(current[e.name])
        for name, v in views.items():
            _set(model, name, v)
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    return SharedWeights(WeightsDescriptor(region=region, tensors=tuple(entries), source=source), resources)


# ------------------------------------------------------------------------------ the worker side
def bind(model: Any, desc: WeightsDescriptor, device: torch.device) -> SharedWeights:
    """Map the host's region and point every tensor of ``model`` (built on the meta device) at it.

    Raises ValueError when the model's tensors do not match the region's names, shapes or dtypes
    (another model, another dtype): nothing is bound then."""
    want = {n: t for n, t in model_tensors(model)}
    have = {e.name: e for e in desc.tensors}
    if set(want) != set(have):
        diff = sorted(set(want) ^ set(have))
        raise ValueError(f"the cache host's shared weights do not fit this model: tensors differ, e.g. {diff[:3]}")
    for n, t in want.items():
        e = have[n]
        if tuple(t.shape) != e.shape or dtype_name(t.dtype) != e.dtype:
            raise ValueError(
                f"the cache host's shared weight {n} is {e.dtype} {e.shape}, this model needs "
                f"{dtype_name(t.dtype)} {tuple(t.shape)}"
            )
    r = desc.region
    resources: list[Any] = []
    try:
        if r.backend == BACKEND_CUDA_IPC:
            if device.type != "cuda":
                raise ValueError(f"the cache host shares its weights on CUDA but this worker runs on {device}")
            from worker_svc import cuda_ipc_backend

            imp = cuda_ipc_backend.attach(r.ipc_handle, r.offset, r.size, r.shape, torch.uint8, device)
            resources.append(imp)
            flat = imp.tensor
        else:
            if device.type != "cpu":
                raise ValueError(f"the cache host shares its weights in host memory but this worker runs on {device}")
            seg = shm_backend.attach(r.shm_name, r.shape, torch.uint8)
            resources.append(seg)
            flat = seg.tensor
        assert flat is not None
        for name, v in _views(flat, desc.tensors).items():
            _set(model, name, v)
    except BaseException:
        for res in reversed(resources):
            res.close()
        raise
    for attr, value in vars(model).items():  # e.g. LlamaModel.device, computed from meta tensors
        if isinstance(value, torch.device) and value.type == "meta":
            setattr(model, attr, device)
    return SharedWeights(desc, resources)


def meta_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint-shaped tensors with no storage: enough to build the model's skeleton for ``bind``."""
    return {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()}
