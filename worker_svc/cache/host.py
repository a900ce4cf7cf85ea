"""The cache host: allocates the shared KV cache once and tells workers how to attach.

It is deliberately small and long-lived: no compute, and the model's weights only as one shared
region it exports beside the KV cache (``shared_weights.py`` says why they live here). Workers
come and go (crash, upgrade, scale between a prefill and a decode worker) while the host keeps the
memory, so cached KV survives them. On exit (SIGTERM, SIGINT, normal return, or an exception) it unlinks its
shared-memory segments / frees its CUDA allocation; with CUDA IPC, workers must be stopped before
the host because the exporter has to outlive every importer.
"""

from __future__ import annotations

import atexit
from typing import Protocol

import grpc
import structlog

from pagedkv.grpc_server import GrpcServer, start_server
from pagedkv.v1 import cache_host_pb2, cache_host_pb2_grpc
from pagedkv.worker_svc.cache.layout import CacheGeometry
from pagedkv.worker_svc.cache.memory import CacheDescriptor, SharedCache, TensorDescriptor, TensorPair
from pagedkv.worker_svc.cache.shared_weights import WeightEntry, WeightsDescriptor


class _Closable(Protocol):
    def close(self) -> None: ...


SERVICE_NAME = cache_host_pb2.DESCRIPTOR.services_by_name["CacheHost"].full_name
log = structlog.get_logger("pagedkv.cache_host")


def geometry_to_proto(g: CacheGeometry) -> cache_host_pb2.CacheGeometry:
    return cache_host_pb2.CacheGeometry(
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        block_size=g.block_size,
        num_gpu_blocks=g.num_gpu_blocks,
        num_cpu_blocks=g.num_cpu_blocks,
        kv_cache_dtype=g.kv_cache_dtype,
        draft_num_layers=g.draft_num_layers,
        draft_num_kv_heads=g.draft_num_kv_heads,
        draft_head_dim=g.draft_head_dim,
    )


def geometry_from_proto(g: cache_host_pb2.CacheGeometry) -> CacheGeometry:
    return CacheGeometry(
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        block_size=g.block_size,
        num_gpu_blocks=g.num_gpu_blocks,
        num_cpu_blocks=g.num_cpu_blocks,
        kv_cache_dtype=g.kv_cache_dtype or "auto",  # an older host sends none
        draft_num_layers=g.draft_num_layers,
        draft_num_kv_heads=g.draft_num_kv_heads,
        draft_head_dim=g.draft_head_dim,
    )


def _tensor_to_proto(t: TensorDescriptor) -> cache_host_pb2.SharedTensor:
    return cache_host_pb2.SharedTensor(
        backend=t.backend,
        shm_name=t.shm_name,
        ipc_handle=t.ipc_handle,
        offset=t.offset,
        size=t.size,
        dtype=t.dtype,
        shape=list(t.shape),
        device_index=t.device_index,
    )


def _tensor_from_proto(t: cache_host_pb2.SharedTensor) -> TensorDescriptor:
    return TensorDescriptor(
        backend=t.backend,
        shape=tuple(int(x) for x in t.shape),
        dtype=t.dtype,
        shm_name=t.shm_name,
        ipc_handle=bytes(t.ipc_handle),
        offset=t.offset,
        size=t.size,
        device_index=t.device_index,
    )


def weights_to_proto(w: WeightsDescriptor) -> cache_host_pb2.SharedWeights:
    return cache_host_pb2.SharedWeights(
        region=_tensor_to_proto(w.region),
        source=w.source,
        tensors=[
            cache_host_pb2.WeightTensor(
                name=e.name, offset=e.offset, shape=list(e.shape), dtype=e.dtype, alias_of=e.alias_of
            )
            for e in w.tensors
        ],
    )


def weights_from_proto(info: cache_host_pb2.CacheInfo) -> WeightsDescriptor | None:
    """The shared weights the host exports, or None when it exports none."""
    if not info.HasField("weights"):
        return None
    w = info.weights
    return WeightsDescriptor(
        region=_tensor_from_proto(w.region),
        source=w.source,
        tensors=tuple(
            WeightEntry(
                name=e.name,
                offset=e.offset,
                shape=tuple(int(x) for x in e.shape),
                dtype=e.dtype,
                alias_of=e.alias_of,
            )
            for e in w.tensors
        ),
    )


def descriptor_to_proto(
    d: CacheDescriptor, model_name: str = "", weights: WeightsDescriptor | None = None
) -> cache_host_pb2.CacheInfo:
    info = cache_host_pb2.CacheInfo(
        backend=d.backend,
        gpu_cache=_tensor_to_proto(d.gpu),
        cpu_cache=_tensor_to_proto(d.cpu),
        geometry=geometry_to_proto(d.geometry),
        dtype=d.dtype,
        instance_id=d.instance_id,
        host_pid=d.host_pid,
        model_name=model_name,
        draft_model_name=d.draft_model,
    )
    if d.draft is not None:
        info.draft_gpu_cache.CopyFrom(_tensor_to_proto(d.draft.gpu))
        info.draft_cpu_cache.CopyFrom(_tensor_to_proto(d.draft.cpu))
    if weights is not None:
        info.weights.CopyFrom(weights_to_proto(weights))
    return info


def descriptor_from_proto(info: cache_host_pb2.CacheInfo) -> CacheDescriptor:
    return CacheDescriptor(
        backend=info.backend,
        gpu=_tensor_from_proto(info.gpu_cache),
        cpu=_tensor_from_proto(info.cpu_cache),
        geometry=geometry_from_proto(info.geometry),
        dtype=info.dtype,
        instance_id=info.instance_id,
        host_pid=info.host_pid,
        draft=TensorPair(_tensor_from_proto(info.draft_gpu_cache), _tensor_from_proto(info.draft_cpu_cache))
        if info.HasField("draft_gpu_cache")
        else None,
        draft_model=info.draft_model_name,
    )


class CacheHostServicer(cache_host_pb2_grpc.CacheHostServicer):
    """Serves the cache descriptor; the memory itself never crosses gRPC."""

    def __init__(self, cache: SharedCache, model_name: str, weights: WeightsDescriptor | None = None) -> None:
        self._info = descriptor_to_proto(cache.descriptor, model_name, weights)

    def GetCacheInfo(  # noqa: N802 - gRPC method name
        self, request: cache_host_pb2.GetCacheInfoRequest, context: grpc.ServicerContext
    ) -> cache_host_pb2.CacheInfo:
        return self._info


def serve_cache(
    cache: SharedCache,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    weights: WeightsDescriptor | None = None,
    **tls: object,
) -> GrpcServer:
    """Serve ``cache``'s descriptor (CacheHost API, health, reflection) on host:port.

    ``weights``: the shared weights region to advertise beside the cache (shared_weights.pack).
    ``tls`` takes pagedkv.grpc_server.start_server's TLS keywords. The caller keeps owning the cache."""
    servicer = CacheHostServicer(cache, model_name, weights)
    return start_server(
        host,
        port,
        lambda s: cache_host_pb2_grpc.add_CacheHostServicer_to_server(servicer, s),
        SERVICE_NAME,
        thread_prefix="cache-host-rpc",
        **tls,  # type: ignore[arg-type]
    )


class CacheOwner:
    """Holds the cache and closes it exactly once: on shutdown, or at interpreter exit."""

    def __init__(self, cache: SharedCache) -> None:
        self.cache = cache
        self._closed = False
        self._also: list[_Closable] = []
        atexit.register(self.close)

    def also_close(self, resource: _Closable) -> None:
        """Release ``resource`` (e.g. the shared weights) with the cache."""
        self._also.append(resource)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        desc = self.cache.descriptor
        while self._also:
            self._also.pop().close()
        self.cache.close()
        log.info(
            "cache_released",
            backend=desc.backend,
            segments=[s for s in desc.segments if s],
        )
