"""Typed clients for the block manager: ``BlockManagerClient`` (sync) and
``AsyncBlockManagerClient`` (asyncio).

What every call gets:

* **One channel per client**, reused by all calls (HTTP/2 multiplexes them),
  with keepalive pings so a dead peer is noticed while calls are in flight.
  Create one client per process (or per event loop) and share it.
* **A deadline**: ``timeout_s`` per call, default the client's
  ``default_timeout_s`` (5 s). It covers all attempts and backoff sleeps.
* **Retries on UNAVAILABLE** with exponential backoff and full jitter
  (:mod:`pagedkv.retry` explains why this is a client-side loop and not
  gRPC's service-config retry policy). Reads always retry. Mutations
  (Allocate, Append, Fork, Free, Step, KeepAlive, SwapIn, Preempt) retry only when you pass a
  ``request_id`` (Commit is idempotent by definition and always retries): a retried mutation that
  the server already applied would be applied twice, and only request ids let the server recognise
  the repeat
  and answer it from its dedupe table (docs/reliability.md).

Methods mirror the RPCs and return the protobuf responses; errors raise
``grpc.RpcError`` with the server's status code and message (``grpc.aio``
raises ``grpc.aio.AioRpcError``, also a ``grpc.RpcError``).

Seam for other services: :class:`GrpcClient` / :class:`AsyncGrpcClient` own
the channel, the default deadline and the retry rule; a worker client
subclasses them the same way (``self._stub = worker_pb2_grpc.WorkerStub(self.channel)``
and one ``self._call(...)`` per method).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.dial import check_token_transport
from pagedkv.retry import RetryPolicy, async_call_with_retry, call_with_retry
from pagedkv.tls import auth_metadata
from pagedkv.tls import channel as tls_channel
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the block manager's default limit


def channel_options(
    *,
    keepalive_time_s: float = 10.0,
    keepalive_timeout_s: float = 5.0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_reconnect_backoff_s: float = 1.0,
) -> list[tuple[str, Any]]:
    """Channel arguments used by the clients.

    Keepalive pings are sent only while calls are in flight
    (``keepalive_permit_without_calls=0``), every 10 s, and a connection whose ping is not answered
    within 5 s is closed: a silent (half-open) link fails its calls with UNAVAILABLE within 15 s
    instead of hanging them until their deadlines, and the retry reconnects. pagedkv's servers accept
    pings down to 1 s apart (pagedkv/grpc_server.py); a stock gRPC server answers pings more frequent
    than every 5 minutes on a connection without data with GOAWAY (too_many_pings).
    gRPC's own transparent retries stay on; our policy adds the backoff loop.
    Reconnection backs off from 0.1 s to at most ``max_reconnect_backoff_s``
    (gRPC's default grows to 120 s): a peer that restarts, e.g. the block
    manager under a restart policy, is reached again within that much of
    coming back, so a caller riding out the outage is not left waiting.
    """
    return [
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        # Any unanswered ping (keepalive's, or the flow-control probe that may already be in flight
        # when a link goes silent: keepalive then waits for it) closes the connection this soon,
        # not after gRPC's default minute.
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(max_reconnect_backoff_s * 1000)),
    ]


def _check_timeout(timeout_s: float) -> float:
    if not timeout_s > 0:
        raise ValueError(f"default_timeout_s must be > 0 (every call has a deadline), got {timeout_s}")
    return timeout_s


# ----------------------------------------------------------------------------------------------
# Request builders, shared by the sync and asyncio clients.


def allocate_request(
    seq_id: str,
    num_tokens: int,
    token_ids: Sequence[int] | None = None,
    priority: int = 0,
    request_id: str | None = None,
    lease_id: str | None = None,
    cache_salt: str | None = None,
) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        seq_id=seq_id,
        num_tokens=num_tokens,
        token_ids=token_ids or (),
        priority=priority,
        request_id=request_id or "",
        lease_id=lease_id or "",
        cache_salt=cache_salt or "",
    )


def append_request(
    seq_id: str, num_tokens: int = 1, token_ids: Sequence[int] | None = None, request_id: str | None = None
) -> pb.AppendRequest:
    return pb.AppendRequest(
        seq_id=seq_id, num_tokens=num_tokens, token_ids=token_ids or (), request_id=request_id or ""
    )


def step_decode_request(
    seq_ids: Sequence[str],
    token_ids: Sequence[int] | None = None,
    frees: Iterable[str] = (),
    request_id: str | None = None,
) -> pb.StepRequest:
    """The packed form of a decode step: one token for each of ``seq_ids``.

    ``token_ids`` (optional) holds one token id per sequence, in order; with
    them, blocks that fill up enter the prefix cache. ``frees`` are applied
    first (they make room), as the server documents.
    """
    if token_ids is not None and len(token_ids) != len(seq_ids):
        raise ValueError(f"token_ids has {len(token_ids)} entries for {len(seq_ids)} sequences")
    return pb.StepRequest(
        append_seq_ids=seq_ids,
        append_token_ids=token_ids or (),
        free_seq_ids=frees,
        request_id=request_id or "",
    )


def new_blocks_by_sequence(response: pb.StepResponse, num_seqs: int) -> list[list[int]]:
    """Unpack a packed Step's new blocks: one list of new block ids per sequence of
    ``append_seq_ids`` (in order; a copy-on-write replacement comes first, see
    ``packed_replaced_index``)."""
    out: list[list[int]] = [[] for _ in range(num_seqs)]
    for index, block_id in zip(response.packed_new_block_index, response.packed_new_block_ids, strict=False):
        out[index].append(block_id)
    return out


# ----------------------------------------------------------------------------------------------
# One call as data: which RPC, its request, and whether a retry is safe. Both clients run these.


@dataclass(slots=True, frozen=True)
class Call:
    """An RPC to make: the stub method's name, the request, and the retry rule's inputs (a
    mutation is retried only with a ``request_id``)."""

    method: str
    request: Any
    mutation: bool
    request_id: str | None = None


def fork_call(parent_seq_id: str, child_seq_id: str, request_id: str | None, lease_id: str | None) -> Call:
    req = pb.ForkRequest(
        parent_seq_id=parent_seq_id,
        child_seq_id=child_seq_id,
        request_id=request_id or "",
        lease_id=lease_id or "",
    )
    return Call("Fork", req, True, request_id)


def free_call(seq_id: str, request_id: str | None) -> Call:
    return Call("Free", pb.FreeRequest(seq_id=seq_id, request_id=request_id or ""), True, request_id)


def commit_call(seq_id: str, num_computed_tokens: int, request_id: str | None) -> Call:
    # Idempotent by definition: always retried, with or without a request id.
    req = pb.CommitRequest(
        seq_id=seq_id, num_computed_tokens=num_computed_tokens, request_id=request_id or ""
    )
    return Call("Commit", req, False, request_id)


def keep_alive_call(
    lease_id: str, ttl_ms: int, attach_seq_ids: Sequence[str], request_id: str | None
) -> Call:
    req = pb.KeepAliveRequest(
        lease_id=lease_id, ttl_ms=ttl_ms, attach_seq_ids=attach_seq_ids, request_id=request_id or ""
    )
    return Call("KeepAlive", req, True, request_id)


def swap_in_call(seq_id: str, request_id: str | None) -> Call:
    return Call("SwapIn", pb.SwapInRequest(seq_id=seq_id, request_id=request_id or ""), True, request_id)


def preempt_call(seq_id: str, mode: str, request_id: str | None) -> Call:
    return Call(
        "Preempt", pb.PreemptRequest(seq_id=seq_id, mode=mode, request_id=request_id or ""), True, request_id
    )


def reset_prefix_cache_call(request_id: str | None) -> Call:
    return Call("ResetPrefixCache", pb.ResetPrefixCacheRequest(request_id=request_id or ""), True, request_id)


def step_call(request: pb.StepRequest) -> Call:
    return Call("Step", request, True, request.request_id)


def read_call(method: str, request: Any) -> Call:
    """A read (GetBlockTable, GetStats, GetConfig): always safe to retry."""
    return Call(method, request, False)


# ----------------------------------------------------------------------------------------------
# Channel + deadline + retry: the base of every pagedkv client.


class _ClientBase:
    """What the sync and the asyncio client share: the channel (``aio`` picks the kind), the
    default deadline, the retry policy, the call metadata (bearer token)."""

    aio = False
    _stub: Any  # the generated stub the subclass builds on ``channel``; ``_run`` looks methods up on it

    def __init__(
        self,
        target: str,
        *,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        channel: Any = None,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        token: str = "",
        allow_insecure: bool = False,
    ) -> None:
        if channel is None:  # a token never goes over plaintext unless allowed (pagedkv/dial.py)
            check_token_transport(token, bool(tls_ca or tls_cert or tls_key), allow_insecure)
        self.target = target
        self.default_timeout_s = _check_timeout(default_timeout_s)
        self.retry = retry or RetryPolicy()
        self.metadata = tuple(metadata or ()) + auth_metadata(token) or None
        self._owns_channel = channel is None
        # TLS when any of tls_ca/tls_cert/tls_key is given (pagedkv/tls.py); token = bearer auth.
        self.channel = channel or tls_channel(
            target,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            options=list(options or channel_options()),
            aio=self.aio,
        )
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _retry_args(self, mutation: bool, request_id: str | None, timeout_s: float | None) -> dict[str, Any]:
        return {
            "timeout_s": self.default_timeout_s if timeout_s is None else timeout_s,
            "policy": self.retry,
            "retry_allowed": not mutation or bool(request_id),
            "metadata": self.metadata,
        }


class GrpcClient(_ClientBase):
    """Owns one channel, a default deadline and a retry policy (sync).

    ``on_call``, when set, is called after every RPC of this client (retries included in its time)
    with the wall time in seconds and the response (None when the call raised): how a benchmark
    times one client's RPCs without reaching into it."""

    on_call: Callable[[float, Any], None] | None = None

    def _call(
        self, method: Any, request: Any, *, mutation: bool, request_id: str | None, timeout_s: float | None
    ) -> Any:
        observe = self.on_call
        if observe is None:
            return call_with_retry(method, request, **self._retry_args(mutation, request_id, timeout_s))
        t0, response = time.perf_counter(), None
        try:
            response = call_with_retry(method, request, **self._retry_args(mutation, request_id, timeout_s))
            return response
        finally:
            observe(time.perf_counter() - t0, response)

    def _run(self, call: Call, timeout_s: float | None) -> Any:
        return self._call(
            getattr(self._stub, call.method),
            call.request,
            mutation=call.mutation,
            request_id=call.request_id,
            timeout_s=timeout_s,
        )

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects; raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> int:
        """grpc.health.v1 Check: a HealthCheckResponse.ServingStatus value (1 = SERVING)."""
        resp = self._call(
            self._health.Check,
            health_pb2.HealthCheckRequest(service=service),
            mutation=False,
            request_id=None,
            timeout_s=timeout_s,
        )
        return int(resp.status)

    def close(self) -> None:
        if self._owns_channel:
            self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient(_ClientBase):
    """Owns one grpc.aio channel, a default deadline and a retry policy.

    Create it inside the event loop that will use it (``async with`` in a
    coroutine): a grpc.aio channel belongs to one loop.
    """

    aio = True

    async def _call(
        self, method: Any, request: Any, *, mutation: bool, request_id: str | None, timeout_s: float | None
    ) -> Any:
        return await async_call_with_retry(
            method, request, **self._retry_args(mutation, request_id, timeout_s)
        )

    async def _run(self, call: Call, timeout_s: float | None) -> Any:
        return await self._call(
            getattr(self._stub, call.method),
            call.request,
            mutation=call.mutation,
            request_id=call.request_id,
            timeout_s=timeout_s,
        )

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> int:
        resp = await self._call(
            self._health.Check,
            health_pb2.HealthCheckRequest(service=service),
            mutation=False,
            request_id=None,
            timeout_s=timeout_s,
        )
        return int(resp.status)

    async def close(self) -> None:
        if self._owns_channel:
            await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ----------------------------------------------------------------------------------------------
# The block manager: the same methods twice (sync and awaitable), each one line over the calls above.


class BlockManagerClient(GrpcClient):
    """Sync block manager client. Thread-safe: share one per process."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._stub = pb_grpc.BlockManagerStub(self.channel)

    def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        lease_id: str | None = None,
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> pb.AllocateResponse:
        req = allocate_request(seq_id, num_tokens, token_ids, priority, request_id, lease_id, cache_salt)
        return self._run(Call("Allocate", req, True, request_id), timeout_s)

    def append(
        self,
        seq_id: str,
        num_tokens: int = 1,
        token_ids: Sequence[int] | None = None,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.AppendResponse:
        req = append_request(seq_id, num_tokens, token_ids, request_id)
        return self._run(Call("Append", req, True, request_id), timeout_s)

    def fork(
        self,
        parent_seq_id: str,
        child_seq_id: str,
        *,
        request_id: str | None = None,
        lease_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.ForkResponse:
        return self._run(fork_call(parent_seq_id, child_seq_id, request_id, lease_id), timeout_s)

    def free(
        self, seq_id: str, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.FreeResponse:
        return self._run(free_call(seq_id, request_id), timeout_s)

    def commit(
        self,
        seq_id: str,
        num_computed_tokens: int,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.CommitResponse:
        """The KV of the first ``num_computed_tokens`` tokens is written: its full blocks become
        prefix-cache hits (idempotent, so retried even without a request id)."""
        return self._run(commit_call(seq_id, num_computed_tokens, request_id), timeout_s)

    def get_block_table(self, seq_id: str, *, timeout_s: float | None = None) -> pb.BlockTable:
        return self._run(read_call("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq_id)), timeout_s)

    def step(self, request: pb.StepRequest, *, timeout_s: float | None = None) -> pb.StepResponse:
        """A general Step (sub-message and/or packed items); retried only if ``request.request_id``."""
        return self._run(step_call(request), timeout_s)

    def step_decode(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[int] | None = None,
        frees: Iterable[str] = (),
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.StepResponse:
        """One decode step in the packed form; see :func:`step_decode_request` and
        :func:`new_blocks_by_sequence`. Per-item failures come back in ``.errors``."""
        return self.step(step_decode_request(seq_ids, token_ids, frees, request_id), timeout_s=timeout_s)

    def get_stats(self, *, timeout_s: float | None = None) -> pb.Stats:
        return self._run(read_call("GetStats", pb.GetStatsRequest()), timeout_s)

    def get_config(self, *, timeout_s: float | None = None) -> pb.Config:
        return self._run(read_call("GetConfig", pb.GetConfigRequest()), timeout_s)

    def keep_alive(
        self,
        lease_id: str,
        *,
        ttl_ms: int = 0,
        attach_seq_ids: Sequence[str] = (),
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.KeepAliveResponse:
        return self._run(keep_alive_call(lease_id, ttl_ms, attach_seq_ids, request_id), timeout_s)

    def swap_in(
        self, seq_id: str, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.SwapInResponse:
        return self._run(swap_in_call(seq_id, request_id), timeout_s)

    def reset_prefix_cache(
        self, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.ResetPrefixCacheResponse:
        """Forget every prefix-cache hash (after a lost cache host); admin only with auth on."""
        return self._run(reset_prefix_cache_call(request_id), timeout_s)

    def preempt(
        self, seq_id: str, mode: str = "", *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.PreemptResponse:
        return self._run(preempt_call(seq_id, mode, request_id), timeout_s)


class AsyncBlockManagerClient(AsyncGrpcClient):
    """asyncio block manager client; the same methods as :class:`BlockManagerClient`, awaitable."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._stub = pb_grpc.BlockManagerStub(self.channel)

    async def allocate(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        lease_id: str | None = None,
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> pb.AllocateResponse:
        req = allocate_request(seq_id, num_tokens, token_ids, priority, request_id, lease_id, cache_salt)
        return await self._run(Call("Allocate", req, True, request_id), timeout_s)

    async def append(
        self,
        seq_id: str,
        num_tokens: int = 1,
        token_ids: Sequence[int] | None = None,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.AppendResponse:
        req = append_request(seq_id, num_tokens, token_ids, request_id)
        return await self._run(Call("Append", req, True, request_id), timeout_s)

    async def fork(
        self,
        parent_seq_id: str,
        child_seq_id: str,
        *,
        request_id: str | None = None,
        lease_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.ForkResponse:
        return await self._run(fork_call(parent_seq_id, child_seq_id, request_id, lease_id), timeout_s)

    async def free(
        self, seq_id: str, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.FreeResponse:
        return await self._run(free_call(seq_id, request_id), timeout_s)

    async def commit(
        self,
        seq_id: str,
        num_computed_tokens: int,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.CommitResponse:
        return await self._run(commit_call(seq_id, num_computed_tokens, request_id), timeout_s)

    async def get_block_table(self, seq_id: str, *, timeout_s: float | None = None) -> pb.BlockTable:
        return await self._run(read_call("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq_id)), timeout_s)

    async def step(self, request: pb.StepRequest, *, timeout_s: float | None = None) -> pb.StepResponse:
        return await self._run(step_call(request), timeout_s)

    async def step_decode(
        self,
        seq_ids: Sequence[str],
        token_ids: Sequence[int] | None = None,
        frees: Iterable[str] = (),
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.StepResponse:
        return await self.step(
            step_decode_request(seq_ids, token_ids, frees, request_id), timeout_s=timeout_s
        )

    async def get_stats(self, *, timeout_s: float | None = None) -> pb.Stats:
        return await self._run(read_call("GetStats", pb.GetStatsRequest()), timeout_s)

    async def get_config(self, *, timeout_s: float | None = None) -> pb.Config:
        return await self._run(read_call("GetConfig", pb.GetConfigRequest()), timeout_s)

    async def keep_alive(
        self,
        lease_id: str,
        *,
        ttl_ms: int = 0,
        attach_seq_ids: Sequence[str] = (),
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> pb.KeepAliveResponse:
        return await self._run(keep_alive_call(lease_id, ttl_ms, attach_seq_ids, request_id), timeout_s)

    async def swap_in(
        self, seq_id: str, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.SwapInResponse:
        return await self._run(swap_in_call(seq_id, request_id), timeout_s)

    async def reset_prefix_cache(
        self, *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.ResetPrefixCacheResponse:
        return await self._run(reset_prefix_cache_call(request_id), timeout_s)

    async def preempt(
        self, seq_id: str, mode: str = "", *, request_id: str | None = None, timeout_s: float | None = None
    ) -> pb.PreemptResponse:
        return await self._run(preempt_call(seq_id, mode, request_id), timeout_s)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncBlockManagerClient",
    "AsyncGrpcClient",
    "BlockManagerClient",
    "Call",
    "GrpcClient",
    "RetryPolicy",
    "allocate_request",
    "append_request",
    "channel_options",
    "new_blocks_by_sequence",
    "step_decode_request",
]
