"""Process wiring for the block manager: settings, logging, recovery, KV events, metrics,
signals; the gRPC server itself (TLS, auth, health, reflection) is pagedkv/grpc_server.py's,
as for every role.

A synchronous gRPC server with a small thread pool: it serves more calls per
second than grpc.aio for the same handlers (docs/architecture.md, "Measured,
not assumed", has the figures), and every handler is a microsecond-scale
critical section, so threads never wait on I/O while holding the state lock.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health

from pagedkv.auth import TokenStore
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.kv_groups import parse_kv_groups
from pagedkv.block_manager_svc.events import EventHub
from pagedkv.block_manager_svc.kv_events_zmq import ZmqEventConfig, ZmqKvEventPublisher
from pagedkv.block_manager_svc.metrics import MetricsServer, setup_metrics
from pagedkv.block_manager_svc.reliability import Reliability
from pagedkv.block_manager_svc.servicer import BlockManagerServicer
from pagedkv.block_manager_svc.settings import BlockManagerSettings, load_settings
from pagedkv.block_manager_svc.tenancy import NO_TENANCY, TenantScope, ledger_from_store
from pagedkv.grpc_server import graceful_stop
from pagedkv.grpc_server import start_server as start_grpc_server
from pagedkv.kv_capacity import memory_bytes
from pagedkv.logging_setup import configure_logging
from pagedkv.v1 import block_manager_pb2, block_manager_pb2_grpc
from pagedkv.watermark import watermark_blocks

SERVICE_NAME = block_manager_pb2.DESCRIPTOR.services_by_name["BlockManager"].full_name
log = structlog.get_logger("pagedkv.block_manager")


@dataclass(slots=True)
class BlockManagerServer:
    """A started server and what tests and the CLI need to drive it."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    servicer: BlockManagerServicer
    reliability: Reliability | None = None
    metrics: MetricsServer | None = None
    kv_events: ZmqKvEventPublisher | None = None

    def stop(self, grace: float | None = None) -> None:
        graceful_stop(self.server, self.health, grace)
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.reliability is not None:
            self.reliability.close()  # final snapshot, journal closed
            self.reliability = None


def build_core(settings: BlockManagerSettings) -> BlockManager:
    return BlockManager(
        CoreConfig(
            num_gpu_blocks=settings.num_gpu_blocks,
            block_size=settings.block_size,
            num_cpu_blocks=settings.num_cpu_blocks,
            eviction_policy=settings.eviction_policy,
            enable_prefix_caching=settings.enable_prefix_caching,
            preemption_mode=settings.preemption_mode,
            watermark_blocks=watermark_blocks(settings.watermark_fraction, settings.num_gpu_blocks),
            kv_bytes_per_block=settings.kv_bytes_per_block,
            host_link_bytes_per_s=settings.host_link_gb_per_s * 1e9,
            prefill_tokens_per_s=settings.prefill_tokens_per_s,
            kv_cache_dtype=settings.kv_cache_dtype,
            kv_cache_memory_bytes=memory_bytes(settings.kv_cache_memory),
            kv_groups=parse_kv_groups(settings.kv_groups),
        )
    )


def start_server(settings: BlockManagerSettings) -> BlockManagerServer:
    """Build and start the server; raises RuntimeError if the port is taken."""
    # Security and observability (docs/security.md, docs/observability.md): all off by default.
    store = TokenStore.load(settings.auth_tokens_file) if settings.auth_tokens_file else None
    tenancy = TenantScope() if store is not None else NO_TENANCY
    servicer = BlockManagerServicer(build_core(settings), settings.num_cpu_blocks, tenancy)
    registry = rpc_metrics = None
    if settings.metrics_port:
        registry, rpc_metrics = setup_metrics(servicer)
    # Recovers from --state-dir (before the port opens), starts the lease sweeper and snapshots.
    reliability = servicer.reliable.start(settings)
    if store is not None:
        servicer._core.enable_tenancy(ledger_from_store(store))
    if settings.enable_kv_events:
        servicer.events_hub = EventHub(
            servicer._lock, settings.max_event_watchers, settings.event_queue_size, tenancy=store is not None
        )
        servicer.events_hub.attach(servicer._core)
    kv_events = metrics = None
    try:
        kv_events = start_kv_events(settings, servicer.events_hub)
        try:
            metrics = (
                MetricsServer(registry, settings.metrics_host, settings.metrics_port) if registry else None
            )
        except OSError as e:
            raise RuntimeError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {e}"
            ) from e
        # Each WatchEvents stream holds a thread for its lifetime: extra threads so they cannot starve RPCs.
        watchers = settings.max_event_watchers if settings.enable_kv_events else 0
        grpc_server = start_grpc_server(
            settings.host,
            settings.port,
            lambda server: block_manager_pb2_grpc.add_BlockManagerServicer_to_server(servicer, server),
            SERVICE_NAME,
            settings.max_workers + watchers,
            "bm-rpc",
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
            tls_client_ca=settings.tls_client_ca,
            allow_insecure=settings.allow_insecure,
            token_store=store,
            limiter=servicer.log_limit,
            interceptors=[rpc_metrics]
            if rpc_metrics is not None
            else (),  # outermost: counts auth rejections
            max_message_bytes=settings.max_message_bytes,
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
            enable_reflection=settings.enable_reflection,
        )
    except RuntimeError:
        reliability.close()
        if kv_events is not None:
            kv_events.close()
        if metrics is not None:
            metrics.stop()
        raise
    return BlockManagerServer(
        server=grpc_server.server,
        port=grpc_server.port,
        health=grpc_server.health,
        servicer=servicer,
        reliability=reliability,
        metrics=metrics,
        kv_events=kv_events,
    )


def start_kv_events(settings: BlockManagerSettings, hub: EventHub | None) -> ZmqKvEventPublisher | None:
    """The vLLM-format ZeroMQ publisher, fed by the event hub (None when not configured)."""
    if not settings.kv_events_endpoint or hub is None:
        return None
    publisher = ZmqKvEventPublisher(
        ZmqEventConfig(
            endpoint=settings.kv_events_endpoint,
            replay_endpoint=settings.kv_events_replay_endpoint,
            topic=settings.kv_events_topic,
            block_size=settings.block_size,
            encoding=settings.kv_events_encoding,
            buffer_steps=settings.kv_events_buffer_steps,
        )
    )
    hub.add_sink(publisher)
    return publisher


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    configure_logging(settings.log_level, settings.log_format)
    try:
        running = start_server(settings)
    except RuntimeError as e:
        log.error("startup_failed", error=str(e))
        return 1
    log.info(
        "block_manager_listening",
        address=f"{settings.host}:{running.port}",
        num_gpu_blocks=settings.num_gpu_blocks,
        block_size=settings.block_size,
        num_cpu_blocks=settings.num_cpu_blocks,
        eviction_policy=settings.eviction_policy,
        reflection=settings.enable_reflection,
        tls="mtls" if settings.tls_client_ca else "tls" if settings.tls_cert else "off",
        auth=bool(settings.auth_tokens_file),
        metrics=f"{settings.metrics_host}:{running.metrics.port}" if running.metrics else "off",
        kv_events=settings.enable_kv_events,
        kv_events_zmq=(running.kv_events.endpoint if running.kv_events else "off"),
        kv_events_replay=(running.kv_events.replay_endpoint if running.kv_events else "off"),
        kv_events_topic=settings.kv_events_topic if running.kv_events else "",
    )
    stopping = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        log.info("shutting_down", signal=signal.Signals(signum).name, grace_s=settings.grace_period_s)
        threading.Thread(target=running.stop, args=(settings.grace_period_s,), daemon=True).start()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    running.server.wait_for_termination()
    log.info("stopped")
    return 0
