"""The block manager's one gRPC servicer: every RPC runs the same small
pipeline, top to bottom.

1. tenancy (block_manager_svc/tenancy.py): who is calling; with
   authentication on, the request rewritten into the caller's namespace
   (`TenantScope.enter`), and the reply mapped back (`leave`). With it off,
   `NO_TENANCY` passes everything through.
2. reliability (block_manager_svc/reliability.py): deadline, request-id
   dedupe, leases, journal (`ReliableStage.run`); mutations and KeepAlive only.
3. core (block_manager_svc/handlers.py): the request applied to the core
   under the state lock, the reply built, the call's KV events handed to the
   event hub (`CoreStage.apply`).

Reads skip the stages they do not need: GetBlockTable is scoped and read,
GetStats is scoped (a tenant sees its own numbers) and read, GetConfig is read,
WatchEvents streams from the event hub (block_manager_svc/events.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from pagedkv.block_manager_svc.core import BlockManager
from pagedkv.block_manager_svc.handlers import CoreStage
from pagedkv.block_manager_svc.reliability import ReliableStage
from pagedkv.block_manager_svc.tenancy import NO_TENANCY, Tenancy
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pagedkv.block_manager_svc.events import EventHub


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, core: BlockManager, num_cpu_blocks: int = 0, tenancy: Tenancy = NO_TENANCY) -> None:
        self._lock = threading.RLock()  # the state lock, shared by every stage
        self.core_stage = CoreStage(core, self._lock)
        self.reliable = ReliableStage(self.core_stage)
        self.tenancy = tenancy
        self.log_limit = self.core_stage.log_limit

    # --- what the stages share --------------------------------------------------------------
    @property
    def _core(self) -> BlockManager:
        """The core (recovery may have replaced the one passed in)."""
        return self.core_stage.core

    @property
    def events_hub(self) -> EventHub | None:
        return self.core_stage.events_hub

    @events_hub.setter
    def events_hub(self, hub: EventHub | None) -> None:
        self.core_stage.events_hub = hub

    # --- the pipeline ---------------------------------------------------------------------
    def _mutate(self, name: str, request: Any, context: Any) -> Any:
        if self.tenancy is NO_TENANCY:  # authentication off: nothing to rewrite or map back
            return self.reliable.run(name, request, context)
        scoped = self.tenancy.enter(name, request, context)
        response = self.reliable.run(name, scoped.request, scoped.context, scoped.tenant)
        return self.tenancy.leave(name, scoped, response)

    # --- mutations ---------------------------------------------------------------------------
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        return self._mutate("Allocate", request, context)

    def Append(self, request: pb.AppendRequest, context: grpc.ServicerContext) -> pb.AppendResponse:
        return self._mutate("Append", request, context)

    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        return self._mutate("Fork", request, context)

    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        return self._mutate("Free", request, context)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        return self._mutate("Commit", request, context)

    def SwapIn(self, request: pb.SwapInRequest, context: grpc.ServicerContext) -> pb.SwapInResponse:
        return self._mutate("SwapIn", request, context)

    def Preempt(self, request: pb.PreemptRequest, context: grpc.ServicerContext) -> pb.PreemptResponse:
        return self._mutate("Preempt", request, context)

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        return self._mutate("Step", request, context)

    def ResetPrefixCache(  # noqa: N802 - gRPC method name
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every prefix-cache hash (their KV is gone: a new cache host). Cannot fail."""
        return self._mutate("ResetPrefixCache", request, context)

    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> pb.KeepAliveResponse:
        return self._mutate("KeepAlive", request, context)

    # --- reads --------------------------------------------------------------------------------
    def GetBlockTable(self, request: pb.GetBlockTableRequest, context: grpc.ServicerContext) -> pb.BlockTable:
        scoped = self.tenancy.enter("GetBlockTable", request, context)
        return self.core_stage.GetBlockTable(scoped.request, scoped.context)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.Stats:
        own = self.tenancy.own_stats(request, context, self.core_stage.core, self._lock)
        if own is not None:
            return own
        return self.reliable.add_stats(self.core_stage.GetStats(request, context))

    def GetConfig(self, request: pb.GetConfigRequest, context: grpc.ServicerContext) -> pb.Config:
        return self.core_stage.GetConfig(request, context)

    def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KvEvent]:
        """KV events (BlockStored / BlockRemoved / AllBlocksCleared) for cache-aware routers."""
        hub = self.events_hub
        if hub is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are off (--enable-kv-events)")
        yield from hub.watch(request, context)  # type: ignore[union-attr]
