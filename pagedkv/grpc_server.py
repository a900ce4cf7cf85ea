"""The gRPC server of every role (block manager, cache host, worker): creation, interceptors,
TLS credentials and binding on the configured address, health, reflection, graceful stop.

A synchronous server with a thread pool (it serves more calls/s than grpc.aio for the same handlers,
figures in docs/architecture.md; every block-manager handler is a microsecond critical section and
the worker's Step holds a lock for the forward pass anyway). Interceptors, outermost first: the
caller's own (metrics), bearer-token auth when a token store is given, then the malformed-request
guard around the parsers. Health reports SERVING for "" and the service name once the server
started, NOT_SERVING while shutting down.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.auth import AuthInterceptor, TokenStore
from pagedkv.log_limit import LogLimiter
from pagedkv.malformed import MalformedRequestInterceptor
from pagedkv.tls import add_port

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def graceful_stop(server: grpc.Server, health_servicer: health.HealthServicer, grace: float | None) -> None:
    """Health NOT_SERVING first (load balancers stop sending), then finish in-flight calls within `grace`."""
    health_servicer.enter_graceful_shutdown()
    server.stop(grace).wait()


@dataclass(slots=True)
class GrpcServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace: float | None = 2.0) -> None:
        graceful_stop(self.server, self.health, grace)


def start_server(
    host: str,
    port: int,
    register: Callable[[grpc.Server], None],
    service_name: str,
    max_workers: int = 4,
    thread_prefix: str = "rpc",
    *,
    tls_cert: str = "",
    tls_key: str = "",
    tls_client_ca: str = "",
    allow_insecure: bool = False,
    auth_tokens_file: str = "",
    token_store: TokenStore | None = None,
    limiter: LogLimiter | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    maximum_concurrent_rpcs: int | None = None,
    enable_reflection: bool = True,
) -> GrpcServer:
    """Start a server with ``register``'s servicer, health and (unless told not to) reflection;
    SERVING at once. Raises RuntimeError when the address cannot be bound (nothing is left running).

    TLS / mutual TLS and the plaintext rule are pagedkv/tls.py's (docs/security.md); with
    ``auth_tokens_file`` (or a loaded ``token_store``) every call but health needs a bearer token.
    ``limiter`` rate-limits the rejection log lines (the servicer's own, when it has one);
    ``interceptors`` go outside auth (e.g. RPC metrics, which then count auth rejections too)."""
    limiter = limiter or LogLimiter()
    chain: list[grpc.ServerInterceptor] = list(interceptors)
    if token_store is None and auth_tokens_file:
        token_store = TokenStore.load(auth_tokens_file)
    if token_store is not None:
        chain.append(AuthInterceptor(token_store, limiter=limiter))
    chain.append(MalformedRequestInterceptor(limiter))  # innermost: wraps the request parsers
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_prefix),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients ping every few seconds while calls are in flight, to find a silent (half-open)
            # link (frontend/clients/block_manager.py channel_options): answer them, never GOAWAY
            # too_many_pings.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        interceptors=chain,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if enable_reflection:
        reflection.enable_server_reflection(
            (
                service_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
    bound = add_port(
        server,
        host,
        port,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        allow_insecure=allow_insecure,
    )
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server=server, port=bound, health=health_servicer)


def stop_event_on_signals() -> threading.Event:
    """An event set by the first SIGTERM or SIGINT (main thread only)."""
    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop
