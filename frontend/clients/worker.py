"""Typed sync client for a worker (`pagedkv.v1.Worker`).

Built on the same channel/deadline/retry base as the block manager client. A
worker step is safe to retry after UNAVAILABLE: it only rewrites the KV of the
tokens it is given (same values) and re-runs copy/swap ops whose sources are
unchanged, so the client retries it like a read.
"""

from __future__ import annotations

from typing import Any

from frontend.clients.block_manager import GrpcClient, channel_options
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.v1 import worker_pb2_grpc as wpb_grpc

DEFAULT_STEP_TIMEOUT_S = 120.0
KEEPALIVE_S = 2.0


class WorkerClient(GrpcClient):
    """Sync worker client. Thread-safe: share one per process."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        kwargs.setdefault("default_timeout_s", DEFAULT_STEP_TIMEOUT_S)
        # A step may compute for long, but a worker that is alive answers keepalive pings meanwhile
        # (gRPC's own threads do): one that does not within KEEPALIVE_S + KEEPALIVE_S is hung, and
        # the engine moves its work to another worker (frontend/engine/dispatch.py).
        kwargs.setdefault(
            "options", channel_options(keepalive_time_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S)
        )
        super().__init__(target, **kwargs)
        self._stub = wpb_grpc.WorkerStub(self.channel)

    def __enter__(self) -> WorkerClient:
        return self

    def step(
        self, request: wpb.WorkerStepRequest, *, timeout_s: float | None = None
    ) -> wpb.WorkerStepResponse:
        return self._call(self._stub.Step, request, mutation=False, request_id=None, timeout_s=timeout_s)

    def get_info(self, *, timeout_s: float | None = None) -> wpb.WorkerInfo:
        return self._call(
            self._stub.GetWorkerInfo,
            wpb.GetWorkerInfoRequest(),
            mutation=False,
            request_id=None,
            timeout_s=timeout_s,
        )

    def fence(self, request_ids: list[str], *, timeout_s: float | None = None) -> wpb.FenceReply:
        """Tell the worker never to start these steps; the reply lists those it is running now.
        Safe to repeat (a read, as far as retries go)."""
        return self._call(
            self._stub.Fence,
            wpb.FenceRequest(request_ids=request_ids),
            mutation=False,
            request_id=None,
            timeout_s=timeout_s,
        )
