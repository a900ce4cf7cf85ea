"""The model's weights in one shared region: loaded once by the cache host, mapped by every worker.

Why the cache host owns them (not each worker, not a separate weights host): KV is a function of
the weights, so the two share a lifetime: new weights invalidate every cached block, and a cache
host restart loses the KV anyway. One long-lived exporter per device also keeps the CUDA IPC rule
simple (the exporter outlives every importer) with one process to order, not two. Workers stay
cheap to start, crash and restart: they map the region and own nothing but activations.

What is shared is the tensors the model computes with (``weights.fuse``: QKV and gate/up already
fused; a quantized matrix as its packed integers and fp32 scales), not the checkpoint's:
``registry.build_model(cfg, views)`` then copies nothing, and each worker's
model is built straight on views of its mapping. (A model that repacks weights for its kernels,
e.g. for oneDNN on CPU, holds that packed copy privately; the shared region is still one copy.)

On CPU the region is POSIX shared memory (``shm_backend``); on CUDA one ``cudaMalloc`` exported by
IPC handle (``cuda_ipc_backend``), exactly like the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.arith import ceil_div
from pagedkv.worker_svc.cache import shm_backend
from pagedkv.worker_svc.cache.layout import DTYPES, dtype_name, numel
from pagedkv.worker_svc.cache.memory import BACKEND_CUDA_IPC, BACKEND_SHM, TensorDescriptor

ALIGN = 64  # bytes: every tensor starts on a cache line (and on its element size)
# Dense weights in a cache dtype; quantized matrices as uint8 (packed int4, K-quant blocks) / int8
# beside fp32 scales (int32 row segments for K-quant blocks).
WEIGHT_DTYPES: dict[str, torch.dtype] = {
    **DTYPES,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
}


def _weight_dtype(name: str) -> torch.dtype:
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"unsupported shared weight dtype {name!r}; expected one of {sorted(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[name]


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
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # name -> view of the region
    _resources: list[Any] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.descriptor.region.size

    def close(self) -> None:
        """Drop the views, then unmap (the host also frees / unlinks). Idempotent."""
        self.tensors = {}
        while self._resources:
            self._resources.pop().close()


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[WeightEntry], int]:
    """Offsets for each distinct tensor (by identity); a second name for one tensor is an alias."""
    entries: list[WeightEntry] = []
    seen: dict[int, str] = {}
    offset = 0
    for name, t in tensors.items():
        if id(t) in seen:
            entries.append(WeightEntry(name, 0, tuple(t.shape), dtype_name(t.dtype), alias_of=seen[id(t)]))
            continue
        seen[id(t)] = name
        entries.append(WeightEntry(name, offset, tuple(t.shape), dtype_name(t.dtype)))
        offset += ceil_div(t.numel() * t.element_size(), ALIGN) * ALIGN
    return entries, max(offset, 1)


def _views(
    flat: torch.Tensor, entries: tuple[WeightEntry, ...] | list[WeightEntry]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.alias_of:
            out[e.name] = out[e.alias_of]
            continue
        dt = _weight_dtype(e.dtype)
        nbytes = numel(e.shape) * torch.empty((), dtype=dt).element_size()
        out[e.name] = flat[e.offset : e.offset + nbytes].view(dt).view(e.shape)
    return out


# ------------------------------------------------------------------------------ the host side
def pack(
    tensors: dict[str, torch.Tensor], device: torch.device, source: str, shm_prefix: str = "pagedkv"
) -> SharedWeights:
    """Copy ``tensors`` into one exported region; ``SharedWeights.tensors`` are the views of it."""
    entries, nbytes = _layout(tensors)
    resources: list[Any] = []
    try:
        if device.type == "cuda":
            from pagedkv.worker_svc.cache import cuda_ipc_backend

            exp = cuda_ipc_backend.export((nbytes,), torch.uint8, device)
            resources.append(exp)
            flat = exp.tensor
            region = TensorDescriptor(
                backend=BACKEND_CUDA_IPC,
                shape=(nbytes,),
                dtype="uint8",
                ipc_handle=exp.handle,
                offset=exp.offset,
                size=exp.size,
                device_index=exp.device_index,
            )
        else:
            seg = shm_backend.create(
                shm_backend.new_segment_name(shm_prefix, "weights"), (nbytes,), torch.uint8
            )
            resources.append(seg)
            flat = seg.tensor
            region = TensorDescriptor(
                backend=BACKEND_SHM, shape=(nbytes,), dtype="uint8", shm_name=seg.name, size=nbytes
            )
        assert flat is not None
        views = _views(flat, entries)
        for e in entries:
            if not e.alias_of:
                views[e.name].copy_(tensors[e.name])
        if device.type == "cuda":
            # The copies are queued on this process's stream; workers read the region through their
            # own contexts as soon as the descriptor is served. Wait for them here, explicitly, rather
            # than rely on the implicit sync of a later cudaFree (the loader's tensors may be freed
            # asynchronously by torch's caching allocator, which does not sync at all).
            torch.cuda.synchronize(device)
    except BaseException:
        for r in reversed(resources):
            r.close()
        raise
    return SharedWeights(
        WeightsDescriptor(region=region, tensors=tuple(entries), source=source), views, resources
    )


# ------------------------------------------------------------------------------ the worker side
def bind(
    desc: WeightsDescriptor, device: torch.device, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> SharedWeights:
    """Map the host's region; ``SharedWeights.tensors`` are views of it, no copy.

    ``spec`` is what this worker's model needs, name -> (shape, dtype) (``weights.fused_spec``:
    quantized matrices are integer tensors beside fp32 scales): a region with other names, shapes
    or dtypes (another model, or other weight forms) is a ValueError, and nothing is mapped."""
    have = {e.name: e for e in desc.tensors}
    if set(spec) != set(have):
        diff = sorted(set(spec) ^ set(have))
        raise ValueError(
            f"the cache host's shared weights do not fit this model: tensors differ, e.g. {diff[:3]}"
        )
    for n, (shape, dtype) in spec.items():
        e = have[n]
        if tuple(shape) != e.shape or dtype_name(dtype) != e.dtype:
            raise ValueError(
                f"the cache host's shared weight {n} is {e.dtype} {e.shape}, this model needs "
                f"{dtype_name(dtype)} {tuple(shape)}"
            )
    r = desc.region
    resources: list[Any] = []
    try:
        if r.backend == BACKEND_CUDA_IPC:
            if device.type != "cuda":
                raise ValueError(
                    f"the cache host shares its weights on CUDA but this worker runs on {device}"
                )
            from pagedkv.worker_svc.cache import cuda_ipc_backend

            imp = cuda_ipc_backend.attach(r.ipc_handle, r.offset, r.size, r.shape, torch.uint8, device)
            resources.append(imp)
            flat = imp.tensor
        else:
            if device.type != "cpu":
                raise ValueError(
                    f"the cache host shares its weights in host memory but this worker runs on {device}"
                )
            seg = shm_backend.attach(r.shm_name, r.shape, torch.uint8)
            resources.append(seg)
            flat = seg.tensor
        assert flat is not None
        views = _views(flat, desc.tensors)
    except BaseException:
        for res in reversed(resources):
            res.close()
        raise
    return SharedWeights(desc, views, resources)
