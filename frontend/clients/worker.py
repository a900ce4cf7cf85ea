"""Typed sync client for a worker (`pagedkv.v1.Worker`).

Built on the same channel/deadline/retry base as the block manager client. A
worker step is safe to retry after UNAVAILABLE: it only rewrites the KV of the
tokens it is given (same values) and re-runs copy/swap ops whose sources are
unchanged, so the client retries it like a read.

Step transport (``step_transport``, docs/worker.md "Step transport"): ``auto``
sends Step through the worker's one-host step channel (shared memory,
frontend/clients/step_channel.py) when its ``WorkerInfo.step_channel`` names one
this process can connect to (same host, same user), else gRPC; ``grpc`` always
uses gRPC; ``shm`` insists on the channel and fails a step when the worker offers
none. Every other call (GetWorkerInfo, Fence, health) is gRPC.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import grpc
import structlog

from pagedkv.frontend.clients.block_manager import GrpcClient, channel_options
from pagedkv.frontend.clients.step_channel import DEFAULT_SPIN_US, ChannelUnusable, StepChannel
from pagedkv.step_channel import StepChannelError
from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.v1 import worker_pb2_grpc as wpb_grpc

DEFAULT_STEP_TIMEOUT_S = 120.0
KEEPALIVE_S = 2.0
StepTransport = Literal["auto", "grpc", "shm"]
STEP_TRANSPORTS: tuple[StepTransport, ...] = ("auto", "grpc", "shm")

log = structlog.get_logger("pagedkv.client")


class StepChannelMissing(RuntimeError):
    """``step_transport="shm"`` was asked, and this worker offers no step channel this process can use."""


class WorkerClient(GrpcClient):
    """Sync worker client. Thread-safe: share one per process."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        """``step_transport`` (StepTransport, default "auto") and ``step_spin_us`` (float) choose
        the step's transport; the rest are GrpcClient's (TLS, token, deadline, retry)."""
        step_transport = kwargs.pop("step_transport", "auto")
        step_spin_us = float(kwargs.pop("step_spin_us", DEFAULT_SPIN_US))
        if step_transport not in STEP_TRANSPORTS:
            raise ValueError(
                f"step_transport must be one of {', '.join(STEP_TRANSPORTS)}, got {step_transport!r}"
            )
        kwargs.setdefault("default_timeout_s", DEFAULT_STEP_TIMEOUT_S)
        # A step may compute for long, but a worker that is alive answers keepalive pings meanwhile
        # (gRPC's own threads do): one that does not within KEEPALIVE_S + KEEPALIVE_S is hung, and
        # the engine moves its work to another worker (frontend/engine/dispatch.py). The step
        # channel pings the same way.
        kwargs.setdefault(
            "options", channel_options(keepalive_time_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S)
        )
        super().__init__(target, **kwargs)
        self._stub = wpb_grpc.WorkerStub(self.channel)
        self.step_transport: StepTransport = step_transport
        self._spin_us = step_spin_us
        self._transport_lock = threading.Lock()
        self._step_channel: StepChannel | None = None
        self._advertised = ""  # the path the worker last advertised ("" = none, or not asked yet)
        self._known = False  # the worker's WorkerInfo was read at least once

    def __enter__(self) -> WorkerClient:
        return self

    @property
    def transport(self) -> str:
        """What the next step uses: "shm" or "grpc"."""
        return "shm" if self._step_channel is not None else "grpc"

    def _learn(self, info: wpb.WorkerInfo) -> None:
        """Follow the worker's advertised step channel (a restarted worker has a new one)."""
        if self.step_transport == "grpc":
            return
        with self._transport_lock:
            self._known = True
            path = info.step_channel
            if path == self._advertised and (self._step_channel is not None or not path):
                return
            old, self._step_channel = self._step_channel, None
            self._advertised = path
            if path:
                self._step_channel = StepChannel(path, spin_us=self._spin_us, keepalive_s=KEEPALIVE_S)
        if old is not None:
            old.close()

    def _drop_channel(self, channel: StepChannel, why: str) -> None:
        with self._transport_lock:
            if self._step_channel is channel:
                self._step_channel = None
                self._known = False  # ask the worker again before the next step
        channel.close()
        log.info("step_channel_unusable", worker=self.target, path=channel.path, reason=why)

    def _channel_for_step(self, timeout_s: float | None) -> StepChannel | None:
        if self.step_transport == "grpc":
            return None
        if not self._known:
            try:
                self.get_info(timeout_s=timeout_s)
            except grpc.RpcError:
                if self.step_transport == "shm":
                    raise
                return None  # the step over gRPC will say what is wrong
        channel = self._step_channel
        if channel is None and self.step_transport == "shm":
            raise StepChannelMissing(
                f"worker {self.target} offers no step channel (--step-transport shm needs the worker on this "
                "host, run by this user, with its step channel on)"
            )
        return channel

    def step(
        self, request: wpb.WorkerStepRequest, *, timeout_s: float | None = None
    ) -> wpb.WorkerStepResponse:
        channel = self._channel_for_step(timeout_s)
        if channel is not None:
            try:
                return self._call(channel, request, mutation=False, request_id=None, timeout_s=timeout_s)
            except ChannelUnusable as e:
                self._drop_channel(channel, str(e))
                if self.step_transport == "shm":  # it advertised one, nothing answers there: gone
                    raise StepChannelError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        return self._call(self._stub.Step, request, mutation=False, request_id=None, timeout_s=timeout_s)

    def get_info(self, *, timeout_s: float | None = None) -> wpb.WorkerInfo:
        info: wpb.WorkerInfo = self._call(
            self._stub.GetWorkerInfo,
            wpb.GetWorkerInfoRequest(),
            mutation=False,
            request_id=None,
            timeout_s=timeout_s,
        )
        self._learn(info)
        return info

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

    def close(self) -> None:
        with self._transport_lock:
            channel, self._step_channel = self._step_channel, None
        if channel is not None:
            channel.close()
        super().close()
