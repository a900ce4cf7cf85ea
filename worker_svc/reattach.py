"""A worker that stayed up re-attaches to a restarted cache host (docs/worker.md, "Cache host loss").

Why: the cache host's memory is the KV cache and, when shared, the weights. After a SIGKILL and a
restart (a supervisor's job) a new instance with new, empty memory answers at the same address. A
worker that did not exit would keep its mapping of the dead instance and refuse every step ("the
step expects cache host instance ..."): only a restart by hand fixed it. Re-attaching in place does
what a restart would, without reloading anything the worker still owns:

1. check the new instance's geometry and dtype equal the ones this worker's model runs with (they
   come from the same block manager; a mismatch is refused and the worker exits after its grace);
2. map the new cache (and the new shared weights, when the worker uses the host's weights: the old
   region died with the old host; a worker with its own weights keeps its model);
3. swap a new ModelRunner into the servicer, which reports the new ``cache_instance_id`` with
   ``CACHE_STATE_ATTACHED`` (what the engine's recovery waits for) and serves steps again;
4. close the old runner (waits for a step in flight), then unmap the old cache and weights, so
   nothing of the dead instance stays mapped in this process or named in /dev/shm.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch

from pagedkv.v1 import cache_host_pb2, worker_pb2
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache.host import descriptor_from_proto, weights_from_proto
from pagedkv.worker_svc.cache.layout import GeometryMismatch, dtype_from_name

if TYPE_CHECKING:
    from pagedkv.worker_svc.cache.shared_weights import SharedWeights, WeightsDescriptor
    from pagedkv.worker_svc.model.registry import Model
    from pagedkv.worker_svc.model_runner import ModelRunner
    from pagedkv.worker_svc.server import WorkerProcess

log = structlog.get_logger("pagedkv.worker")

# (dtype, the new host's shared weights or None) -> (model, its mapping of the host's weights or None)
ModelFor = Callable[[torch.dtype, "WeightsDescriptor | None"], "tuple[Model, SharedWeights | None]"]
RunnerFor = Callable[["Model", cache_memory.SharedCache], "ModelRunner"]


def reattach(
    proc: WorkerProcess,
    info: cache_host_pb2.CacheInfo,
    device: torch.device,
    model_for: ModelFor,
    runner_for: RunnerFor,
    lock: threading.Lock,
) -> None:
    """Move ``proc`` onto the cache host instance described by ``info`` (steps 1-4 above).

    Raises GeometryMismatch (nothing changed) when the new instance cannot serve this worker's
    model. ``lock`` serialises this with the worker's shutdown."""
    desc = descriptor_from_proto(info)
    old = proc.cache.descriptor
    if desc.geometry != old.geometry or desc.dtype != old.dtype:
        raise GeometryMismatch(
            f"the new cache host instance {desc.instance_id} has geometry {desc.geometry.as_dict()} "
            f"{desc.dtype}, "
            f"this worker runs with {old.geometry.as_dict()} {old.dtype}: restart the worker"
        )
    with lock:
        if proc.closed:
            raise RuntimeError("the worker is shutting down")
        servicer = proc.servicer
        old_runner = servicer.runner
        cache = cache_memory.attach(desc, device)
        weights: SharedWeights | None = None
        try:
            if proc.weights is not None:  # the old host's weights died with it: map the new host's
                model, weights = model_for(dtype_from_name(desc.dtype), weights_from_proto(info))
            else:
                model = old_runner.model
            runner = runner_for(model, cache)
        except BaseException:
            cache.close()
            if weights is not None:
                weights.close()
            raise
        old_cache, old_weights = proc.cache, proc.weights

        def release() -> None:  # under the old runner's lock: no step can touch the old mapping now
            old_runner.model = None  # type: ignore[assignment]  # its views of the old weights go with it
            gc.collect()
            for name, res in (("cache", old_cache), ("weights", old_weights)):
                if res is None:
                    continue
                try:  # e.g. closing a CUDA IPC handle whose exporter died: the new attachment matters more
                    res.close()
                except Exception as e:  # noqa: BLE001 - logged; what is left goes with the process
                    log.warning(
                        "old_cache_host_release_failed",
                        what=name,
                        instance_id=old.instance_id,
                        error=f"{type(e).__name__}: {e}",
                    )

        old_runner.close(release=release)
        proc.cache, proc.weights = cache, weights
        winfo = worker_pb2.WorkerInfo()
        winfo.CopyFrom(servicer.info)
        winfo.cache_instance_id = desc.instance_id
        winfo.cache_state = worker_pb2.CACHE_STATE_ATTACHED
        winfo.cache_lost_reason = ""
        winfo.shared_weights = weights is not None
        servicer.attach(runner, winfo)
    log.warning(
        "cache_host_reattached",
        old_instance_id=old.instance_id,
        instance_id=desc.instance_id,
        host_pid=desc.host_pid,
        backend=desc.backend,
        shared_weights=weights is not None,
        action="serving again; every sequence must be re-prefilled",
    )
