"""gRPC plumbing shared by the cache host and the worker: server, health, reflection, signals.

A synchronous server with a thread pool (on these hosts it serves more calls/s than grpc.aio, see
docs/architecture.md; the worker's Step holds a lock for the forward pass anyway). Health reports SERVING
for "" and the service name once the process is ready, NOT_SERVING while shutting down.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.log_limit import LogLimiter
from pagedkv.malformed import MalformedRequestInterceptor
from pagedkv.tls import add_port

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace: float | None = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


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
) -> RunningServer:
    """Start a server with ``register``'s servicer, health and reflection; SERVING at once.

    TLS / mutual TLS and the plaintext rule are pagedkv/tls.py's (docs/security.md); with
    ``auth_tokens_file`` every call but health needs a bearer token from that file."""
    limiter = LogLimiter()
    interceptors: list[grpc.ServerInterceptor] = []
    if auth_tokens_file:
        from pagedkv.auth import AuthInterceptor, TokenStore

        interceptors.append(AuthInterceptor(TokenStore.load(auth_tokens_file), limiter=limiter))
    interceptors.append(MalformedRequestInterceptor(limiter))  # innermost: wraps the request parsers
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_prefix),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
        interceptors=interceptors or None,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = add_port(server, host, port, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
                     allow_insecure=allow_insecure)
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=bound, health=health_servicer)


def stop_event_on_signals() -> threading.Event:
    """An event set by the first SIGTERM or SIGINT (main thread only)."""
    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop
